/* allreduce.c -- allreduce entry point: picks recursive doubling or the ring by message size,
 * or shared memory (allreduce_shm.c) when the node's ranks share a segment: on one node for every
 * size, across nodes (two-level) from c->twolevel_min (HR_TWOLEVEL_MIN_DEFAULT = 8 MiB, env
 * HPCRING_TWOLEVEL_MIN). Measured on the dev cluster, 3 hosts x 2 ranks (6 processes on 2 loaded
 * cores), float32 sum, ms per call, flat TCP ring / two-level (two runs):
 *
 *     1 MiB     7.0 /  8.9, 14.5
 *    16 MiB   141.8 / 120.7, 152.5
 *    64 MiB   836.2 / 567.2, 604.0
 *
 * The two-level ring moves 1/L of the bytes per host pair but in pieces (one inter-host ring per
 * piece), so it wins only once pieces are large; re-measure on real nodes.
 *
 * Cut-over (measured, see docs/collectives.md "Measured cut-over"): recursive doubling
 * (allreduce_rd.c) below c->rd_threshold bytes, the pipelined ring (allreduce_ring.c) at and
 * above. Default HR_RD_THRESHOLD_DEFAULT, overridable per communicator (Comm(..., rd_threshold=)
 * or env HPCRING_RD_THRESHOLD). Measured on loopback TCP, 2 cores (x86-64, AVX-512 capable),
 * float32 sum, median of 100 iterations per size (benchmarks/ring_loopback.py --cutover), time
 * in microseconds, ring / recursive doubling:
 *
 *     bytes     n=2 ring/rd      n=3 ring/rd      n=4 ring/rd (4 processes on 2 cores)
 *     16 KiB    125 /   35       212 /  127       386 /  317
 *     64 KiB     68 /   48       276 /  235       507 /  407
 *    128 KiB    106 /  100       346 /  334       667 /  619
 *    256 KiB    216 /  183       541 /  505      1000 / 1260
 *    512 KiB    326 /  345       902 /  833      2196 / 4224
 *      1 MiB    604 /  741      1621 / 1995      4447 / 6496
 *      4 MiB   2830 / 9877     13741 / 19914    17284 / 37616
 *
 * Recursive doubling wins below 256 KiB for every n measured and the ring wins from 512 KiB
 * (n=2: 1.2x at 1 MiB, 3.5x at 4 MiB), so the default threshold is 256 KiB (HR_RD_THRESHOLD_DEFAULT).
 * The numbers are noisy on a 2-core VM (single runs vary by up to 2x for small sizes); re-measure
 * on real nodes with the benchmark and set HPCRING_RD_THRESHOLD. For n = 1 nothing is sent.
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
    /* shared memory: always on one node; across nodes (two-level) from c->twolevel_min */
    if (c->shm.base && (c->shm.ncol == 1 || (c->shm.ncol > 1 && bytes >= c->twolevel_min)))
        return hr_allreduce_shm(&op, sbuf, rbuf, count, dtype, redop, 0, count);
    if (c->size > 1 && bytes >= c->rd_threshold)
        return hr_allreduce_ring(&op, sbuf, rbuf, count, dtype, redop);
    if (sbuf != rbuf && bytes) memcpy(rbuf, sbuf, bytes);
    if (c->size == 1) return HR_OK;
    return hr_allreduce_rd(&op, rbuf, count, dtype, redop);
}
