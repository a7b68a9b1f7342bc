/* broadcast_tree.c -- binomial-tree broadcast, for small messages.
 *
 * Ranks are renumbered from the root: v = (r - root) mod n. Virtual rank v > 0 receives the
 * whole message from its parent v - lowbit(v), then (like the root, whose lowbit counts as the
 * smallest power of two >= n) forwards it to the children v + m for m = lowbit(v)/2, .., 2, 1
 * (largest subtree first) where v + m < n. After ceil(log2 n) rounds every rank has the data.
 *
 * Cost: ceil(log2 n) (a + S b) on the critical path, against (n-1) a + S b for the pipelined
 * chain (broadcast_pipeline.c): the tree wins while latency dominates; the cut-over is in
 * broadcast.c.
 */
#include "hr_internal.h"

int hr_broadcast_tree(hr_op_t *op, void *buf, size_t count, int dtype, int root) {
    hr_comm_t *c = op->c;
    int n = c->size, v = (c->rank - root + n) % n, m;
    size_t bytes = count * hr_dtype_size(dtype);

    op->tx_total = op->rx_total = bytes; /* per message; good enough for messages */
    m = 1;
    while (m < n) m <<= 1;               /* the root's "lowbit" */
    if (v > 0) {
        m = v & -v;
        if (hr_sendrecv(op, -1, NULL, 0, 0, (v - m + root) % n, buf, bytes, 1) != HR_OK)
            return HR_ERR;
    }
    for (m >>= 1; m > 0; m >>= 1) {
        if (v + m >= n) continue;
        op->tx_done = 0;
        if (hr_sendrecv(op, (v + m + root) % n, buf, bytes, 1, -1, NULL, 0, 0) != HR_OK)
            return HR_ERR;
    }
    return HR_OK;
}
