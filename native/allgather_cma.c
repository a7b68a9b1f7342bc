/* allgather_cma.c -- allgather on one node by reading every peer's input in place
 * (cross-memory attach: process_vm_readv; transport_shm.h says when the node may).
 *
 * Steps: publish the input's address; signal, wait for all (barrier 1: every peer has published
 * and is in this collective, whose headers are checked); read each peer j's count elements
 * straight into block j of the output and copy the own block (unless already there); signal,
 * wait (barrier 2: no rank returns, and lets its caller touch its input, while a peer still reads
 * it). In place is safe: a rank reads only its peers' own blocks, which they never write.
 *
 * Cost: per rank S bytes copied once (S = output bytes; the segment copies (1 + 1/L) S), two
 * barriers in all where the segment takes one per piece of at most slot bytes.
 */
#include "hr_internal.h"

#include <string.h>

int hr_allgather_cma(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype) {
    hr_shm_t *s = &op->c->shm;
    size_t bytes = count * hr_dtype_size(dtype);
    unsigned char *out = rbuf, *mine = out + (size_t)op->c->rank * bytes;
    int j, k;

    op->tx_total = bytes;
    op->rx_total = (size_t)(s->lsize - 1) * bytes;
    hr_op_cma_publish(op, sbuf);
    hr_op_shm_signal(op);
    if (hr_op_shm_wait(op, "allgather") != HR_OK || hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
    for (k = 1; k < s->lsize; k++) { /* lrank+1, +2, ...: no two ranks read one peer at once */
        j = (s->lrank + k) % s->lsize;  /* one node: local index j holds global rank lranks[j] */
        if (hr_op_cma_read(op, j, out + (size_t)s->lranks[j] * bytes, 0, bytes) != HR_OK) return HR_ERR;
        op->rx_done += bytes;
    }
    if ((const unsigned char *)sbuf != mine) memcpy(mine, sbuf, bytes);
    hr_op_shm_signal(op);
    if (hr_op_shm_wait(op, "allgather") != HR_OK) return HR_ERR;
    op->tx_done = bytes;
    return HR_OK;
}
