/* alltoall_shm.c -- alltoall through the node's shared-memory segment (one node only).
 *
 * Each rank's count elements are L blocks of B = count/L; block j goes to local rank j. Steps, per
 * piece of at most slot/L bytes of every block (piece p = elements [po, po + pn) of each block):
 *   1. every rank copies piece p of each of its L blocks into its buffer (block j's piece at
 *      offset j * pn), except its own block, which it copies straight to its output;
 *   2. signal, wait for all (buffer parity alternates: one barrier per piece suffices);
 *   3. rank r copies piece p of block r out of every other rank j's buffer into block j of its
 *      output.
 * In place needs no scratch: a rank overwrites output piece p of block j only after it copied its
 * input piece p of every block into its buffer (step 1 of the same piece), and later pieces lie
 * elsewhere.
 *
 * Cost: per rank (L-1)/L S bytes into memory and the same out (S = count bytes), in parallel on
 * all ranks, plus one barrier per piece: against the pairwise exchange over loopback TCP (two
 * kernel copies per byte and L-1 rounds of send/recv), about one memcpy of S.
 */
#include "hr_internal.h"

#include <string.h>

int hr_alltoall_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype) {
    hr_shm_t *s = &op->c->shm;
    int L = s->lsize, r = s->lrank, j, first = 1;
    size_t esz = hr_dtype_size(dtype), B = count / (size_t)L, pe = s->slot / (size_t)L / esz, po = 0;
    const unsigned char *in = sbuf;
    unsigned char *out = rbuf;

    if (pe == 0)
        return hr_op_fail(op, "shared-memory piece of %zu bytes is too small for %d ranks", s->slot, L);
    op->tx_total = op->rx_total = (size_t)(L - 1) * B * esz;
    do {
        size_t pn = B - po < pe ? B - po : pe;
        uint32_t b = s->parity++;
        unsigned char *mine = hr_shm_buf(s, r, b);
        for (j = 0; j < L && pn; j++)
            if (j != r) memcpy(mine + (size_t)j * pn * esz, in + ((size_t)j * B + po) * esz, pn * esz);
        if (pn && in != out)
            memcpy(out + ((size_t)r * B + po) * esz, in + ((size_t)r * B + po) * esz, pn * esz);
        hr_op_shm_signal(op);
        if (hr_op_shm_wait(op, "alltoall") != HR_OK) return HR_ERR;
        if (first && hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
        for (j = 0; j < L && pn; j++)
            if (j != r)
                memcpy(out + ((size_t)j * B + po) * esz, hr_shm_buf(s, j, b) + (size_t)r * pn * esz,
                       pn * esz);
        po += pn;
        op->tx_done = op->rx_done = po * esz * (size_t)(L - 1);
        first = 0;
    } while (po < B);
    return HR_OK;
}
