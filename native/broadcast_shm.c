/* broadcast_shm.c -- broadcast through the node's shared-memory segment (one node only).
 *
 * Steps, per piece of at most slot bytes: the root copies the piece into its buffer; every rank
 * signals and waits for all; the others copy the piece out. Buffer parity alternates, so one
 * barrier per piece suffices.
 *
 * Cost: S bytes into memory once (root) and out once per rank, running in parallel, one barrier
 * per piece: about one memcpy of S, against S through loopback TCP per link for the chain.
 */
#include "hr_internal.h"

#include <string.h>

int hr_broadcast_shm(hr_op_t *op, void *buf, size_t count, int dtype, int root) {
    hr_shm_t *s = &op->c->shm;
    size_t esz = hr_dtype_size(dtype), pe = s->slot / esz, po = 0;
    int lroot = -1, j, first = 1, me = op->c->rank == root;
    unsigned char *p = buf;

    for (j = 0; j < s->lsize; j++)
        if (s->lranks[j] == root) lroot = j;
    if (lroot < 0) return hr_op_fail(op, "broadcast root %d is not on this node", root);
    op->tx_total = op->rx_total = count * esz;
    do {
        size_t pn = count - po < pe ? count - po : pe;
        uint32_t b = s->parity++;
        if (me && pn) memcpy(hr_shm_buf(s, lroot, b), p + po * esz, pn * esz);
        hr_op_shm_signal(op);
        if (hr_op_shm_wait(op, "broadcast") != HR_OK) return HR_ERR;
        if (first && hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
        if (!me && pn) memcpy(p + po * esz, hr_shm_buf(s, lroot, b), pn * esz);
        po += pn;
        op->rx_done = po * esz;
        first = 0;
    } while (po < count);
    return HR_OK;
}
