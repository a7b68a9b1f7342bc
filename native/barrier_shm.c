/* barrier_shm.c -- barrier through the node's shared-memory segment (one node only).
 *
 * Steps: signal, wait until every local rank signalled, then check that each is in this same
 * collective (the header published with the signal), so a rank that skipped or added a collective
 * is named instead of passing.
 *
 * Cost: one futex round trip, against ceil(log2 n) loopback TCP messages for the dissemination
 * barrier (barrier.c).
 */
#include "hr_internal.h"

int hr_barrier_shm(hr_op_t *op) {
    hr_op_shm_signal(op);
    if (hr_op_shm_wait(op, "barrier") != HR_OK) return HR_ERR;
    return hr_op_shm_check_peers(op);
}
