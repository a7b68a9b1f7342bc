/* direct.c -- one round of direct exchange: a stream to and from every other rank at once.
 *
 * The transport step of the direct algorithms (allreduce_direct.c, and allgather, reduce-scatter,
 * alltoall and barrier in direct_others.c) on at most HR_DIRECT_MAX_RANKS ranks, whose ring
 * neighbours are every rank, so every connection exists. Steps: for each peer, send the header
 * and x->sn bytes and receive the peer's header and x->rn bytes, all 2(n-1) streams in one poll
 * loop (a rank never waits for a send to finish before it reads, so full socket buffers cannot
 * deadlock two ranks); each header is checked as it arrives (a mismatched collective is named).
 *
 * Cost: one latency for the whole collective, against n-1 (ring, pairwise) or ceil(log2 n)
 * (dissemination) rounds.
 */
#include "hr_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>

/* Move what the sockets take now; returns 1 if anything moved, 0 if nothing, -1 on an error
 * (recorded). */
static int direct_progress(hr_op_t *op, hr_xfer_t *xs, int np) {
    int i, moved = 0;
    char why[256];
    for (i = 0; i < np; i++) {
        hr_xfer_t *x = &xs[i];
        size_t st = sizeof(hr_hdr_t) + x->sn, rt = sizeof(hr_hdr_t) + x->rn;
        struct iovec iov[2];
        ssize_t r;
        if (x->sd < st) {
            r = hr_tcp_sendv(&op->c->tcp, x->peer, iov,
                             hr_window(iov, &op->hdr, sizeof(hr_hdr_t), (void *)x->s, x->sd, st), why,
                             sizeof(why));
            if (r < 0) return hr_op_fail_peer(op, 0, x->peer, why), -1;
            x->sd += (size_t)r;
            op->tx_done += (size_t)r;
            moved |= r > 0;
        }
        if (x->rd < rt) {
            r = hr_tcp_recvv(&op->c->tcp, x->peer, iov,
                             hr_window(iov, &x->rh, sizeof(hr_hdr_t), x->r, x->rd, rt), why, sizeof(why));
            if (r < 0) return hr_op_fail_peer(op, 1, x->peer, why), -1;
            x->rd += (size_t)r;
            op->rx_done += (size_t)r;
            moved |= r > 0;
            if (!x->hdr_ok && x->rd >= sizeof(hr_hdr_t)) {
                if (hr_op_check_hdr(op, &x->rh, x->peer) != HR_OK) return -1;
                x->hdr_ok = 1;
            }
        }
    }
    return moved;
}

/* Wait until one of the unfinished streams can move or the deadline passes. Returns 1, or -1
 * with the error recorded (the first unfinished peer is named on a timeout). */
static int direct_wait(hr_op_t *op, hr_xfer_t *xs, int np) {
    struct pollfd pf[HR_DIRECT_MAX_RANKS];
    int i, k = 0, first = -1, ms, r;
    double left = op->deadline - hr_now();
    char why[128];
    for (i = 0; i < np; i++) {
        int send = xs[i].sd < sizeof(hr_hdr_t) + xs[i].sn, recv = xs[i].rd < sizeof(hr_hdr_t) + xs[i].rn;
        if (!send && !recv) continue;
        if (first < 0) first = i;
        pf[k].fd = hr_tcp_fd(&op->c->tcp, xs[i].peer);
        pf[k].events = (short)((send ? POLLOUT : 0) | (recv ? POLLIN : 0));
        k++;
    }
    if (left <= 0) {
        snprintf(why, sizeof(why), "timed out after %.1f s", op->timeout);
        return hr_op_fail_peer(op, xs[first].rd < sizeof(hr_hdr_t) + xs[first].rn, xs[first].peer, why), -1;
    }
    ms = left > 1.0 ? 1000 : (int)(left * 1000.0) + 1;     /* re-check the clock each second */
    r = hr_poll(pf, (nfds_t)k, ms);
    if (r < 0 && errno != EINTR) return hr_op_fail(op, "poll(): %s", strerror(errno)), -1;
    return 1;
}

int hr_direct_exchange(hr_op_t *op, hr_xfer_t *xs, int np) {
    int i, moved;
    if (np > HR_DIRECT_MAX_RANKS - 1)
        return hr_op_fail(op, "direct exchange with %d peers, at most %d", np, HR_DIRECT_MAX_RANKS - 1);
    op->tx_total = op->rx_total = 0;
    for (i = 0; i < np; i++) {
        xs[i].sd = xs[i].rd = 0;
        xs[i].hdr_ok = 0;
        op->tx_total += sizeof(hr_hdr_t) + xs[i].sn;
        op->rx_total += sizeof(hr_hdr_t) + xs[i].rn;
    }
    op->tx_done = op->rx_done = 0;
    for (;;) {
        int left = 0;
        if ((moved = direct_progress(op, xs, np)) < 0) return HR_ERR;
        for (i = 0; i < np; i++)
            left |= xs[i].sd < sizeof(hr_hdr_t) + xs[i].sn || xs[i].rd < sizeof(hr_hdr_t) + xs[i].rn;
        if (!left) return HR_OK;
        if (!moved && direct_wait(op, xs, np) < 0) return HR_ERR;
    }
}
