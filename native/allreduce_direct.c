/* allreduce_direct.c -- allreduce in one round, for few ranks and small messages.
 *
 * Steps (n ranks, S bytes):
 *   1. exchange (direct.c): send the header and the whole input to every other rank and receive
 *      every other rank's, all 2(n-1) streams at once;
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

#include <stdlib.h>
#include <string.h>

/* rank k's input: this rank's own, or its slot in ins (ranks other than r, in rank order) */
#define DIRECT_IN(k) ((k) == r ? (const unsigned char *)mine : ins + bytes * (size_t)((k) < r ? (k) : (k) - 1))

int hr_allreduce_direct(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype, int redop) {
    hr_comm_t *c = op->c;
    int n = c->size, r = c->rank, i, np = n - 1, rc = HR_ERR;
    size_t bytes = count * hr_dtype_size(dtype);
    hr_xfer_t xs[HR_DIRECT_MAX_RANKS];
    unsigned char *ins;
    const void *mine = sbuf;

    if (n > HR_DIRECT_MAX_RANKS) return hr_op_fail(op, "direct allreduce: %d ranks, at most %d", n, HR_DIRECT_MAX_RANKS);
    if (!(ins = malloc(bytes * (size_t)np + 1))) return hr_op_fail(op, "malloc(): out of memory");
    if (sbuf == rbuf && bytes) {                /* in place: keep the input while rbuf fills */
        if (hr_comm_tmp(op, bytes) != HR_OK) goto cleanup;
        memcpy(c->tmp, sbuf, bytes);
        mine = c->tmp;
    }
    for (i = 0; i < np; i++) {
        memset(&xs[i], 0, sizeof(xs[i]));
        xs[i].peer = (r + 1 + i) % n;           /* everyone starts with a different peer */
        xs[i].s = mine, xs[i].sn = bytes;
        xs[i].r = (void *)DIRECT_IN(xs[i].peer), xs[i].rn = bytes;
    }
    if (hr_direct_exchange(op, xs, np) != HR_OK) goto cleanup;
    /* rank order, in_0 OP in_1 OP ..., on every rank (ins: the other ranks' inputs by rank) */
    hr_reduce3(rbuf, DIRECT_IN(0), DIRECT_IN(1), count, dtype, redop);
    for (i = 2; i < n; i++) hr_reduce(rbuf, DIRECT_IN(i), count, dtype, redop);
    if (redop == HR_AVG) hr_divide(rbuf, count, dtype, n);
    rc = HR_OK;
cleanup:
    free(ins);
    return rc;
}
