/* broadcast.c -- broadcast entry point: binomial tree for small messages, pipelined chain for
 * large ones; on one node with a shared-memory segment, broadcast_shm.c (broadcast_cma.c from
 * c->cma_gather_min bytes where the node's ranks may read each other's memory).
 *
 * Cut-over: the tree (broadcast_tree.c) costs ceil(log2 n)(a + S b), the chain
 * (broadcast_pipeline.c) about (n-1) a + S b (+ the pipeline fill), so the tree wins for small S
 * and the chain once S b dominates. Default c->bcast_tree_max = HR_BCAST_TREE_MAX_DEFAULT (env
 * HPCRING_BCAST_TREE_MAX). Measured with benchmarks/ring_loopback.py -n 4 --op broadcast
 * --algo tree|chain, loopback TCP, 4 processes on 2 loaded cores, mean time in microseconds:
 *
 *     bytes     1 KiB   4 KiB  16 KiB  64 KiB  256 KiB  1 MiB  4 MiB
 *     chain       194     107     189     307      545   3040  16496
 *     tree        165     104     131     212      551   3882  16110
 *
 * The tree wins up to 64 KiB, they tie at 256 KiB and the chain wins at 1 MiB, so the default is
 * 256 KiB (noisy machine: re-measure on real nodes). For n <= 2 both are one message.
 */
#include "hr_internal.h"

/* Contract: all ranks pass the same count, dtype and root; on return buf on every rank holds
 * the root's count elements. Returns HR_OK, or HR_ERR with c->err set. */
int hr_broadcast(hr_comm_t *c, void *buf, size_t count, int dtype, int root, double timeout) {
    hr_op_t op;
    if (c->shm.base && c->shm.ncol == 1) {
        if (hr_op_begin(&op, c, HR_K_BROADCAST, dtype, 0, count, root, timeout) != HR_OK)
            return HR_ERR;
        return hr_use_cma(c, count * hr_dtype_size(dtype), c->cma_gather_min) ? hr_broadcast_cma(&op, buf, count, dtype, root)
                                                           : hr_broadcast_shm(&op, buf, count, dtype, root);
    }
    if (count * hr_dtype_size(dtype) >= c->bcast_tree_max || c->size <= 2)
        return hr_broadcast_pipeline(c, buf, count, dtype, root, timeout);
    if (hr_op_begin(&op, c, HR_K_BROADCAST, dtype, 0, count, root, timeout) != HR_OK)
        return HR_ERR;
    return hr_broadcast_tree(&op, buf, count, dtype, root);
}
