/* allreduce_shm.c -- allreduce (and reduce-scatter) through the node's shared-memory segment,
 * two-level across nodes.
 *
 * Steps, per piece of at most slot bytes (L ranks on the node, buffer parity alternating so that
 * one barrier per step suffices: a peer signals the next step only after it finished reading):
 *   1. copy in: the piece is cut into L sub-slices (hr_chunks); local rank l copies the piece of
 *      its input into its buffer, except sub-slice l, which only it reads; signal, wait for all.
 *   2. reduce: rank l reduces sub-slice l of its input and of the other L-1 buffers (in local-rank
 *      order) into its own buffer.
 *   3. inter-node (only with several nodes): rank l allreduces its sub-slice, in place in the
 *      segment, with the ranks of local index l on the other nodes: a striped ring (reduce-scatter
 *      pass + allgather pass, ring_pass.c) among them over TCP. The L sub-rings run at once.
 *   4. avg: rank l divides its sub-slice by the world size; signal, wait for all.
 *   5. copy out: every rank copies each sub-slice that lies in [lo, hi) from its owner's buffer.
 * Every sub-slice is computed by exactly one rank (and the ring keeps its own bit-identity), then
 * copied, so all ranks end bit-identical.
 *
 * Cost per byte of S (L ranks/node, N nodes, memory copy m per byte, reduction g per byte, ring
 * time for S/L bytes over N ranks R): (L-1)/L S m (in) + (L-1)/L S g + R(S/L) + S m (out), two barriers
 * (a few microseconds each) per piece. Compared with loopback TCP (two kernel copies per hop and
 * 2(n-1)/n S through the socket), the node moves each byte through memory about three times.
 */
#include "hr_internal.h"

#include <stdlib.h>
#include <string.h>

int hr_allreduce_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype,
                     int redop, size_t lo, size_t hi) {
    hr_comm_t *c = op->c;
    hr_shm_t *s = &c->shm;
    int L = s->lsize, l = s->lrank, N = s->ncol > 0 ? s->ncol : 1, j, k, first = 1, rc = HR_ERR;
    size_t esz = hr_dtype_size(dtype), pe = s->slot / esz, po = 0;
    size_t *soff = malloc(sizeof(size_t) * 2 * ((size_t)L + (size_t)N)), *scnt, *roff, *rcnt;
    const unsigned char *in = sbuf;
    unsigned char *out = rbuf;

    if (!soff) return hr_op_fail(op, "malloc(): out of memory");
    scnt = soff + L;
    roff = scnt + L;
    rcnt = roff + N;
    op->tx_total = op->rx_total = count * esz;
    do {
        size_t pn = count - po < pe ? count - po : pe;
        uint32_t b = s->parity++;
        unsigned char *mine = hr_shm_buf(s, l, b), *acc;

        /* copy in all but the own sub-slice: nobody else reads it, and the reduction below
         * reads it straight from the input */
        hr_chunks(pn, L, soff, scnt);
        if (soff[l]) memcpy(mine, in + po * esz, soff[l] * esz);
        if (pn > soff[l] + scnt[l])
            memcpy(mine + (soff[l] + scnt[l]) * esz, in + (po + soff[l] + scnt[l]) * esz,
                   (pn - soff[l] - scnt[l]) * esz);
        hr_op_shm_signal(op);
        if (hr_op_shm_wait(op, "allreduce copy-in") != HR_OK) goto cleanup;
        if (first && hr_op_shm_check_peers(op) != HR_OK) goto cleanup;
        acc = mine + soff[l] * esz;
        for (j = 0, k = 0; j < L; j++) {
            const unsigned char *other = hr_shm_buf(s, j, b) + soff[l] * esz;
            if (j == l || !scnt[l]) continue;
            if (k++ == 0) hr_reduce3(acc, in + (po + soff[l]) * esz, other, scnt[l], dtype, redop);
            else hr_reduce(acc, other, scnt[l], dtype, redop);
        }
        if (N > 1) {
            hr_chunks(scnt[l], N, roff, rcnt);
            if (hr_ring_pass_in(op, s->col, N, s->colpos, acc, NULL, roff, rcnt, s->colpos - 1, 1,
                                dtype, redop, first) != HR_OK ||
                hr_ring_pass_in(op, s->col, N, s->colpos, acc, NULL, roff, rcnt, s->colpos, 0,
                                dtype, redop, 0) != HR_OK)
                goto cleanup;
        }
        if (redop == HR_AVG && scnt[l]) hr_divide(acc, scnt[l], dtype, c->size);
        hr_op_shm_signal(op);
        if (hr_op_shm_wait(op, "allreduce reduction") != HR_OK) goto cleanup;
        for (j = 0; j < L; j++) {
            size_t a = po + soff[j], e = a + scnt[j];
            if (a < lo) a = lo;
            if (e > hi) e = hi;
            if (a < e) memcpy(out + (a - lo) * esz, hr_shm_buf(s, j, b) + (a - po) * esz, (e - a) * esz);
        }
        op->tx_done = op->rx_done = po * esz;
        po += pn;
        first = 0;
    } while (po < count);
    rc = HR_OK;
cleanup:
    free(soff);
    return rc;
}
