/* allreduce.c -- allreduce entry point: picks recursive doubling, recursive halving or the ring by
 * message size and rank count,
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
 *
 * From the RD threshold up, the ring's 2(n-1) latency steps outgrow its bandwidth term as n
 * grows (at 4096 ranks a 1 MiB ring allreduce is 8190 steps of 256 bytes): while each rank's
 * share, bytes / n, is below c->rh_chunk (HR_RH_CHUNK_DEFAULT = 64 KiB, env HPCRING_RH_CHUNK),
 * recursive halving/doubling (allreduce_rh.c: 2 log2 n steps, the ring's bytes) runs instead.
 * At the defaults that starts at 5 ranks (256 KiB / 4 is 64 KiB). Measured on loopback TCP, 2
 * cores, float32 sum, median of 10 (benchmarks/ring_loopback.py --cutover --transport tcp), us,
 * ring / rd / rh (bytes per rank in brackets):
 *
 *     n=8    256 KiB (32 KiB)   1312 / 1199 /  952      1 MiB (128 KiB)  3346 /  6494 / 4158
 *     n=16   256 KiB (16 KiB)   2796 / 3127 / 2181    512 KiB (32 KiB)   3369 /  5928 / 3505
 *            1 MiB (64 KiB)     5076 / 23889 / 9179
 *
 * (16 processes on 2 cores: every step waits for a core, so the ring's many small steps cost
 * less here than on a fabric, where each is a network latency; re-measure on real nodes.)
 *
 * Few ranks and small messages: one round of direct exchange (allreduce_direct.c: 1 latency,
 * (n-1) S sent per rank) before all of the above, on at most HR_DIRECT_MAX_RANKS (3) ranks while
 * (n-1) S <= c->direct_max (HR_DIRECT_MAX_DEFAULT = 32 KiB, env HPCRING_DIRECT_MAX). Measured on
 * loopback TCP, 2 cores, median of 200 (benchmarks/ring_loopback.py --cutover --transport tcp),
 * us, recursive doubling / direct:
 *
 *     n=2    1 KiB  47.6 / 37.9    4 KiB  55.0 / 42.8    16 KiB  53.3 / 44.8
 *     n=3    1 KiB  46.1 / 59.3    4 KiB 111.8 / 63.7    16 KiB  96.2 / 67.1
 *     n=4    1 KiB  77.1 / 94.8    4 KiB  69.7 / 95.3    16 KiB  76.9 / 124.8
 *     n=8    1 KiB 159.2 / 231.8   4 KiB 170.9 / 308.6   16 KiB 215.1 / 350.1
 *
 * At n = 3 recursive doubling folds (3 latencies against 1); from 4 ranks its log2 n rounds send
 * fewer messages, which wins here where the ranks share 2 cores (on dedicated cores and a
 * fabric, re-measure: 4-8 ranks may favour direct exchange too, which would need their full mesh).
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
    if (c->size > 1 && c->size <= HR_DIRECT_MAX_RANKS && bytes * (size_t)(c->size - 1) <= c->direct_max)
        return hr_allreduce_direct(&op, sbuf, rbuf, count, dtype, redop);
    if (c->size > 1 && bytes >= c->rd_threshold &&
        bytes / (size_t)c->size >= c->rh_chunk)
        return hr_allreduce_ring(&op, sbuf, rbuf, count, dtype, redop);
    if (sbuf != rbuf && bytes) memcpy(rbuf, sbuf, bytes);
    if (c->size == 1) return HR_OK;
    if (bytes >= c->rd_threshold) return hr_allreduce_rh(&op, rbuf, count, dtype, redop);
    return hr_allreduce_rd(&op, rbuf, count, dtype, redop);
}
