/* transport_shm.h -- a shared-memory segment shared by the ranks of one node.
 *
 * Layout: a header with one cache line per local rank (a phase counter that is also a futex
 * word, an "I failed" flag, the pid and the header of the collective it is in), then two
 * buffers of `slot` bytes per local rank (double buffering: piece p uses buffer parity p, counted
 * across collectives, so a rank may fill its next buffer while peers still read the last one).
 *
 * Lifetime (collectives/ring.py): the node's first rank creates the segment (shm_open O_EXCL,
 * mode 0600, per-job name), every local rank maps it, and once all have mapped it every rank
 * shm_unlinks the name, so nothing is left in /dev/shm on any later exit, SIGKILL included (the
 * memory goes away with the last mapping).
 *
 * Synchronisation: hr_shm_signal bumps this rank's counter (release) and wakes futex waiters,
 * if any (a waiter counts itself in the counter's cell before it sleeps, so the common case of
 * a peer already spinning costs no system call); hr_shm_wait waits until every local peer's
 * counter reached this rank's, spinning briefly (a few microseconds reading the counter, then
 * sched_yield rounds; not at all when the node's ranks outnumber its cores: the peer it waits
 * for needs this core, and 20-2000 yields first measured 2-3x slower at 8 ranks on 2 cores,
 * docs/collectives.md), then sleeping in FUTEX_WAIT for at most 5 ms at a time so that the
 * deadline and the peers' liveness are checked: a peer whose TCP connection reads EOF without having set its failed flag
 * died (SIGKILL, segfault), and is named as such; a peer that set the flag failed on its own and
 * its message says why.
 */
#ifndef HR_TRANSPORT_SHM_H
#define HR_TRANSPORT_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "transport_tcp.h"

#define HR_SHM_MAGIC 0x68727368u /* "hrsh" */
/* Microseconds a wait reads the counter (no system call) before it yields, then sleeps: a
 * 4 KiB allreduce's barrier partner is usually that close (benchmarks/ring_loopback.py --mpi). */
#define HR_SHM_BUSY_US 20
/* sched_yield rounds before a wait sleeps, with a core per rank and with more ranks than cores.
 * Oversubscribed, a futex sleep costs most: the woken rank's core has often gone idle, and waking
 * an idle vCPU takes an IPI through the hypervisor. 50 yields keep the core with runnable ranks
 * for the few microseconds a small call's partner needs (4 ranks on 2 cores, 4 KiB allreduce:
 * 66 -> 12 us; docs/collectives.md "Small calls on a crowded host"), and cost a waiter behind a
 * slow rank about 50 system calls before it sleeps. */
#define HR_SHM_YIELDS 200
#define HR_SHM_YIELDS_OVERSUB 50

typedef struct hr_shm_cell {
    uint32_t phase;         /* futex word: signals so far */
    uint32_t failed;        /* set before this rank aborts its connections */
    int32_t pid;
    uint32_t hstart;        /* phase at which hdr's collective started (0 while it is written) */
    unsigned char hdr[24];  /* hr_hdr_t of the collective in progress */
    uint32_t sleepers;      /* peers in (or entering) FUTEX_WAIT on phase: a signal with none
                             * skips the wake-up system call */
    uint32_t fill;
    uint64_t cma_probe;     /* address of this rank's probe word (hr_shm_cma_probe) */
    uint64_t cma_addr;      /* the buffer peers read with process_vm_readv in the collective in
                             * progress (written before its first signal, kept until its last) */
} hr_shm_cell_t;            /* 64 bytes: one cache line */

typedef struct hr_shm {
    unsigned char *base;    /* mapping, NULL when not attached */
    size_t len, slot;       /* mapping bytes; bytes per buffer */
    int lsize, lrank;       /* ranks on this node; this rank's index among them */
    int *lranks;            /* global rank of each local index */
    int ncol, colpos;       /* two-level: nodes; this node's index */
    int *col;               /* global ranks of local index lrank on every node (node order) */
    uint32_t phase;         /* this rank's counter (private copy) */
    uint32_t parity;        /* buffer parity of the next piece */
    int spin;               /* sched_yield rounds before sleeping (HR_SHM_YIELDS*) */
    int busy;               /* microseconds of counter reads before the sched_yield rounds (0
                             * when ranks outnumber cores: the peer needs this core) */
    int cma;                /* 1: every local rank can read every other's memory (single copy) */
    uint64_t probe;         /* its own address ^ HR_SHM_CMA_MAGIC: what a peer's probe must read */
} hr_shm_t;

/* Why hr_shm_wait stopped waiting (the transport reports; comm.c words the error). */
enum hr_shm_fail {
    HR_SHM_ABORTED = 1,     /* the communicator failed meanwhile: its error is recorded already */
    HR_SHM_TIMEOUT,         /* peer: the first local rank not there by the deadline */
    HR_SHM_PEER_DIED,       /* peer: its TCP connection reads EOF and it set no failed flag */
    HR_SHM_PEER_FAILED,     /* peer: it set its failed flag (its own error says why) */
    HR_SHM_OUT_OF_STEP      /* peer: it sent TCP data while this rank waits in shared memory */
};

typedef struct hr_shm_why {
    int kind;               /* enum hr_shm_fail */
    int peer;               /* global rank */
} hr_shm_why_t;

/* Segment bytes for lsize ranks with buffers of slot bytes. */
size_t hr_shm_bytes(int lsize, size_t slot);

/* Create (create != 0: O_CREAT|O_EXCL, mode 0600, posix_fallocate) or open the POSIX shm object
 * `name` and map it; the descriptor is closed at once. Returns 0, or -1 with the failing system
 * call in err (nothing mapped). */
int hr_shm_map(const char *name, int create, size_t bytes, unsigned char **out, char *err,
               size_t errlen);

/* shm_unlink(name); ENOENT is not an error (another local rank was first). */
int hr_shm_unlink(const char *name, char *err, size_t errlen);

/* Bump this rank's phase and wake its waiters. hdr (the 24-byte collective header, or NULL) is
 * published with it on a collective's first signal, for hr_shm_peer_hdr. Returns the new phase. */
uint32_t hr_shm_signal(hr_shm_t *s, const void *hdr);

/* Wait until every local peer's phase reached this rank's, or until the absolute deadline
 * (hr_now() clock). Between short sleeps it reads *failed (another thread of this rank failed
 * the communicator) and the peers' liveness: their failed flags, and EOF or unexpected data on
 * their TCP connection 0 in tcp. Returns 0, or -1 with why filled; a dead peer is named before
 * one that failed because of it. */
int hr_shm_wait(hr_shm_t *s, const hr_tcp_t *tcp, double deadline, const int *failed,
                hr_shm_why_t *why);

/* Copy local peer l's published header (24 bytes) into hdr when it belongs to the collective
 * whose first signal was phase start. Returns 1, or 0 when that peer is not in it (not yet, or
 * already past it: then it passed this collective with us). */
int hr_shm_peer_hdr(const hr_shm_t *s, int l, uint32_t start, void *hdr);

/* Cross-memory attach (process_vm_readv, Linux >= 3.2): a rank reads a peer's buffer straight
 * into its own, one copy where the segment takes two. It needs ptrace access to the peer (same
 * user, and Yama's ptrace_scope, seccomp or a container may forbid it), so the node's ranks probe
 * at setup and use it only when every one of them can read every other (collectives/ring_shm.py
 * agrees through the store). */
#define HR_SHM_CMA_MAGIC 0x6872636d61707262ull /* "hrcmaprb" */

/* Publish this rank's probe word in its cell (hr_comm_shm_attach does it). */
void hr_shm_cma_publish(hr_shm_t *s);

/* 1 when this rank can read every local peer's probe word (after every local rank attached and
 * published), 0 when it cannot (errno of the first failure in *err, 0 for a wrong value). */
int hr_shm_cma_probe(const hr_shm_t *s, int *err);

/* Read n bytes at src in local peer l's memory into dst (process_vm_readv, partial transfers
 * continued). Returns 0, or -1 with errno set (ESRCH: the peer is gone). */
int hr_shm_cma_read(const hr_shm_t *s, int l, void *dst, uint64_t src, size_t n);
/* Copy n bytes at src in process pid into dst (process_vm_readv, partial copies continued): 0, or
 * -1 with errno (ESRCH: no such process, EFAULT: not mapped there, EPERM: not allowed). */
int hr_vm_read(int pid, void *dst, uint64_t src, size_t n);

/* Tell the local peers that this rank failed on its own (it did not die). */
void hr_shm_set_failed(hr_shm_t *s);

static inline hr_shm_cell_t *hr_shm_cell(const hr_shm_t *s, int l) {
    return (hr_shm_cell_t *)(void *)(s->base + 64 + (size_t)l * sizeof(hr_shm_cell_t));
}
static inline unsigned char *hr_shm_buf(const hr_shm_t *s, int l, uint32_t parity) {
    size_t hdr = (64 + (size_t)s->lsize * sizeof(hr_shm_cell_t) + 4095) & ~(size_t)4095;
    return s->base + hdr + ((size_t)l * 2 + (parity & 1)) * s->slot;
}

#endif
