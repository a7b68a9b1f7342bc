/* allreduce_rd.c -- latency-optimal allreduce by recursive doubling (any world size).
 *
 * Steps (n ranks, p = largest power of two <= n, rem = n - p):
 *   1. fold: among the first 2*rem ranks, each even rank sends its whole buffer to the odd rank
 *      above it, which reduces it; the even ranks then sit out. The p remaining ranks get
 *      virtual ranks v (odd r < 2 rem: v = r/2; r >= 2 rem: v = r - rem).
 *   2. recursive doubling: for mask = 1, 2, .., p/2, exchange the whole buffer with virtual
 *      rank v ^ mask and reduce (buf = buf OP received; OP is commutative bit for bit, so both
 *      partners compute identical values).
 *   3. unfold: each odd rank below 2 rem sends the result back to its even partner.
 *   4. avg: every rank divides its (identical) result by n.
 *
 * Cost: log2(p) steps (+2 when n is not a power of two), each moving the whole S bytes:
 *   time ~ (log2 p [+2]) (a + S b + S g). Fewer latencies than the ring's 2(n-1) but S bytes per
 *   step instead of S/n, so it wins only for small messages; the cut-over is in allreduce.c.
 */
#include "hr_internal.h"

int hr_fold(hr_op_t *op, void *buf, size_t count, int dtype, int redop, int *v) {
    hr_comm_t *c = op->c;
    int n = c->size, r = c->rank, p = 1, rem;
    size_t bytes = count * hr_dtype_size(dtype);

    while (p * 2 <= n) p *= 2;
    rem = n - p;
    if (r >= 2 * rem) {
        *v = r - rem;
        return HR_OK;
    }
    if (r % 2 == 0) {
        *v = -1;
        return hr_sendrecv(op, r + 1, buf, bytes, 1, -1, NULL, 0, 0);
    }
    if (hr_sendrecv(op, -1, NULL, 0, 0, r - 1, c->tmp, bytes, 1) != HR_OK) return HR_ERR;
    hr_reduce(buf, c->tmp, count, dtype, redop);
    *v = r / 2;
    return HR_OK;
}

int hr_unfold(hr_op_t *op, void *buf, size_t bytes) {
    hr_comm_t *c = op->c;
    int n = c->size, r = c->rank, p = 1;

    while (p * 2 <= n) p *= 2;
    if (r >= 2 * (n - p)) return HR_OK;
    op->tx_done = op->rx_done = 0;
    if (r % 2 == 1) return hr_sendrecv(op, r - 1, buf, bytes, 0, -1, NULL, 0, 0);
    return hr_sendrecv(op, -1, NULL, 0, 0, r + 1, buf, bytes, 0);
}

int hr_allreduce_rd(hr_op_t *op, void *buf, size_t count, int dtype, int redop) {
    hr_comm_t *c = op->c;
    int n = c->size, p = 1, rem, v, mask;
    size_t bytes = count * hr_dtype_size(dtype);

    while (p * 2 <= n) p *= 2;
    rem = n - p;
    if (hr_comm_tmp(op, bytes ? bytes : 1) != HR_OK) return HR_ERR;
    op->tx_total = op->rx_total = bytes; /* per exchange; good enough for messages */
    if (hr_fold(op, buf, count, dtype, redop, &v) != HR_OK) return HR_ERR;
    if (v >= 0) {
        for (mask = 1; mask < p; mask <<= 1) {
            int pv = v ^ mask, peer = pv < rem ? pv * 2 + 1 : pv + rem;
            op->tx_done = op->rx_done = 0;
            if (hr_sendrecv(op, peer, buf, bytes, 1, peer, c->tmp, bytes, 1) != HR_OK)
                return HR_ERR;
            hr_reduce(buf, c->tmp, count, dtype, redop);
        }
    }
    if (hr_unfold(op, buf, bytes) != HR_OK) return HR_ERR;
    if (redop == HR_AVG) hr_divide(buf, count, dtype, n);
    return HR_OK;
}
