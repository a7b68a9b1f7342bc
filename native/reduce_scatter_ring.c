/* reduce_scatter_ring.c -- ring reduce-scatter.
 *
 * The count input elements are cut into n chunks as in hr_chunks (the first count % n ranks get
 * one element more); rank r receives the reduction of chunk r over all ranks.
 * Steps: one pipelined reduce-mode ring pass reading the input (never modified) and writing
 * reductions into a scratch buffer (ring_pass.c, first = r-1; in step s rank r sends chunk (r-1-s) and
 * reduces chunk (r-2-s) received from the left), divide for avg, copy chunk r out.
 *
 * With a shared-memory segment the ranks use reduce_scatter_shm.c on one node, allreduce_shm.c
 * (two-level, keeping only chunk r) across nodes; few ranks and small messages, one round of
 * direct exchange (direct_others.c).
 *
 * Cost: n-1 steps; each rank sends and receives (n-1)/n * S bytes and reduces as many;
 * time ~ (n-1) a + (n-1)/n S (b + g).
 */
#include "hr_internal.h"

#include <stdlib.h>
#include <string.h>

/* Contract: sbuf holds count elements, rbuf holds chunk rank's element count (hr_chunks) and
 * may overlap sbuf. Returns HR_OK, or HR_ERR with c->err set. */
int hr_reduce_scatter_ring(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype,
                           int redop, double timeout) {
    hr_op_t op;
    int n = c->size, r = c->rank, rc = HR_ERR, shm;
    size_t esz = hr_dtype_size(dtype), *off = NULL, *cnt;

    if (hr_op_begin(&op, c, HR_K_REDUCE_SCATTER, dtype, redop, count, -1, timeout) != HR_OK)
        return HR_ERR;
    if (!(off = malloc(2 * (size_t)n * sizeof(size_t)))) {
        hr_op_fail(&op, "malloc(): out of memory");
        goto cleanup;
    }
    cnt = off + n;
    hr_chunks(count, n, off, cnt);
    shm = c->shm.base && (c->shm.ncol == 1 || (c->shm.ncol > 1 && count * esz >= c->twolevel_min));
    if (shm || hr_use_direct(c, count * esz)) {     /* the same answer on every rank */
        /* shared memory or one round of direct exchange; an input that overlaps the output is
         * copied first, since a rank's output may overtake its reading of the input */
        const unsigned char *in = sbuf;
        if ((const char *)rbuf < (const char *)sbuf + count * esz &&
            (const char *)sbuf < (const char *)rbuf + cnt[r] * esz) {
            if (hr_comm_tmp(&op, count * esz + 1) != HR_OK) goto cleanup;
            memcpy(c->tmp, sbuf, count * esz);
            in = c->tmp;
        }
        if (!shm)
            rc = hr_reduce_scatter_direct(&op, in, rbuf, off, cnt, dtype, redop);
        else if ((c->shm.ncol == 1
                  ? hr_reduce_scatter_shm(&op, in, rbuf, count, dtype, redop, off[r], off[r] + cnt[r])
                  : hr_allreduce_shm(&op, in, rbuf, count, dtype, redop, off[r], off[r] + cnt[r])) == HR_OK)
            rc = HR_OK;
        goto cleanup;
    }
    if (hr_comm_tmp(&op, count * esz + 1) != HR_OK) goto cleanup;
    if (n == 1 && count) memcpy(c->tmp, sbuf, count * esz);
    /* reductions write tmp = input OP received, so the input is neither copied nor modified */
    if (hr_ring_pass(&op, c->tmp, sbuf, off, cnt, r - 1, 1, dtype, redop, 1) != HR_OK) goto cleanup;
    if (redop == HR_AVG) hr_divide(c->tmp + off[r] * esz, cnt[r], dtype, n);
    if (cnt[r]) memmove(rbuf, c->tmp + off[r] * esz, cnt[r] * esz);
    rc = HR_OK;
cleanup:
    free(off);
    return rc;
}
