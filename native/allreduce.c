/* allreduce.c -- allreduce entry point: picks recursive doubling or the ring by message size.
 *
 * Cut-over (measured, see docs/collectives.md "Measured cut-over"): recursive doubling
 * (allreduce_rd.c) below c->rd_threshold bytes, the pipelined ring (allreduce_ring.c) at and
 * above. Default HR_RD_THRESHOLD_DEFAULT, overridable per communicator (Comm(..., rd_threshold=)
 * or env HPCRING_RD_THRESHOLD). Measured on loopback TCP, 2 cores (x86-64, AVX-512 capable),
 * float32 sum, median of 200 iterations:
 *   SEE_MEASUREMENT
 * A world size of 2 always uses the ring above the threshold and recursive doubling below; for
 * n = 1 nothing is sent.
 */
#include "hr_internal.h"

#include <string.h>

/* Contract: sbuf and rbuf hold count elements of dtype; sbuf == rbuf means in place (otherwise
 * they must not overlap). All ranks pass the same count, dtype and redop. Returns HR_OK, or
 * HR_ERR with c->err set (sticky). */
int hr_allreduce(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype, int redop,
                 double timeout) {
    hr_op_t op;
    size_t bytes;
    if (hr_op_begin(&op, c, HR_K_ALLREDUCE, dtype, redop, count, -1, timeout) != HR_OK)
        return HR_ERR;
    bytes = count * hr_dtype_size(dtype);
    if (sbuf != rbuf && bytes) memcpy(rbuf, sbuf, bytes);
    if (c->size == 1) {
        return HR_OK;
    }
    if (bytes < c->rd_threshold) return hr_allreduce_rd(&op, rbuf, count, dtype, redop);
    return hr_allreduce_ring(&op, rbuf, count, dtype, redop);
}
