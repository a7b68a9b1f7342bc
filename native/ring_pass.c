/* ring_pass.c -- one pipelined pass around the ring: the engine of ring reduce-scatter,
 * ring allgather and (both in turn) ring allreduce.
 *
 * The buffer is cut into n chunks (hr_chunks: sizes differ by at most one element, any may be
 * empty). In step s = 0 .. n-2, rank r sends chunk (first - s) mod n to its right neighbour
 * r+1 and receives chunk (first - s - 1) mod n from its left neighbour r-1. In reduce mode the
 * received bytes are combined into the local chunk (dst = dst OP received), in copy mode they
 * overwrite it. The chunk received in step s is the one sent in step s+1.
 *
 * Pipelining: the two directions are independent non-blocking streams driven by one poll loop,
 * and the send of step s+1 does not wait for step s to finish: it may send every byte of its
 * chunk that has already been received (and, in reduce mode, reduced), in pieces of at least
 * HR_MIN_SEND bytes. Received bytes land in a 256 KiB staging buffer and are reduced right
 * away (base = src OP received, so out of place needs no copy of the input) while the kernel
 * keeps receiving, so sending, receiving and reducing overlap and the
 * reduction reads cache-hot data. There is no deadlock: every rank's step-0 chunk is available
 * in full, so every stream can always make progress until its peer's buffer fills.
 *
 * Cost (S bytes, n ranks, latency a, per-byte time b, reduction per byte g):
 *   (n-1) steps, each rank sends and receives (n-1)/n * S bytes; time ~ (n-1)(a + S/n b [+ S/n g]),
 *   with the pipelining hiding most of the step latencies for large S.
 */
#define _GNU_SOURCE
#include "hr_internal.h"

#include <stdio.h>
#include <string.h>

#define HR_STAGE_BYTES (256u * 1024u)
#define HR_MIN_SEND (64u * 1024u)

static inline int mod(int a, int n) { return ((a % n) + n) % n; }

int hr_ring_pass(hr_op_t *op, unsigned char *base, const unsigned char *src, const size_t *off,
                 const size_t *cnt, int first, int reduce, int dtype, int redop, int send_hdr) {
    hr_comm_t *c = op->c;
    int n = c->size, r = c->rank, right = mod(r + 1, n), left = mod(r - 1, n), s;
    size_t esz = hr_dtype_size(dtype), hl = send_hdr ? sizeof(hr_hdr_t) : 0;
    int ss = 0, rs = 0;            /* current send / receive step */
    size_t sd = 0, rd = 0, pend = 0; /* bytes of the current chunk sent / completed; staged */
    size_t shd = 0, rhd = 0;       /* header bytes sent / received */
    hr_hdr_t rh;
    char why[256];

    if (!src) src = base;
    if (n == 1) return HR_OK;
    for (s = 0; s < n - 1; s++) {
        op->tx_total += cnt[mod(first - s, n)] * esz;
        op->rx_total += cnt[mod(first - s - 1, n)] * esz;
    }
    if (reduce && hr_comm_stage(op, HR_STAGE_BYTES) != HR_OK) return HR_ERR;

    while (ss < n - 1 || rs < n - 1) {
        int progressed = 0, want_send = 0, ready;
        struct iovec iov[2];
        int k;
        ssize_t got;

        /* ---- send side ---- */
        while (ss < n - 1) {
            int ci = mod(first - ss, n);
            size_t clen = cnt[ci] * esz, avail;
            if (ss == 0 || rs > ss - 1) avail = clen;
            else avail = rd; /* rs == ss - 1: what has been received (and reduced) so far */
            if (shd == hl && sd == clen) { ss++; sd = 0; progressed = 1; continue; }
            k = 0;
            if (shd < hl) {
                iov[k].iov_base = (char *)&op->hdr + shd;
                iov[k++].iov_len = hl - shd;
            }
            if (avail > sd && (avail == clen || avail - sd >= HR_MIN_SEND)) {
                /* step 0 sends the input; later steps forward what was reduced into base */
                iov[k].iov_base = (ss == 0 ? (unsigned char *)src : base) + off[ci] * esz + sd;
                iov[k++].iov_len = avail - sd;
            }
            if (k == 0) break; /* waiting for data from the left */
            want_send = 1;
            got = hr_tcp_sendv(&c->tcp, right, iov, k, why, sizeof(why));
            if (got < 0) return hr_op_fail_peer(op, 0, right, why);
            if (got == 0) break;
            progressed = 1;
            if (shd < hl) {
                size_t h = (size_t)got < hl - shd ? (size_t)got : hl - shd;
                shd += h;
                got -= (ssize_t)h;
            }
            sd += (size_t)got;
            op->tx_done += (size_t)got;
        }

        /* ---- receive side ---- */
        while (rs < n - 1) {
            int ci = mod(first - rs - 1, n);
            size_t clen = cnt[ci] * esz, room;
            unsigned char *dst = base + off[ci] * esz;
            if (rhd == hl && rd == clen) { rs++; rd = 0; progressed = 1; continue; }
            k = 0;
            if (rhd < hl) {
                iov[k].iov_base = (char *)&rh + rhd;
                iov[k++].iov_len = hl - rhd;
            }
            if (reduce) {
                room = clen - rd - pend;
                if (room > HR_STAGE_BYTES - pend) room = HR_STAGE_BYTES - pend;
                if (room) { iov[k].iov_base = c->stage + pend; iov[k++].iov_len = room; }
            } else if (clen > rd) {
                iov[k].iov_base = dst + rd;
                iov[k++].iov_len = clen - rd;
            }
            got = hr_tcp_recvv(&c->tcp, left, iov, k, why, sizeof(why));
            if (got < 0) return hr_op_fail_peer(op, 1, left, why);
            if (got == 0) break;
            progressed = 1;
            if (rhd < hl) {
                size_t h = (size_t)got < hl - rhd ? (size_t)got : hl - rhd;
                rhd += h;
                got -= (ssize_t)h;
                if (rhd == hl && hr_op_check_hdr(op, &rh, left) != HR_OK) return HR_ERR;
            }
            op->rx_done += (size_t)got;
            if (reduce) {
                size_t whole;
                pend += (size_t)got;
                whole = pend - pend % esz;
                if (whole) {
                    hr_reduce3(dst + rd, src + (size_t)(dst - base) + rd, c->stage, whole / esz,
                               dtype, redop);
                    rd += whole;
                    pend -= whole;
                    if (pend) memmove(c->stage, c->stage + whole, pend);
                }
            } else {
                rd += (size_t)got;
            }
        }

        if (progressed) continue;
        ready = hr_tcp_wait(&c->tcp, (ss < n - 1 && want_send) ? right : -1,
                            rs < n - 1 ? left : -1, op->deadline, why, sizeof(why));
        if (ready < 0) return hr_op_fail(op, "%s", why);
        if (ready == 0) {
            snprintf(why, sizeof(why), "timed out after %.1f s", op->timeout);
            return rs < n - 1 ? hr_op_fail_peer(op, 1, left, why)
                              : hr_op_fail_peer(op, 0, right, why);
        }
    }
    return HR_OK;
}
