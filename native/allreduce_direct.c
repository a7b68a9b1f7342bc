/* allreduce_direct.c -- allreduce in one round, for few ranks and small messages.
 *
 * Steps (n ranks, S bytes):
 *   1. exchange: send the header and the whole input to every other rank and receive every
 *      other rank's, all 2(n-1) streams at once in one poll loop (a rank never waits for a send
 *      to finish before it reads, so full socket buffers cannot deadlock two ranks);
 *   2. reduce in rank order: out = in_0 OP in_1 OP ... OP in_{n-1}, the same order on every rank,
 *      so every rank ends with the same bits;
 *   3. avg: divide by n.
 *
 * Cost: one latency, (n-1) S bytes sent and received per rank, (n-1) S reduced:
 *   time ~ a + (n-1) S (b + g). Recursive doubling takes log2 p latencies (+2 to fold when n is not
 *   a power of two: 3 at n = 3, against 1 here) for S log2 p bytes, so this wins while latency
 *   dominates: few ranks, small S. Where it runs (allreduce.c, measured there): at most
 *   HR_DIRECT_MAX_RANKS (3) ranks, whose ring neighbours are every rank, and c->direct_max bytes
 *   sent per rank.
 */
#include "hr_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int peer;
    size_t sd, rd;          /* bytes sent / received so far, header included */
    int hdr_ok;
    hr_hdr_t rh;
    unsigned char *in;      /* this peer's input */
} direct_peer_t;

/* Move what the sockets take now; returns 1 if anything moved, 0 if nothing, -1 on an error
 * (recorded). */
static int direct_progress(hr_op_t *op, direct_peer_t *ps, int np, const void *mine, size_t bytes) {
    size_t tot = sizeof(hr_hdr_t) + bytes;
    int i, moved = 0;
    char why[256];
    for (i = 0; i < np; i++) {
        direct_peer_t *p = &ps[i];
        struct iovec iov[2];
        ssize_t r;
        if (p->sd < tot) {
            r = hr_tcp_sendv(&op->c->tcp, p->peer, iov,
                             hr_window(iov, &op->hdr, sizeof(hr_hdr_t), (void *)mine, p->sd, tot), why,
                             sizeof(why));
            if (r < 0) return hr_op_fail_peer(op, 0, p->peer, why), -1;
            p->sd += (size_t)r;
            moved |= r > 0;
        }
        if (p->rd < tot) {
            r = hr_tcp_recvv(&op->c->tcp, p->peer, iov,
                             hr_window(iov, &p->rh, sizeof(hr_hdr_t), p->in, p->rd, tot), why, sizeof(why));
            if (r < 0) return hr_op_fail_peer(op, 1, p->peer, why), -1;
            p->rd += (size_t)r;
            moved |= r > 0;
            if (!p->hdr_ok && p->rd >= sizeof(hr_hdr_t)) {
                if (hr_op_check_hdr(op, &p->rh, p->peer) != HR_OK) return -1;
                p->hdr_ok = 1;
            }
        }
    }
    return moved;
}

/* Wait (poll) until one of the unfinished streams can move or the deadline passes. Returns 1,
 * or -1 with the error recorded (the first unfinished peer is named on a timeout). */
static int direct_wait(hr_op_t *op, direct_peer_t *ps, int np, size_t tot) {
    struct pollfd pf[HR_DIRECT_MAX_RANKS];
    int i, k = 0, first = -1, ms, r;
    double left = op->deadline - hr_now();
    char why[128];
    for (i = 0; i < np; i++) {
        short ev = (short)((ps[i].sd < tot ? POLLOUT : 0) | (ps[i].rd < tot ? POLLIN : 0));
        if (!ev) continue;
        if (first < 0) first = i;
        pf[k].fd = hr_tcp_fd(&op->c->tcp, ps[i].peer);
        pf[k].events = ev;
        k++;
    }
    if (left <= 0) {
        snprintf(why, sizeof(why), "timed out after %.1f s", op->timeout);
        return hr_op_fail_peer(op, ps[first].rd < tot, ps[first].peer, why), -1;
    }
    ms = left > 1.0 ? 1000 : (int)(left * 1000.0) + 1;     /* re-check the clock each second */
    r = hr_poll(pf, (nfds_t)k, ms);
    if (r < 0 && errno != EINTR) return hr_op_fail(op, "poll(): %s", strerror(errno)), -1;
    return 1;
}

/* rank k's input: this rank's own, or its slot in ins (ranks other than r, in rank order) */
#define DIRECT_IN(k) ((k) == r ? (const unsigned char *)mine : ins + bytes * (size_t)((k) < r ? (k) : (k) - 1))

int hr_allreduce_direct(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype, int redop) {
    hr_comm_t *c = op->c;
    int n = c->size, r = c->rank, i, np = n - 1, rc = HR_ERR, moved;
    size_t bytes = count * hr_dtype_size(dtype), tot = sizeof(hr_hdr_t) + bytes;
    direct_peer_t ps[HR_DIRECT_MAX_RANKS];
    unsigned char *ins;
    const void *mine = sbuf;

    if (n > HR_DIRECT_MAX_RANKS) return hr_op_fail(op, "direct allreduce: %d ranks, at most %d", n, HR_DIRECT_MAX_RANKS);
    if (!(ins = malloc(bytes * (size_t)np + 1))) return hr_op_fail(op, "malloc(): out of memory");
    op->tx_total = op->rx_total = bytes * (size_t)np;
    for (i = 0; i < np; i++) {
        memset(&ps[i], 0, sizeof(ps[i]));
        ps[i].peer = (r + 1 + i) % n;           /* everyone starts with a different peer */
        ps[i].in = (unsigned char *)DIRECT_IN(ps[i].peer);
    }
    if (sbuf == rbuf && bytes) {                /* in place: keep the input while rbuf fills */
        if (hr_comm_tmp(op, bytes) != HR_OK) goto cleanup;
        memcpy(c->tmp, sbuf, bytes);
        mine = c->tmp;
    }
    for (;;) {
        int left = 0;
        if ((moved = direct_progress(op, ps, np, mine, bytes)) < 0) goto cleanup;
        for (i = 0; i < np; i++) left |= ps[i].sd < tot || ps[i].rd < tot;
        if (!left) break;
        if (!moved && direct_wait(op, ps, np, tot) < 0) goto cleanup;
    }
    op->tx_done = op->rx_done = bytes * (size_t)np;
    /* rank order, in_0 OP in_1 OP ..., on every rank (ins: the other ranks' inputs by rank) */
    hr_reduce3(rbuf, DIRECT_IN(0), DIRECT_IN(1), count, dtype, redop);
    for (i = 2; i < n; i++) hr_reduce(rbuf, DIRECT_IN(i), count, dtype, redop);
    if (redop == HR_AVG) hr_divide(rbuf, count, dtype, n);
    rc = HR_OK;
cleanup:
    free(ins);
    return rc;
}
