/* alltoall_cma.c -- alltoall on one node: rank r reads block r of every peer's input in place
 * (cross-memory attach: process_vm_readv; transport_shm.h says when the node may).
 *
 * Each rank's count elements are L blocks of B = count/L; block j goes to local rank j. Steps:
 * publish the input's address; signal, wait for all (barrier 1, headers checked); read block r
 * of each peer j's input into block j of the output and copy the own block; signal, wait
 * (barrier 2: inputs stay untouched until every peer has read its block). In place, the input is
 * first copied to scratch, which the peers read: rank r's output block j would otherwise be
 * overwritten while peer j may still read input block j there (and every rank must take the same
 * path whether or not its peers run in place).
 *
 * Cost: per rank (L-1)/L S bytes copied once (the segment: twice), plus S in place, two barriers.
 */
#include "hr_internal.h"

#include <string.h>

int hr_alltoall_cma(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype) {
    hr_shm_t *s = &op->c->shm;
    int L = s->lsize, r = s->lrank, j, k;
    size_t blk = count / (size_t)L * hr_dtype_size(dtype);
    unsigned char *out = rbuf;

    if (sbuf == rbuf) {
        if (hr_comm_tmp(op, (size_t)L * blk + 1) != HR_OK) return HR_ERR;
        memcpy(op->c->tmp, sbuf, (size_t)L * blk);
        sbuf = op->c->tmp;
    }
    op->tx_total = op->rx_total = (size_t)(L - 1) * blk;
    hr_op_cma_publish(op, sbuf);
    hr_op_shm_signal(op);
    if (hr_op_shm_wait(op, "alltoall") != HR_OK || hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
    for (k = 1; k < L; k++) {         /* r+1, r+2, ...: no two ranks read one peer at once */
        j = (r + k) % L;
        if (hr_op_cma_read(op, j, out + (size_t)j * blk, (size_t)r * blk, blk) != HR_OK) return HR_ERR;
        op->rx_done += blk;
    }
    memcpy(out + (size_t)r * blk, (const unsigned char *)sbuf + (size_t)r * blk, blk);
    hr_op_shm_signal(op);
    if (hr_op_shm_wait(op, "alltoall") != HR_OK) return HR_ERR;
    op->tx_done = op->rx_done;
    return HR_OK;
}
