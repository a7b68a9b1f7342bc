/* broadcast_cma.c -- broadcast on one node: every rank reads the root's buffer in place
 * (cross-memory attach: process_vm_readv; transport_shm.h says when the node may).
 *
 * Steps: the root publishes its buffer's address; signal, wait for all (barrier 1, headers
 * checked); every other rank reads the S bytes into its buffer; signal, wait (barrier 2: the root
 * returns only once all have read).
 *
 * Cost: S bytes copied once per receiving rank, in parallel (the segment: once into it by the
 * root and once out per rank, with a barrier per piece), two barriers.
 */
#include "hr_internal.h"

int hr_broadcast_cma(hr_op_t *op, void *buf, size_t count, int dtype, int root) {
    hr_shm_t *s = &op->c->shm;
    size_t bytes = count * hr_dtype_size(dtype);
    int lroot = -1, j;

    for (j = 0; j < s->lsize; j++)
        if (s->lranks[j] == root) lroot = j;
    if (lroot < 0) return hr_op_fail(op, "broadcast root %d is not on this node", root);
    op->tx_total = op->rx_total = bytes;
    hr_op_cma_publish(op, buf);
    hr_op_shm_signal(op);
    if (hr_op_shm_wait(op, "broadcast") != HR_OK || hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
    if (s->lrank != lroot && hr_op_cma_read(op, lroot, buf, 0, bytes) != HR_OK) return HR_ERR;
    op->rx_done = bytes;
    hr_op_shm_signal(op);
    return hr_op_shm_wait(op, "broadcast");
}
