/* allreduce_rh.c -- bandwidth- and latency-efficient allreduce for many ranks (Rabenseifner):
 * a reduce-scatter by recursive halving, then an allgather by recursive doubling.
 *
 * Steps (n ranks, p = largest power of two <= n, rem = n - p; the buffer is cut into p blocks
 * as in hr_chunks, block v ending up reduced on virtual rank v):
 *   1. fold: as allreduce_rd.c, each even rank below 2 rem sends its whole buffer to the odd rank
 *      above it, which reduces it; the even ranks sit out until step 4.
 *   2. reduce-scatter: this rank's blocks are [b, b + w), first all p. For m = p/2, .., 1: the
 *      partner is v ^ m; the half of [b, b + w) on the partner's side of m is sent, the other
 *      half received and reduced into the buffer and kept (w halves). Ends holding block v.
 *   3. allgather: for m = 1, .., p/2, send the blocks held, receive the partner's (the sibling
 *      range) into place; w doubles. (avg: block v is divided by n before this step, so the
 *      blocks every rank receives are final and identical everywhere.)
 *   4. unfold: each odd rank below 2 rem sends the result to its even partner.
 *
 * Cost: 2 log2 p steps (+2 when n is not a power of two); each rank sends and receives
 * 2 (p-1)/p S bytes (+2 S for a folded pair) and reduces (p-1)/p S:
 *   time ~ 2 log2(p) a + 2 (p-1)/p S b + (p-1)/p S g.
 * Against the ring's 2(n-1) a + 2(n-1)/n S b: the same bytes, log2 n latencies instead of n. The
 * ring keeps large messages on few ranks (its transfers are pipelined with the reductions and go
 * to neighbours: the same host, the same switch); the cut-over is in allreduce.c. Partners are
 * allreduce_rd.c's, so connections on demand (ring.py static_peers) already hold them.
 */
#include "hr_internal.h"

#include <stdlib.h>

/* The global rank of virtual rank pv (see step 1). */
static int rh_global(int pv, int rem) { return pv < rem ? pv * 2 + 1 : pv + rem; }

/* Contract: buf holds count elements of dtype (the input, in place; the result on return); every
 * rank passes the same count, dtype and redop. Returns HR_OK, or HR_ERR with c->err set. */
int hr_allreduce_rh(hr_op_t *op, void *buf, size_t count, int dtype, int redop) {
    hr_comm_t *c = op->c;
    int n = c->size, p = 1, rem, v = -1, m, b = 0, w, rc = HR_ERR;
    size_t esz = hr_dtype_size(dtype), bytes = count * esz, *off = NULL, *cnt;
    unsigned char *base = buf;

    while (p * 2 <= n) p *= 2;
    rem = n - p;
    if (hr_comm_tmp(op, bytes ? bytes : 1) != HR_OK) return HR_ERR;
    if (!(off = malloc(2 * (size_t)p * sizeof(size_t)))) return hr_op_fail(op, "malloc(): out of memory");
    cnt = off + p;
    hr_chunks(count, p, off, cnt);
    op->tx_total = op->rx_total = bytes;

    if (hr_fold(op, buf, count, dtype, redop, &v) != HR_OK) goto out;     /* 1. fold */
    if (v >= 0) {
        for (w = p, m = p / 2; m >= 1; m /= 2) {         /* 2. reduce-scatter by halving */
            int peer = rh_global(v ^ m, rem), lo = b, hi = b + m;   /* lower and upper halves */
            int keep = (v & m) ? hi : lo, give = (v & m) ? lo : hi;
            size_t koff = off[keep] * esz, kn = off[keep + m - 1] + cnt[keep + m - 1] - off[keep];
            size_t goff = off[give] * esz, gn = off[give + m - 1] + cnt[give + m - 1] - off[give];
            op->tx_done = op->rx_done = 0;
            if (hr_sendrecv(op, peer, base + goff, gn * esz, 1, peer, c->tmp, kn * esz, 1) != HR_OK)
                goto out;
            hr_reduce(base + koff, c->tmp, kn, dtype, redop);
            b = keep;
            w = m;
        }
        if (redop == HR_AVG) hr_divide(base + off[v] * esz, cnt[v], dtype, n);
        for (m = 1; m < p; m *= 2) {                     /* 3. allgather by doubling */
            int peer = rh_global(v ^ m, rem), theirs = (v & m) ? b - w : b + w;
            size_t moff = off[b] * esz, mn = off[b + w - 1] + cnt[b + w - 1] - off[b];
            size_t toff = off[theirs] * esz, tn = off[theirs + w - 1] + cnt[theirs + w - 1] - off[theirs];
            op->tx_done = op->rx_done = 0;
            if (hr_sendrecv(op, peer, base + moff, mn * esz, 0, peer, base + toff, tn * esz, 0) != HR_OK)
                goto out;
            if (theirs < b) b = theirs;
            w *= 2;
        }
    }
    if (hr_unfold(op, buf, bytes) != HR_OK) goto out;                      /* 4. unfold */
    rc = HR_OK;
out:
    free(off);
    return rc;
}
