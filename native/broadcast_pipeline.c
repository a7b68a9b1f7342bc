/* broadcast_pipeline.c -- pipelined chain broadcast.
 *
 * Ranks form a chain in virtual-rank order starting at the root: v = (r - root) mod n, and
 * virtual rank v receives from v-1 and forwards to v+1. Every rank forwards bytes as soon as
 * they have arrived (in pieces of at least HR_MIN_SEND bytes, or the rest), so the message
 * streams down the chain and all links are busy at once.
 *
 * Cost: S bytes per link; time ~ (n-1) a + S b + (n-2) * piece * b, i.e. close to one message
 * time for large S (bus bandwidth factor 1). For tiny messages the (n-1) latencies of the chain
 * are worse than a binomial tree's log2 n; broadcast is rarely latency-critical in training.
 */
#define _GNU_SOURCE
#include "hr_internal.h"

#include <stdio.h>

#define HR_MIN_SEND (64u * 1024u)

/* Contract: all ranks pass the same count, dtype and root; on return buf on every rank holds
 * the root's count elements. Returns HR_OK, or HR_ERR with c->err set. */
int hr_broadcast_pipeline(hr_comm_t *c, void *buf, size_t count, int dtype, int root,
                          double timeout) {
    hr_op_t op;
    int n = c->size, v, prev, next;
    size_t bytes, hl = sizeof(hr_hdr_t), shd = 0, rhd = 0, sd = 0, rd = 0;
    hr_hdr_t rh;
    char why[256];

    if (hr_op_begin(&op, c, HR_K_BROADCAST, dtype, 0, count, root, timeout) != HR_OK)
        return HR_ERR;
    if (n == 1) return HR_OK;
    bytes = count * hr_dtype_size(dtype);
    v = (c->rank - root + n) % n;
    prev = v == 0 ? -1 : (c->rank - 1 + n) % n;
    next = v == n - 1 ? -1 : (c->rank + 1) % n;
    if (prev < 0) return hr_sendrecv(&op, next, buf, bytes, 1, -1, NULL, 0, 0);
    op.rx_total = bytes;
    op.tx_total = next >= 0 ? bytes : 0;
    if (next < 0) { shd = hl; sd = bytes; }

    while (rhd < hl || rd < bytes || shd < hl || sd < bytes) {
        int progressed = 0, want_send = 0, ready, k;
        struct iovec iov[2];
        ssize_t got;

        if (rhd < hl || rd < bytes) {
            k = 0;
            if (rhd < hl) { iov[k].iov_base = (char *)&rh + rhd; iov[k++].iov_len = hl - rhd; }
            if (rd < bytes) {
                iov[k].iov_base = (char *)buf + rd;
                iov[k++].iov_len = bytes - rd;
            }
            got = hr_tcp_recvv(&c->tcp, prev, iov, k, why, sizeof(why));
            if (got < 0) return hr_op_fail_peer(&op, 1, prev, why);
            if (got > 0) {
                progressed = 1;
                if (rhd < hl) {
                    size_t h = (size_t)got < hl - rhd ? (size_t)got : hl - rhd;
                    rhd += h;
                    got -= (ssize_t)h;
                    if (rhd == hl && hr_op_check_hdr(&op, &rh, prev) != HR_OK) return HR_ERR;
                }
                rd += (size_t)got;
                op.rx_done = rd;
            }
        }
        if (shd < hl || sd < bytes) {
            k = 0;
            if (shd < hl) {
                iov[k].iov_base = (char *)&op.hdr + shd;
                iov[k++].iov_len = hl - shd;
            }
            if (rd > sd && (rd == bytes || rd - sd >= HR_MIN_SEND)) {
                iov[k].iov_base = (char *)buf + sd;
                iov[k++].iov_len = rd - sd;
            }
            if (k) {
                want_send = 1;
                got = hr_tcp_sendv(&c->tcp, next, iov, k, why, sizeof(why));
                if (got < 0) return hr_op_fail_peer(&op, 0, next, why);
                if (got > 0) {
                    progressed = 1;
                    if (shd < hl) {
                        size_t h = (size_t)got < hl - shd ? (size_t)got : hl - shd;
                        shd += h;
                        got -= (ssize_t)h;
                    }
                    sd += (size_t)got;
                    op.tx_done = sd;
                }
            }
        }
        if (progressed) continue;
        ready = hr_tcp_wait(&c->tcp, want_send ? next : -1, (rhd < hl || rd < bytes) ? prev : -1,
                            op.deadline, why, sizeof(why));
        if (ready < 0) return hr_op_fail(&op, "%s", why);
        if (ready == 0) {
            snprintf(why, sizeof(why), "timed out after %.1f s", op.timeout);
            return (rhd < hl || rd < bytes) ? hr_op_fail_peer(&op, 1, prev, why)
                                            : hr_op_fail_peer(&op, 0, next, why);
        }
    }
    return HR_OK;
}
