/* reduce_scatter_shm.c -- reduce-scatter through the node's shared-memory segment (one node
 * only; across nodes allreduce_shm.c keeps the rank's chunk instead).
 *
 * Rank r owns output elements [lo, hi) of the input (hr_chunks). Steps, per piece of at most slot
 * bytes (elements [po, po + pn); buffer parity alternating, so one barrier per piece suffices: a
 * peer signals the next piece only after it has read this one):
 *   1. copy in: every rank copies the piece into its buffer, except the part it owns itself,
 *      which only it reads (straight from its input);
 *   2. signal, wait for all;
 *   3. rank r reduces its owned part of the piece -- its own input, then the other ranks'
 *      buffers in local-rank order -- straight into its output; avg divides by the size.
 * Each output element is computed once, by its owner.
 *
 * Cost: per rank (L-1)/L S bytes into memory, (L-1)/L S reduced (S = input bytes), one barrier
 * per piece, against allreduce_shm.c's two barriers and copy-out (measured, 4 ranks on 2 cores,
 * two runs each: 4 KiB 13-23 -> 10 us, 64 KiB 25-40 -> 20 us, 1 MiB 119-124 -> 97-102 us; at 8
 * ranks 4 KiB the same, 1 MiB 584-593 -> 476-507 us).
 */
#include "hr_internal.h"

#include <string.h>

int hr_reduce_scatter_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype,
                          int redop, size_t lo, size_t hi) {
    hr_shm_t *s = &op->c->shm;
    int L = s->lsize, l = s->lrank, j, k, first = 1;
    size_t esz = hr_dtype_size(dtype), pe = s->slot / esz, po = 0;
    const unsigned char *in = sbuf;
    unsigned char *out = rbuf;

    op->tx_total = op->rx_total = count * esz;
    do {
        size_t pn = count - po < pe ? count - po : pe;
        size_t a = lo > po ? lo : po, e = hi < po + pn ? hi : po + pn;
        uint32_t b = s->parity++;
        unsigned char *mine = hr_shm_buf(s, l, b);

        if (a > e) a = e = po + pn;             /* owns nothing of this piece */
        if (a > po) memcpy(mine, in + po * esz, (a - po) * esz);
        if (po + pn > e) memcpy(mine + (e - po) * esz, in + e * esz, (po + pn - e) * esz);
        hr_op_shm_signal(op);
        if (hr_op_shm_wait(op, "reduce_scatter") != HR_OK) return HR_ERR;
        if (first && hr_op_shm_check_peers(op) != HR_OK) return HR_ERR;
        for (j = 0, k = 0; j < L && a < e; j++) {
            const unsigned char *other = hr_shm_buf(s, j, b) + (a - po) * esz;
            if (j == l) continue;
            if (k++ == 0) hr_reduce3(out + (a - lo) * esz, in + a * esz, other, e - a, dtype, redop);
            else hr_reduce(out + (a - lo) * esz, other, e - a, dtype, redop);
        }
        if (redop == HR_AVG && a < e) hr_divide(out + (a - lo) * esz, e - a, dtype, op->c->size);
        po += pn;
        op->tx_done = op->rx_done = po * esz;
        first = 0;
    } while (po < count);
    return HR_OK;
}
