/* transport_tcp.h -- the small transport interface the collectives are written against.
 *
 * A transport holds, for each peer rank, nconn connected stream sockets (connected and
 * authenticated by the caller; the transport takes ownership and closes them); a peer that no
 * algorithm of this rank uses has none (-1), and connections can be added and dropped between
 * collectives. Sockets are put
 * in non-blocking mode with TCP_NODELAY; SO_SNDBUF/SO_RCVBUF are set only when asked (setting them
 * disables Linux buffer autotuning, which is usually the better choice on loopback and LANs).
 *
 * Operations never block: hr_tcp_sendv / hr_tcp_recvv move as many bytes as the kernel takes
 * right now, and hr_tcp_wait / poll() in ring_pass.c are the only places that sleep, always with a
 * deadline. Connection 0 of each peer carries the latency-bound algorithms; the striped ring
 * (ring_pass.c) spreads a pass over connections 0 .. nconn-1 ("streams").
 */
#ifndef HR_TRANSPORT_TCP_H
#define HR_TRANSPORT_TCP_H

#include <poll.h>
#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef struct hr_tcp {
    int rank, size, nconn;
    int *fds;                   /* fds[peer * nconn + k]; -1 for self and for peers not connected */
    int sockbuf;                /* applied to connections added later too */
} hr_tcp_t;

#define HR_TCP_READ 1
#define HR_TCP_WRITE 2

/* Seconds on CLOCK_MONOTONIC: the clock of every deadline in native/. */
double hr_now(void);

/* Take ownership of fds (size * nconn entries, -1 allowed), make them non-blocking with
 * TCP_NODELAY, and set SO_SNDBUF/SO_RCVBUF when sockbuf > 0. Returns 0, or -1 with a message
 * naming the failing system call in err. On failure nothing is owned. */
int hr_tcp_init(hr_tcp_t *t, int rank, int size, const int *fds, int nconn, int sockbuf,
                char *err, size_t errlen);

/* Connections on demand (collectives/ring.py): take ownership of n (<= nconn) fds to peer, which
 * must have none yet (fds[0] >= 0; later ones may be -1); hr_tcp_drop closes a peer's. */
int hr_tcp_set(hr_tcp_t *t, int peer, const int *fds, int n, char *err, size_t errlen);
void hr_tcp_drop(hr_tcp_t *t, int peer);
/* Open descriptors held. */
int hr_tcp_count(const hr_tcp_t *t);

/* Close every socket; t may be partially initialised. Idempotent. */
void hr_tcp_close(hr_tcp_t *t);

/* shutdown(SHUT_RDWR) every socket so that peers see EOF at once; sockets stay open. */
void hr_tcp_abort(hr_tcp_t *t);

/* fd of connection 0 to peer, or -1. */
int hr_tcp_fd(const hr_tcp_t *t, int peer);
/* fd of connection k to peer, or -1. */
int hr_tcp_fdk(const hr_tcp_t *t, int peer, int k);

/* hr_tcp_sendv / hr_tcp_recvv on connection k of peer (same return values). */
ssize_t hr_tcp_iok(hr_tcp_t *t, int peer, int k, struct iovec *iov, int iovcnt, int is_send,
                   char *err, size_t errlen);

/* Send up to the iovec total to peer without blocking. Returns bytes sent (0 when the socket
 * buffer is full), or -1 with "sendmsg(): <strerror>" in err. */
ssize_t hr_tcp_sendv(hr_tcp_t *t, int peer, struct iovec *iov, int iovcnt, char *err,
                     size_t errlen);

/* Receive up to the iovec total from peer without blocking. Returns bytes received (0 when
 * nothing is pending), or -1 with a message in err ("connection closed by peer" on EOF). */
ssize_t hr_tcp_recvv(hr_tcp_t *t, int peer, struct iovec *iov, int iovcnt, char *err,
                     size_t errlen);

/* Wait until peer spoke is writable (HR_TCP_WRITE) and/or rpeer readable (HR_TCP_READ), or until
 * the absolute deadline (hr_now() clock). Either peer may be -1. Returns the ready mask (0 on
 * timeout), or -1 with "poll(): ..." in err. Errors/hangups on a socket count as ready so that
 * the following send/recv reports them. */
/* Non-blocking looks, each followed by sched_yield, before a wait for a socket sleeps in poll():
 * a reply microseconds away is taken without the wake-up of a sleeping thread (on a crowded host,
 * and in a VM, an interrupt through the hypervisor), and a rank that shares its core hands it
 * over. Measured on the dev cluster, 3 nodes on 2 cores, 4 KiB, us per call, 0 vs 50 looks (two
 * runs each): allgather 74-78 vs 49-57, reduce_scatter 75-82 vs 53-63, alltoall 92-102 vs 63-72,
 * barrier 48-58 vs 38-48, allreduce 67-69 vs 52-57 (Open MPI, yielding without end: 52, 57, 59,
 * 59, 154); 200 and 1000 looks gained nothing at 4 KiB and cost at 64 KiB (allreduce 92-106 ->
 * 147 us: the spinning ranks took the senders' cores). */
#define HR_TCP_SPIN 50

/* poll() after up to HR_TCP_SPIN non-blocking looks (none when ms is 0). Same return. */
int hr_poll(struct pollfd *pf, nfds_t n, int ms);

int hr_tcp_wait(hr_tcp_t *t, int speer, int rpeer, double deadline, char *err, size_t errlen);

#endif
