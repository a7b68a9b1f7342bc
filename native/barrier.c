/* barrier.c -- dissemination barrier.
 *
 * Steps: for k = 1, 2, 4, .. < n, send a header-only message to rank (r + k) mod n and wait for
 * one from rank (r - k) mod n. After round k every rank has (transitively) heard from 2k ranks,
 * so after ceil(log2 n) rounds nobody leaves before everybody arrived. The header carries the
 * sequence number, so a rank that skipped or added a collective is reported as a mismatch.
 *
 * On one node with a shared-memory segment: one signal-and-wait on it (barrier_shm.c).
 *
 * Cost: ceil(log2 n) rounds of one 24-byte message: time ~ ceil(log2 n) a.
 */
#include "hr_internal.h"

/* Contract: called by all ranks; returns HR_OK when all have entered, else HR_ERR. */
int hr_barrier(hr_comm_t *c, double timeout) {
    hr_op_t op;
    int n = c->size, r = c->rank, k;
    if (hr_op_begin(&op, c, HR_K_BARRIER, HR_U8, 0, 0, -1, timeout) != HR_OK) return HR_ERR;
    if (c->shm.base && c->shm.ncol == 1) return hr_barrier_shm(&op);
    if (hr_use_direct(c, 0)) return hr_barrier_direct(&op);      /* one round (direct_others.c) */
    for (k = 1; k < n; k <<= 1)
        if (hr_sendrecv(&op, (r + k) % n, NULL, 0, 1, (r - k + n) % n, NULL, 0, 1) != HR_OK)
            return HR_ERR;
    return HR_OK;
}
