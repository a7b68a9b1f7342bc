/* direct_others.c -- allgather, reduce-scatter, alltoall and barrier in one round of direct
 * exchange (direct.c), for few ranks and small messages, like allreduce_direct.c.
 *
 * Steps (n <= HR_DIRECT_MAX_RANKS ranks, each a stream to and from every other rank at once):
 *   allgather:      send the own block to every peer, receive each peer's into its place;
 *   reduce-scatter: send chunk j of the input to rank j, receive chunk r from every peer, then
 *                   reduce them in rank order into the output (avg: divide by n);
 *   alltoall:       send block j to rank j, receive block j from rank j (in place: the input is
 *                   copied first, since block j is sent and received at the same time);
 *   barrier:        the headers alone.
 *
 * Cost: one latency and the same bytes as the ring or pairwise exchange, against their n-1
 * rounds (dissemination: ceil(log2 n)). Where it runs: hr_use_direct -- at most
 * HR_DIRECT_MAX_RANKS ranks (whose ring neighbours are every rank: no connection to make) and
 * at most c->direct_max bytes sent per rank, as allreduce. Measured on the dev cluster (3 nodes
 * on 2 cores, us per call, 4 KiB, ring or pairwise / direct): see docs/collectives.md "Direct
 * exchange for the other collectives".
 */
#include "hr_internal.h"

#include <stdlib.h>
#include <string.h>

int hr_use_direct(const hr_comm_t *c, size_t sent) {
    return c->size > 1 && c->size <= HR_DIRECT_MAX_RANKS && sent <= c->direct_max;
}

/* the peers, everyone starting with a different one */
static int direct_peers(hr_op_t *op, hr_xfer_t *xs) {
    int n = op->c->size, r = op->c->rank, i;
    for (i = 0; i < n - 1; i++) {
        memset(&xs[i], 0, sizeof(xs[i]));
        xs[i].peer = (r + 1 + i) % n;
    }
    return n - 1;
}

int hr_allgather_direct(hr_op_t *op, void *rbuf, size_t count, int dtype) {
    hr_xfer_t xs[HR_DIRECT_MAX_RANKS];
    size_t bytes = count * hr_dtype_size(dtype);
    unsigned char *out = rbuf;
    int i, np = direct_peers(op, xs);
    for (i = 0; i < np; i++) {                  /* the own block is in place already */
        xs[i].s = out + (size_t)op->c->rank * bytes, xs[i].sn = bytes;
        xs[i].r = out + (size_t)xs[i].peer * bytes, xs[i].rn = bytes;
    }
    return hr_direct_exchange(op, xs, np);
}

int hr_reduce_scatter_direct(hr_op_t *op, const void *sbuf, void *rbuf, const size_t *off,
                             const size_t *cnt, int dtype, int redop) {
    hr_comm_t *c = op->c;
    hr_xfer_t xs[HR_DIRECT_MAX_RANKS];
    int n = c->size, r = c->rank, i, k, np = direct_peers(op, xs), rc = HR_ERR;
    size_t esz = hr_dtype_size(dtype), mine = cnt[r] * esz;
    const unsigned char *in = sbuf;
    unsigned char *got = malloc(mine * (size_t)np + 1), *acc = NULL;
    const unsigned char *part[HR_DIRECT_MAX_RANKS];

    if (!got) return hr_op_fail(op, "malloc(): out of memory");
    for (i = 0; i < np; i++) {
        int j = xs[i].peer;
        xs[i].s = in + off[j] * esz, xs[i].sn = cnt[j] * esz;
        xs[i].r = got + (size_t)(j < r ? j : j - 1) * mine, xs[i].rn = mine;
    }
    if (hr_direct_exchange(op, xs, np) != HR_OK) goto cleanup;
    for (k = 0; k < n; k++)                     /* rank k's chunk r, in rank order */
        part[k] = k == r ? in + off[r] * esz : got + (size_t)(k < r ? k : k - 1) * mine;
    /* the output may overlap the input (the caller copies such an input to scratch first) */
    acc = rbuf;
    if (cnt[r]) {
        hr_reduce3(acc, part[0], part[1], cnt[r], dtype, redop);
        for (k = 2; k < n; k++) hr_reduce(acc, part[k], cnt[r], dtype, redop);
        if (redop == HR_AVG) hr_divide(acc, cnt[r], dtype, n);
    }
    rc = HR_OK;
cleanup:
    free(got);
    return rc;
}

int hr_alltoall_direct(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype) {
    hr_comm_t *c = op->c;
    hr_xfer_t xs[HR_DIRECT_MAX_RANKS];
    size_t blk = count / (size_t)c->size * hr_dtype_size(dtype);
    const unsigned char *in = sbuf;
    unsigned char *out = rbuf;
    int i, np = direct_peers(op, xs), r = c->rank;
    if (sbuf == rbuf && blk) {
        if (hr_comm_tmp(op, count * hr_dtype_size(dtype) + 1) != HR_OK) return HR_ERR;
        memcpy(c->tmp, sbuf, count * hr_dtype_size(dtype));
        in = c->tmp;
    }
    if (in != out && blk) memcpy(out + (size_t)r * blk, in + (size_t)r * blk, blk);
    for (i = 0; i < np; i++) {
        int j = xs[i].peer;
        xs[i].s = in + (size_t)j * blk, xs[i].sn = blk;
        xs[i].r = out + (size_t)j * blk, xs[i].rn = blk;
    }
    return hr_direct_exchange(op, xs, np);
}

int hr_barrier_direct(hr_op_t *op) {
    hr_xfer_t xs[HR_DIRECT_MAX_RANKS];
    return hr_direct_exchange(op, xs, direct_peers(op, xs));
}
