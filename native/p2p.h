/* p2p.h -- point-to-point messages of one communicator: tagged frames over one-way TCP
 * connections, matched in C.
 *
 * Connections are made and authenticated in Python (collectives/mailbox.py) and handed over as
 * fds: per peer one incoming (the peer sends on it, this rank only reads) and one outgoing (this
 * rank only writes). A frame is a 16-byte header (tag int64, payload bytes uint64, big-endian)
 * and the payload.
 *
 * p2p_queue.c: requests, the per-communicator match queue (posted receives, oldest first;
 * unexpected messages in arrival order), MPI's non-overtaking order per (sender, tag), receives
 * from any rank, deadlines, sticky failure per peer, waiting. p2p_tcp.c: the progress thread
 * (poll over the incoming fds, the outgoing ones with queued sends, and a wake eventfd), reading
 * frames straight into posted receives, writing sends (the caller writes what the socket takes
 * at once; the progress thread the rest).
 *
 * Locking: one mutex per communicator (box->mu) guards every list and state field. Socket I/O
 * happens without it. A peer's incoming fd is read by one thread at a time, the one that set
 * peer->reading: the progress thread, or a thread waiting on a receive from that peer, which
 * reads the connection itself (one wake-up per message instead of two: the progress thread's,
 * then the waiter's). A send is written by whichever thread set peer->writing: the sender
 * (what the socket takes at once), a thread waiting on a send (it waits for room itself) or the
 * progress thread. A request whose bytes are moving (peer->rreq, the head send while writing) is
 * failed only by the thread moving them, so no thread writes into or reads from a buffer the
 * caller already got back.
 *
 * The progress thread waits in epoll: an incoming fd is registered while no waiter parks on it
 * (a waiter unregisters it before it waits for bytes, and registers it again when it leaves, so
 * bytes nobody waits for are still read at once); an outgoing fd while sends wait for room (out)
 * or for the peer's acknowledgement of a direct read (in).
 *
 * p2p_direct.c: direct reads within a host. Where the peer proved at connection time that it can
 * read this rank's memory (mailbox.py, on a Unix socket), a message of at least direct_min bytes
 * goes as an offer: a 32-byte header (the length field flagged, the buffer's address, a token)
 * and no payload. The receiver's reading thread copies the bytes with process_vm_readv straight
 * into the posted receive (or, with none posted yet, into a buffer of its own, as a message that
 * came early: the send completes as soon as it is taken, as before), then writes the 8-byte
 * token back on the same socket; the send completes when the sender reads it. One copy instead
 * of the socket's two.
 */
#ifndef HR_P2P_H
#define HR_P2P_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define HR_P2P_SEND 0
#define HR_P2P_RECV 1

#define HR_P2P_HDR 16
#define HR_P2P_OFFER_HDR 32        /* a direct-read offer: the header, the address, the token */
#define HR_P2P_F_DIRECT ((uint64_t)1 << 63)   /* in the length field: an offer */
#define HR_P2P_IBUF (64 << 10)     /* per-peer read buffer: a small frame costs one recv() */

/* request state */
#define HR_P2P_POSTED 0
#define HR_P2P_ACTIVE 1            /* bytes of its message moving */
#define HR_P2P_DONE 2

/* Hints for a failure, worded in Python (collectives/mailbox.py _HINTS). */
enum hr_p2p_hint {
    HR_HINT_NONE = 0, HR_HINT_CONNECT = 1, HR_HINT_DIED = 2, HR_HINT_SIZE = 3, HR_HINT_STALL = 4,
    HR_HINT_LATE = 5
};

#define HR_P2P_WHYLEN 512

typedef struct hr_p2p_req {
    struct hr_p2p_req *next;    /* in the posted list, a send queue or the done queue */
    uint64_t id;                /* the caller's, handed back by hr_p2p_take_done */
    int kind, peer;             /* peer -1: a receive from any rank */
    int64_t tag;
    unsigned char *buf;
    size_t nbytes;
    size_t moved;               /* send: header + payload bytes written */
    unsigned char hdr[HR_P2P_OFFER_HDR];
    size_t hdrlen;              /* HR_P2P_HDR, or HR_P2P_OFFER_HDR for an offer */
    int direct, awaiting;       /* send: offered for a direct read; written, awaiting the token */
    int acked;                  /* its token came while its writer had not yet taken the mutex back */
    uint64_t token;
    double deadline, timeout;
    int state, failed, hint, source;
    int waiters;                /* threads in hr_p2p_wait (their completion needs no notice) */
    int in_doneq;               /* in the done queue, since done_at (hr_now) */
    double done_at;
    int refs;                   /* the caller's + one per list holding it; under box->mu */
    char why[HR_P2P_WHYLEN];
} hr_p2p_req_t;

/* A message that came before its receive. */
typedef struct hr_p2p_msg {
    struct hr_p2p_msg *next;
    int source;
    int64_t tag;
    size_t n;
    unsigned char *data;
} hr_p2p_msg_t;

typedef struct hr_p2p_peer {
    int in_fd, out_fd;          /* -1 until handed over */
    int in_seen;                /* an incoming connection was ever set */
    char *err;                  /* sticky failure (malloc'd), NULL while the pair is fine */
    int err_hint;               /* its hint, for the bytes in flight failed later by their reader */
    /* sends, oldest first; the head is being written when writing is set */
    hr_p2p_req_t *sq_head, *sq_tail;
    int writing;
    /* reading (progress thread only) */
    unsigned char *ibuf;
    size_t ilen, ipos;
    int in_frame;
    int64_t rtag;
    uint64_t rn;
    hr_p2p_req_t *rreq;         /* the posted receive being filled, or NULL */
    hr_p2p_msg_t *rmsg;         /* the unexpected message being filled, or NULL */
    hr_p2p_req_t *rtake;        /* a receive posted for rmsg meanwhile: it takes over the rest */
    unsigned char *rdst;
    size_t rleft;
    int reading;                /* HR_READ_*: which thread reads in_fd now (it owns rreq/rmsg/rtake) */
    pthread_t reader;
    int in_reg, out_reg;        /* registered in the progress thread's epoll set */
    int send_waiter;            /* a thread waiting on a send to this peer writes its queue itself */
    /* direct reads (p2p_direct.c) */
    int pid;                    /* incoming: the peer's pid, proved readable (0: no direct reads) */
    int direct_out;             /* outgoing: the peer reads this rank's sends directly */
    hr_p2p_req_t *aw_head, *aw_tail;   /* offers written, awaiting their tokens back */
    uint64_t token_seq;
    unsigned char abuf[8];      /* a token read in part */
    size_t alen;
    int acking;                 /* HR_READ_*: which thread reads the tokens on out_fd now */
    int rdirect;                /* the frame being read is an offer: its bytes are at raddr */
    uint64_t raddr, rtoken;
} hr_p2p_peer_t;

#define HR_READ_NONE 0
#define HR_READ_PROGRESS 1
#define HR_READ_WAITER 2

typedef struct hr_p2p {
    int rank, size;
    char **hosts;
    pthread_mutex_t mu;
    pthread_cond_t done_cv;     /* a request some thread waits on completed */
    pthread_cond_t notify_cv;   /* the done queue got a request */
    hr_p2p_peer_t *peers;
    hr_p2p_req_t *posted_head, *posted_tail;
    hr_p2p_msg_t *unexp_head, *unexp_tail;
    hr_p2p_req_t *done_head, *done_tail;   /* completed with nobody waiting: for the notifier */
    int wake_fd;                /* eventfd: wakes the progress thread */
    int ep_fd;                  /* the progress thread's epoll set */
    double busy_s;              /* a waiter polls its peer's connection this long before it sleeps
                                 * (0 when the host's ranks outnumber its cores) */
    pthread_t thread;
    int thread_started, closing, closed;
    double sleep_until;         /* the progress thread's epoll_wait() deadline; 0 while awake */
    int kick;                   /* HR_KICK_*: signals owed, sent by hr_p2p_unlock after the unlock */
    size_t direct_min;          /* offers from this many bytes (to peers that read directly) */
    uint64_t direct_sent, direct_read;   /* counts, for tests and describe() */
} hr_p2p_t;

/* The wire's big-endian 64-bit fields (frame headers, offers, tokens). */
static inline void hr_p2p_put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (56 - 8 * i));
}
static inline uint64_t hr_p2p_get64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

/* ---- p2p_queue.c ---- */
/* Set up a box for rank of size ranks (hosts copied, for messages). 0, or -1 with err. */
int hr_p2p_init(hr_p2p_t *b, int rank, int size, const char *const *hosts, char *err, size_t errlen);
/* Stop the progress thread, fail every pending request ("the communicator was closed"), close
 * the fds. Idempotent; the memory stays until hr_p2p_free. */
void hr_p2p_close(hr_p2p_t *b);
void hr_p2p_free(hr_p2p_t *b);
/* A request for buf[0..nbytes), refs = 1 (the caller's). NULL when out of memory. */
hr_p2p_req_t *hr_p2p_req_new(int kind, uint64_t id, void *buf, size_t nbytes, int peer,
                             int64_t tag, double timeout);
void hr_p2p_req_put(hr_p2p_t *b, hr_p2p_req_t *r);   /* drop a reference (takes b->mu) */
/* Post a receive: completes at once from an unexpected message, else waits in the queue. */
void hr_p2p_post_recv(hr_p2p_t *b, hr_p2p_req_t *r);
/* Queue a send; the caller writes what the socket takes now (GIL released by the binding).
 * Returns 1 when the request completed (or failed) here, 0 when the progress thread goes on. */
int hr_p2p_post_send(hr_p2p_t *b, hr_p2p_req_t *r);
/* Block until r is done or until the absolute deadline; 1 when done. */
int hr_p2p_wait(hr_p2p_t *b, hr_p2p_req_t *r, double deadline);
/* Take the completed requests nobody waited for (their ids into ids[0..max)), waiting for one
 * until the absolute deadline. Returns the count, -1 once the box is closed and drained. */
int hr_p2p_take_done(hr_p2p_t *b, uint64_t *ids, int max, double deadline);
/* The caller read r's result itself: take it off the done queue, the notifier has nothing to do. */
void hr_p2p_claim(hr_p2p_t *b, hr_p2p_req_t *r);
/* The notifier takes a completion only this long after it happened: a waiter that comes meanwhile
 * settles it in its own thread, and the notifier does not take the GIL from a thread about to
 * wait. A deadline failure nobody waits for reaches Python this much late. */
#define HR_P2P_NOTIFY_DELAY 0.001
/* Fail the pair with peer (sticky): every request with it now and later fails with why. */
void hr_p2p_fail_peer(hr_p2p_t *b, int peer, const char *why, int hint);
/* Hand over a connection (in: the peer sends on it). direct: incoming, the peer's pid whose memory
 * this rank proved it can read (0: none); outgoing, nonzero when the peer reads this rank's sends
 * directly (p2p_direct.c). 0, or -1 with err (then fd not owned). */
int hr_p2p_set_fd(hr_p2p_t *b, int peer, int fd, int incoming, int direct, char *err, size_t errlen);

/* internal, b->mu held */
void hr_p2p_complete(hr_p2p_t *b, hr_p2p_req_t *r, int source);
void hr_p2p_fail(hr_p2p_t *b, hr_p2p_req_t *r, int hint, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void hr_p2p_fail_peer_locked(hr_p2p_t *b, int peer, const char *why, int hint);
hr_p2p_req_t *hr_p2p_match(hr_p2p_t *b, int source, int64_t tag);   /* removes it from posted */
void hr_p2p_deliver(hr_p2p_t *b, hr_p2p_req_t *r, hr_p2p_msg_t *m);  /* frees m */
double hr_p2p_expire(hr_p2p_t *b, double now);   /* fail what is due; the next deadline */
void hr_p2p_size_text(size_t n, char *out, size_t len);   /* "4 MiB", "1.5 KiB", "16 B" */
const char *hr_p2p_who(hr_p2p_t *b, int r, char *out, size_t len);  /* "rank 2 (node1)" */
void hr_p2p_wake(hr_p2p_t *b);
/* Unlock b->mu, then send the signals owed (b->kick): a woken thread does not find the mutex
 * still held (on 2 busy cores that hand-back cost a context switch per message). */
#define HR_KICK_DONE 1              /* done_cv: a request some thread waits on completed */
#define HR_KICK_NOTIFY 2            /* notify_cv: the done queue got a request */
#define HR_KICK_WAKE 4              /* the progress thread must rebuild its poll set */
void hr_p2p_unlock(hr_p2p_t *b);
/* The progress thread's poll() sleeps at most this long, so a request posted meanwhile needs
 * no wake unless its deadline is sooner. */
#define HR_P2P_NAP 0.1

/* A waiter polls its peer's connection this long (no sleep, no wake-up to pay) when the host has
 * a core per rank: about a round trip of the torch layer on the other side (benchmarks/
 * p2p_pingpong.py --layers), so a ping-pong's reply is caught spinning. */
#define HR_P2P_BUSY_US 200

/* ---- p2p_tcp.c ---- */
void *hr_p2p_progress(void *arg);              /* the progress thread */
/* Write queued sends of peer until the socket is full (b->mu held; released during I/O). */
void hr_p2p_write(hr_p2p_t *b, int peer);
/* (Un)register peer's fds in the progress thread's epoll set as their state asks (b->mu held). */
void hr_p2p_arm(hr_p2p_t *b, int peer);
/* A thread waiting for r (a receive from one rank) reads that rank's connection itself until r
 * is done, the deadline, r's own deadline or a failure (b->mu held; released during I/O and
 * waits). 0 when another thread reads it now (or there is nothing to read): wait on done_cv. */
int hr_p2p_read_for(hr_p2p_t *b, hr_p2p_req_t *r, double deadline);
/* A thread waiting for r (a send) writes the peer's queue itself, waiting for room in poll(), until
 * r is done, the deadline or a failure (b->mu held). 0 when another thread writes it now. */
int hr_p2p_write_for(hr_p2p_t *b, hr_p2p_req_t *r, double deadline);
/* Wait for fd to be ready for events: poll without sleeping for b->busy_s from the first call
 * (busy_end 0), then sleep until `until`, at most HR_P2P_NAP (b->mu held; released meanwhile). */
void hr_p2p_park(hr_p2p_t *b, int fd, short events, double now, double until, double *busy_end);
/* The in-flight bytes of a failed pair are freed by the thread that reads its connection, or by
 * anyone while nobody does. 1 when this thread may. */
int hr_p2p_reads_here(hr_p2p_t *b, int peer);

/* ---- p2p_direct.c ---- */
/* Make r (a send not yet started, to a peer with direct_out) an offer if it is large enough. */
void hr_p2p_offer(hr_p2p_t *b, hr_p2p_peer_t *p, hr_p2p_req_t *r);
/* The offer r was written: it waits for its token (b->mu held); failed at once when the pair
 * failed meanwhile (fail_peer ran while r was the head being written, so it was left to us). */
void hr_p2p_offered(hr_p2p_t *b, int peer, hr_p2p_req_t *r);
/* The reading thread of peer's connection copies the offered bytes still missing into p->rdst
 * (b->mu held; released during the copy). A failed copy fails the pair. */
void hr_p2p_direct_read(hr_p2p_t *b, int peer);
/* The offer was read: write its token back (b->mu held). 0, or -1 after failing the pair. */
int hr_p2p_direct_ack(hr_p2p_t *b, int peer);
/* Read the tokens peer wrote back on the outgoing connection and complete their sends, unless
 * another thread reads them now (b->mu held; released during I/O). */
void hr_p2p_read_acks(hr_p2p_t *b, int peer);
/* A thread waiting for r (an offer written) reads the tokens itself until r is done, the
 * deadline, r's own deadline or a failure (b->mu held). 0 when another thread reads them now. */
int hr_p2p_ack_for(hr_p2p_t *b, hr_p2p_req_t *r, double deadline);

#endif
