/* allgather_ring.c -- ring allgather.
 *
 * Each rank contributes count elements; the result is the n contributions in rank order.
 * Steps: copy the own contribution into block r of the output (unless already there), then one
 * pipelined copy-mode ring pass (ring_pass.c, first = r): in step s rank r forwards block
 * (r - s) mod n to the right and receives block (r - s - 1) mod n from the left.
 *
 * On one node with a shared-memory segment, allgather_shm.c runs instead (allgather_cma.c when
 * the node's ranks may read each other's memory and blocks are at least c->cma_allgather_min bytes).
 *
 * Cost: n-1 steps; each rank sends and receives (n-1)/n * S bytes of the S-byte output;
 * time ~ (n-1) a + (n-1)/n S b.
 */
#include "hr_internal.h"

#include <stdlib.h>
#include <string.h>

/* Contract: rbuf holds size*count elements; sbuf holds count elements and may be rbuf's own
 * block (in place). Returns HR_OK, or HR_ERR with c->err set. */
int hr_allgather_ring(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype,
                      double timeout) {
    hr_op_t op;
    int n = c->size, i, rc = HR_ERR;
    size_t esz = hr_dtype_size(dtype), *off = NULL, *cnt;
    unsigned char *mine;

    if (hr_op_begin(&op, c, HR_K_ALLGATHER, dtype, 0, count, -1, timeout) != HR_OK) return HR_ERR;
    if (c->shm.base && c->shm.ncol == 1)
        return hr_use_cma(c, count * esz, c->cma_allgather_min) ? hr_allgather_cma(&op, sbuf, rbuf, count, dtype)
                                          : hr_allgather_shm(&op, sbuf, rbuf, count, dtype);
    mine = (unsigned char *)rbuf + (size_t)c->rank * count * esz;
    if (sbuf != mine && count) memmove(mine, sbuf, count * esz);
    if (hr_use_direct(c, (size_t)(n - 1) * count * esz)) return hr_allgather_direct(&op, rbuf, count, dtype);
    if (!(off = malloc(2 * (size_t)n * sizeof(size_t)))) {
        hr_op_fail(&op, "malloc(): out of memory");
        goto cleanup;
    }
    cnt = off + n;
    for (i = 0; i < n; i++) { off[i] = (size_t)i * count; cnt[i] = count; }
    if (hr_ring_pass(&op, rbuf, NULL, off, cnt, c->rank, 0, dtype, 0, 1) != HR_OK) goto cleanup;
    rc = HR_OK;
cleanup:
    free(off);
    return rc;
}
