/* ring_pass.c -- one pipelined, striped pass around the ring: the engine of ring reduce-scatter,
 * ring allgather and (both in turn) ring allreduce.
 *
 * The buffer is cut into n chunks (hr_chunks: sizes differ by at most one element, any may be
 * empty). In step s = 0 .. n-2, rank r sends chunk (first - s) mod n to its right neighbour
 * r+1 and receives chunk (first - s - 1) mod n from its left neighbour r-1. In reduce mode the
 * received bytes are combined into the local chunk (dst = dst OP received), in copy mode they
 * overwrite it. The chunk received in step s is the one sent in step s+1.
 *
 * Striping: every chunk is cut again into K slices (hr_chunks of the chunk), and slice j of every
 * chunk travels on TCP connection j to the neighbours ("stream j"). The K streams are K
 * independent rings over disjoint bytes, so they need no coordination: a "lane" is the state of
 * one stream, and T I/O threads (the caller is thread 0) each drive lanes j = t, t+T, .. in one
 * poll loop, each reducing its own slices. Sending, receiving and reducing therefore run in
 * parallel over slices, and neither one core's TCP copy nor one core's add bounds the pass.
 * K = min(streams, max(1, chunk bytes / stripe_min)) and T = min(K, threads), both computed from
 * the count alone, so all ranks agree. Every lane sends the 24-byte header first when asked.
 *
 * Pipelining within a lane: the two directions are independent non-blocking streams, and the send
 * of step s+1 does not wait for step s to finish: it may send every byte of its slice that has
 * already been received (and, in reduce mode, reduced), in pieces of at least HR_MIN_SEND bytes.
 * Received bytes land in a 256 KiB staging buffer per lane and are reduced right away (base =
 * src OP received, so out of place needs no copy of the input) while the kernel keeps receiving,
 * so the reduction reads cache-hot data. No deadlock: every rank's step-0 slice is available in
 * full, so every stream can always make progress until its peer's buffer fills; all lanes run at
 * once (a thread that cannot be started fails the collective instead of serialising lanes).
 *
 * Waits: thread 0 adds its time in poll() to the communicator's per-peer waits (hr_link_add):
 * with a send blocked, to the right peer's send wait; receiving only, to the left's receive wait.
 *
 * Errors: the first failing lane records the sticky error (peer, stream, bytes of that stream
 * done) and shuts every socket down, which wakes the other threads and the peers at once. Every
 * poll() has the collective's deadline.
 *
 * Cost (S bytes, n ranks, latency a, per-byte time b, reduction per byte g, K streams, T threads
 * on T free cores): (n-1) steps, each rank sends and receives (n-1)/n * S bytes;
 * time ~ (n-1)(a + S/n max(b_link, (b_copy [+ g]) / T)) with b_copy the per-core kernel copy cost;
 * pipelining hides most of the step latencies for large S. With fewer cores than T x ranks the
 * threads only add switching (measured in docs/collectives.md).
 *
 * hr_ring_pass_in runs the same pass over a sub-ring (members[0..nm-1], this rank at pos): the
 * inter-node step of the two-level allreduce (allreduce_shm.c).
 */
#define _GNU_SOURCE
#include "hr_internal.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HR_STAGE_BYTES (256u * 1024u)
#define HR_MIN_SEND (64u * 1024u)

static inline int mod(int a, int n) { return ((a % n) + n) % n; }

typedef struct lane {
    int k;                          /* stream (connection index) */
    int ss, rs;                     /* current send / receive step */
    size_t sd, rd, pend;            /* bytes of the current slice sent / completed; staged */
    size_t shd, rhd;                /* header bytes sent / received */
    size_t tx_done, tx_total, rx_done, rx_total;
    int want_send;
    hr_hdr_t rh;
    unsigned char *stage;
} lane_t;

typedef struct pass {
    hr_op_t *op;
    unsigned char *base;
    const unsigned char *src;
    const size_t *off, *cnt;
    int first, reduce, dtype, redop, n, left, right, nlanes, nthreads;
    size_t esz, hl;
    lane_t *lanes;
    int rc[HR_MAX_STREAMS];         /* per thread */
    double send_wait, recv_wait;    /* thread 0's time in poll() with a send blocked / receiving only */
} pass_t;

/* Element offset and count of lane k's slice of chunk ci. */
static void slice(const pass_t *p, int ci, int k, size_t *o, size_t *c) {
    size_t cn = p->cnt[ci], b = cn / (size_t)p->nlanes, x = cn % (size_t)p->nlanes;
    size_t kk = (size_t)k;
    *c = b + (kk < x ? 1 : 0);
    *o = p->off[ci] + kk * b + (kk < x ? kk : x);
}

/* Move whatever the kernel takes now on lane l. Returns 1 on progress, 0 when blocked,
 * HR_ERR on failure (recorded). */
static int lane_step(pass_t *p, lane_t *l) {
    hr_op_t *op = p->op;
    hr_comm_t *c = op->c;
    int n = p->n, k, progressed = 0;
    size_t esz = p->esz, hl = p->hl;
    struct iovec iov[2];
    ssize_t got;
    char why[256];

    l->want_send = 0;
    /* ---- send side ---- */
    while (l->ss < n - 1) {
        int ci = mod(p->first - l->ss, n);
        size_t so, sc, clen, avail;
        slice(p, ci, l->k, &so, &sc);
        clen = sc * esz;
        if (l->ss == 0 || l->rs > l->ss - 1) avail = clen;
        else avail = l->rd; /* rs == ss - 1: what has been received (and reduced) so far */
        if (l->shd == hl && l->sd == clen) { l->ss++; l->sd = 0; progressed = 1; continue; }
        k = 0;
        if (l->shd < hl) {
            iov[k].iov_base = (char *)&op->hdr + l->shd;
            iov[k++].iov_len = hl - l->shd;
        }
        if (avail > l->sd && (avail == clen || avail - l->sd >= HR_MIN_SEND)) {
            /* step 0 sends the input; later steps forward what was reduced into base */
            iov[k].iov_base = (l->ss == 0 ? (unsigned char *)p->src : p->base) + so * esz + l->sd;
            iov[k++].iov_len = avail - l->sd;
        }
        if (k == 0) break; /* waiting for data from the left */
        got = hr_tcp_iok(&c->tcp, p->right, l->k, iov, k, 1, why, sizeof(why));
        if (got < 0)
            return hr_op_fail_stream(op, 0, p->right, l->k, p->nlanes, l->tx_done, l->tx_total, why);
        if (got == 0) { l->want_send = 1; break; } /* socket buffer full: poll for POLLOUT */
        progressed = 1;
        if (l->shd < hl) {
            size_t h = (size_t)got < hl - l->shd ? (size_t)got : hl - l->shd;
            l->shd += h;
            got -= (ssize_t)h;
        }
        l->sd += (size_t)got;
        l->tx_done += (size_t)got;
    }

    /* ---- receive side ---- */
    while (l->rs < n - 1) {
        int ci = mod(p->first - l->rs - 1, n);
        size_t so, sc, clen, room;
        unsigned char *dst;
        slice(p, ci, l->k, &so, &sc);
        clen = sc * esz;
        dst = p->base + so * esz;
        if (l->rhd == hl && l->rd == clen) { l->rs++; l->rd = 0; progressed = 1; continue; }
        k = 0;
        if (l->rhd < hl) {
            iov[k].iov_base = (char *)&l->rh + l->rhd;
            iov[k++].iov_len = hl - l->rhd;
        }
        if (p->reduce) {
            room = clen - l->rd - l->pend;
            if (room > HR_STAGE_BYTES - l->pend) room = HR_STAGE_BYTES - l->pend;
            if (room) { iov[k].iov_base = l->stage + l->pend; iov[k++].iov_len = room; }
        } else if (clen > l->rd) {
            iov[k].iov_base = dst + l->rd;
            iov[k++].iov_len = clen - l->rd;
        }
        got = hr_tcp_iok(&c->tcp, p->left, l->k, iov, k, 0, why, sizeof(why));
        if (got < 0)
            return hr_op_fail_stream(op, 1, p->left, l->k, p->nlanes, l->rx_done, l->rx_total, why);
        if (got == 0) break;
        progressed = 1;
        if (l->rhd < hl) {
            size_t h = (size_t)got < hl - l->rhd ? (size_t)got : hl - l->rhd;
            l->rhd += h;
            got -= (ssize_t)h;
            if (l->rhd == hl && hr_op_check_hdr(op, &l->rh, p->left) != HR_OK) return HR_ERR;
        }
        l->rx_done += (size_t)got;
        if (p->reduce) {
            size_t whole;
            l->pend += (size_t)got;
            whole = l->pend - l->pend % esz;
            if (whole) {
                hr_reduce3(dst + l->rd, p->src + (size_t)(dst - p->base) + l->rd, l->stage,
                           whole / esz, p->dtype, p->redop);
                l->rd += whole;
                l->pend -= whole;
                if (l->pend) memmove(l->stage, l->stage + whole, l->pend);
            }
        } else {
            l->rd += (size_t)got;
        }
    }
    return progressed;
}

/* Drive lanes t, t+T, .. to completion or failure. */
static int run_lanes(pass_t *p, int t) {
    hr_op_t *op = p->op;
    hr_comm_t *c = op->c;
    int n = p->n;
    struct pollfd pf[2 * HR_MAX_STREAMS];
    lane_t *who[2 * HR_MAX_STREAMS];

    for (;;) {
        int busy = 0, progressed = 0, np = 0, sending = 0, i, r;
        double left, t0;
        if (__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE)) return HR_ERR;
        for (i = t; i < p->nlanes; i += p->nthreads) {
            lane_t *l = &p->lanes[i];
            if (l->ss >= n - 1 && l->rs >= n - 1) continue;
            busy = 1;
            r = lane_step(p, l);
            if (r == HR_ERR) return HR_ERR;
            progressed |= r;
        }
        if (!busy) return HR_OK;
        if (progressed) continue;
        for (i = t; i < p->nlanes; i += p->nthreads) {
            lane_t *l = &p->lanes[i];
            if (l->ss < n - 1 && l->want_send) {
                sending = 1;
                pf[np].fd = hr_tcp_fdk(&c->tcp, p->right, l->k);
                pf[np].events = POLLOUT;
                who[np++] = l;
            }
            if (l->rs < n - 1) {
                pf[np].fd = hr_tcp_fdk(&c->tcp, p->left, l->k);
                pf[np].events = POLLIN | POLLRDHUP;
                who[np++] = l;
            }
        }
        left = op->deadline - hr_now();
        if (left <= 0) {
            char why[64];
            lane_t *l = who[np - 1];
            snprintf(why, sizeof(why), "timed out after %.1f s", op->timeout);
            return l->rs < n - 1
                       ? hr_op_fail_stream(op, 1, p->left, l->k, p->nlanes, l->rx_done, l->rx_total, why)
                       : hr_op_fail_stream(op, 0, p->right, l->k, p->nlanes, l->tx_done, l->tx_total, why);
        }
        /* re-check the clock and the sticky flag at least every 200 ms */
        t0 = hr_now();
        r = hr_poll(pf, (nfds_t)np, left > 0.2 ? 200 : (int)ceil(left * 1000.0));
        if (t == 0) { /* every lane crosses the same links: one thread's view says it */
            if (sending) p->send_wait += hr_now() - t0;
            else p->recv_wait += hr_now() - t0;
        }
        if (r < 0 && errno != EINTR)
            return hr_op_fail(op, "poll() on %d stream(s) to ranks %d/%d failed: %s", np, p->left,
                              p->right, strerror(errno));
    }
}

static void *thread_main(void *arg) {
    pass_t *p = ((void **)arg)[0];
    int t = (int)(intptr_t)((void **)arg)[1];
    p->rc[t] = run_lanes(p, t);
    return NULL;
}

int hr_ring_pass(hr_op_t *op, unsigned char *base, const unsigned char *src, const size_t *off,
                 const size_t *cnt, int first, int reduce, int dtype, int redop, int send_hdr) {
    return hr_ring_pass_in(op, NULL, op->c->size, op->c->rank, base, src, off, cnt, first, reduce,
                           dtype, redop, send_hdr);
}

int hr_ring_pass_in(hr_op_t *op, const int *members, int nm, int pos, unsigned char *base,
                    const unsigned char *src, const size_t *off, const size_t *cnt, int first,
                    int reduce, int dtype, int redop, int send_hdr) {
    hr_comm_t *c = op->c;
    pass_t p;
    lane_t lanes[HR_MAX_STREAMS];
    pthread_t tid[HR_MAX_STREAMS];
    void *args[HR_MAX_STREAMS][2];
    int n = nm, s, i, started = 0, rc = HR_OK;
    size_t biggest = 0;

    if (n == 1) return HR_OK;
    memset(&p, 0, sizeof(p));
    p.op = op;
    p.base = base;
    p.src = src ? src : base;
    p.off = off;
    p.cnt = cnt;
    p.first = first;
    p.reduce = reduce;
    p.dtype = dtype;
    p.redop = redop;
    p.n = n;
    p.right = members ? members[mod(pos + 1, n)] : mod(pos + 1, n);
    p.left = members ? members[mod(pos - 1, n)] : mod(pos - 1, n);
    p.esz = hr_dtype_size(dtype);
    p.hl = send_hdr ? sizeof(hr_hdr_t) : 0;
    (void)c;
    for (i = 0; i < n; i++)
        if (cnt[i] > biggest) biggest = cnt[i];
    p.nlanes = (int)(biggest * p.esz / (c->stripe_min ? c->stripe_min : 1));
    if (p.nlanes > c->streams) p.nlanes = c->streams;
    if (p.nlanes > HR_MAX_STREAMS) p.nlanes = HR_MAX_STREAMS;
    if (p.nlanes < 1) p.nlanes = 1;
    p.nthreads = c->threads < p.nlanes ? c->threads : p.nlanes;
    if (p.nthreads < 1) p.nthreads = 1;
    p.lanes = lanes;
    memset(lanes, 0, sizeof(lanes));
    if (reduce && hr_comm_stage(op, (size_t)p.nlanes * HR_STAGE_BYTES) != HR_OK) return HR_ERR;
    for (i = 0; i < p.nlanes; i++) {
        lanes[i].k = i;
        lanes[i].stage = reduce ? c->stage + (size_t)i * HR_STAGE_BYTES : NULL;
        for (s = 0; s < n - 1; s++) {
            size_t so, sc;
            slice(&p, mod(first - s, n), i, &so, &sc);
            lanes[i].tx_total += sc * p.esz;
            slice(&p, mod(first - s - 1, n), i, &so, &sc);
            lanes[i].rx_total += sc * p.esz;
        }
        op->tx_total += lanes[i].tx_total;
        op->rx_total += lanes[i].rx_total;
    }

    for (i = 1; i < p.nthreads; i++) {
        int e;
        args[i][0] = &p;
        args[i][1] = (void *)(intptr_t)i;
        if ((e = pthread_create(&tid[i], NULL, thread_main, args[i])) != 0) {
            hr_op_fail(op, "pthread_create() for I/O thread %d of %d: %s", i, p.nthreads,
                       strerror(e));
            rc = HR_ERR;
            break;
        }
        started = i;
    }
    if (rc == HR_OK) rc = run_lanes(&p, 0);
    for (i = 1; i <= started; i++) {
        pthread_join(tid[i], NULL);
        if (p.rc[i] != HR_OK) rc = HR_ERR;
    }
    for (i = 0; i < p.nlanes; i++) {
        op->tx_done += lanes[i].tx_done;
        op->rx_done += lanes[i].rx_done;
    }
    hr_link_add(c, p.right, p.send_wait, 0.0);
    hr_link_add(c, p.left, 0.0, p.recv_wait);
    return rc;
}
