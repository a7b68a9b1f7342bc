/* allreduce_ring.c -- bandwidth-optimal ring allreduce: reduce-scatter, then allgather.
 *
 * Steps (n ranks, S bytes, chunks as in hr_chunks, any count including 0 and counts not
 * divisible by n):
 *   1. reduce-scatter pass reading the input (out of place: no copy into the output first) (ring_pass.c, reduce mode, first = r-1): after n-1 steps rank r holds
 *      the full reduction of chunk r;
 *   2. for avg, rank r divides its own chunk by n (so the division costs S/n per rank);
 *   3. allgather pass (copy mode, first = r): after n-1 more steps every rank holds every chunk.
 * Each chunk is reduced by exactly one rank and then copied, so all ranks end bit-identical.
 *
 * Cost: 2(n-1) steps; each rank sends and receives 2(n-1)/n * S bytes and reduces (n-1)/n * S;
 * time ~ 2(n-1) a + 2(n-1)/n S b + (n-1)/n S g. Both passes are pipelined (see ring_pass.c).
 */
#include "hr_internal.h"

#include <stdlib.h>

int hr_allreduce_ring(hr_op_t *op, const void *sbuf, void *buf, size_t count, int dtype, int redop) {
    hr_comm_t *c = op->c;
    int n = c->size, r = c->rank, rc = HR_ERR;
    size_t *off = malloc(2 * (size_t)n * sizeof(size_t)), *cnt;

    if (!off) return hr_op_fail(op, "malloc(): out of memory");
    cnt = off + n;
    hr_chunks(count, n, off, cnt);
    /* Out of place, every chunk of buf is written by a reduction (n-1 chunks) or by the allgather
     * (the chunk sent in step 0), so the input is never copied. */
    if (hr_ring_pass(op, buf, sbuf, off, cnt, r - 1, 1, dtype, redop, 1) != HR_OK) goto cleanup;
    if (redop == HR_AVG)
        hr_divide((unsigned char *)buf + off[r] * hr_dtype_size(dtype), cnt[r], dtype, n);
    if (hr_ring_pass(op, buf, NULL, off, cnt, r, 0, dtype, redop, 0) != HR_OK) goto cleanup;
    rc = HR_OK;
cleanup:
    free(off);
    return rc;
}
