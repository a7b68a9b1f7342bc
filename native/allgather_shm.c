/* allgather_shm.c -- allgather through the node's shared-memory segment (one node only).
 *
 * Steps, per piece of at most slot bytes of each rank's contribution: every rank copies its piece
 * into its buffer, signals and waits for all, then copies every rank's piece into its place in
 * the output. The buffer parity alternates, so one barrier per piece suffices (a peer signals
 * the next piece only after it has read this one).
 *
 * Cost: per rank S/L bytes in and S bytes out of memory (S = output bytes), one barrier per piece.
 */
#include "hr_internal.h"

#include <string.h>

int hr_allgather_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype) {
    hr_shm_t *s = &op->c->shm;
    size_t esz = hr_dtype_size(dtype), pe = s->slot / esz, po = 0;
    int j, first = 1;
    unsigned char *out = rbuf;

    op->tx_total = count * esz;
    op->rx_total = (size_t)(s->lsize - 1) * count * esz;
    do {
        size_t pn = count - po < pe ? count - po : pe;
        uint32_t b = s->parity++;
        if (pn) memcpy(hr_shm_buf(s, s->lrank, b), (const unsigned char *)sbuf + po * esz, pn * esz);
        hr_op_shm_signal(op);
        if (hr_op_shm_wait(op, "allgather") != HR_OK) return HR_ERR;
        if (first && hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
        for (j = 0; j < s->lsize && pn; j++) /* one node: local index = rank */
            memcpy(out + ((size_t)s->lranks[j] * count + po) * esz, hr_shm_buf(s, j, b), pn * esz);
        po += pn;
        op->tx_done = po * esz;
        first = 0;
    } while (po < count);
    return HR_OK;
}
