/* alltoall.c -- pairwise-exchange alltoall.
 *
 * Each rank's count elements are n blocks of count/n; block j goes to rank j, and the output's
 * block i is what rank i sent to this rank. Steps: copy the own block, then for k = 1, n-1, 2,
 * n-2, .. (distance d = 1 .. n/2, each step d followed by step n-d) send block (r+k) mod n to
 * rank r+k while receiving block (r-k) mod n from rank r-k (both directions at once,
 * non-blocking; every rank runs the same step sequence, so the pairing cannot deadlock). In
 * place (sbuf == rbuf) the input is first copied to scratch.
 *
 * On one node with a shared-memory segment, alltoall_shm.c runs instead (alltoall_cma.c from
 * c->cma_min bytes a block where the node's ranks may read each other's memory).
 *
 * Cost: n-1 steps; each rank sends and receives (n-1)/n * S bytes; time ~ (n-1)(a + S/n b).
 */
#include "hr_internal.h"

#include <string.h>

/* Contract: sbuf and rbuf hold count elements, count divisible by size; they may be the same
 * buffer but must not otherwise overlap. Steps run by distance d in [d0, d1): step d, then step
 * n - d, so a window of distances needs the connections to ranks r +- d only (connections on
 * demand, collectives/ring.py, calls one window at a time with those connected). d0 = 1 starts
 * the collective; a window with d0 > 1 continues it (same sequence number, no own-block copy)
 * and must not run in place. Returns HR_OK, or HR_ERR with c->err set. */
int hr_alltoall(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype,
                double timeout, int d0, int d1) {
    hr_op_t op;
    int n = c->size, r = c->rank, d, j;
    size_t esz = hr_dtype_size(dtype), blk;
    const unsigned char *src = sbuf;
    unsigned char *dst = rbuf;

    if (hr_op_begin(&op, c, HR_K_ALLTOALL, dtype, 0, count, -1, timeout) != HR_OK) return HR_ERR;
    if (d0 > 1) op.hdr.seq = --c->seq; /* a later window of the same collective */
    if (count % (size_t)n)
        return hr_op_fail(&op, "count %zu is not divisible by the world size %d", count, n);
    if (c->shm.base && c->shm.ncol == 1)
        return hr_use_cma(c, count / (size_t)n * esz, c->cma_min)
                   ? hr_alltoall_cma(&op, sbuf, rbuf, count, dtype)
                   : hr_alltoall_shm(&op, sbuf, rbuf, count, dtype);
    blk = count / (size_t)n * esz;
    if (d0 <= 1 && d1 >= n / 2 + 1 && hr_use_direct(c, (size_t)(n - 1) * blk))
        return hr_alltoall_direct(&op, sbuf, rbuf, count, dtype);   /* one round (direct_others.c) */
    if (d0 < 1) d0 = 1;
    if (d1 > n / 2 + 1) d1 = n / 2 + 1;
    if (sbuf == rbuf && n > 1) {
        if (hr_comm_tmp(&op, count * esz + 1) != HR_OK) return HR_ERR;
        memcpy(c->tmp, sbuf, count * esz);
        src = c->tmp;
    }
    if (d0 == 1 && src != dst && blk)
        memcpy(dst + (size_t)r * blk, src + (size_t)r * blk, blk);
    op.tx_total = op.rx_total = (size_t)(n - 1) * blk;
    for (d = d0; d < d1; d++) {
        for (j = 0; j < 2; j++) {
            int k = j ? n - d : d, to = (r + k) % n, from = (r - k + n) % n;
            if (j && k == d) break; /* d = n/2: one step */
            if (hr_sendrecv(&op, to, src + (size_t)to * blk, blk, 1, from,
                            dst + (size_t)from * blk, blk, 1) != HR_OK)
                return HR_ERR;
        }
    }
    return HR_OK;
}
