/* hr_internal.h -- shared types of the hpcring native collectives.
 *
 * A communicator (hr_comm_t) owns connected, already-authenticated TCP streams to the peers its
 * algorithms use (connection setup and authentication happen in Python, see collectives/ring.py). Every
 * collective is called by all ranks in the same order with matching arguments; the byte stream
 * between two ranks carries no framing except a 24-byte header (hr_hdr_t) at the start of each
 * collective's first message to a peer, which lets the receiver detect mismatched calls
 * (different op, dtype, element count, root or sequence number) before it touches any data.
 *
 * Errors are return codes (HR_OK / HR_ERR). The first error of a communicator is sticky: it is
 * formatted into comm->err ("allreduce#17 recv from rank 3 (node2) timed out after 30.0 s,
 * 1048576/4194304 bytes done"), every socket is shut down so that neighbours fail fast instead of
 * waiting for their deadline, and every later call returns HR_ERR with the same message.
 */
#ifndef HR_INTERNAL_H
#define HR_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "transport_tcp.h"
#include "transport_shm.h"

#define HR_OK 0
#define HR_ERR (-1)

#define HR_ERRLEN 1024

/* Striped ring (ring_pass.c): a pass uses one stream per HR_STRIPE_MIN_DEFAULT bytes of a chunk,
 * up to comm->streams, and min(streams used, comm->threads) threads. */
#define HR_STRIPE_MIN_DEFAULT ((size_t)1 << 20)
#define HR_MAX_STREAMS 16

/* broadcast: messages below this many bytes use the binomial tree (broadcast.c). */
#define HR_BCAST_TREE_MAX_DEFAULT ((size_t)262144)

/* allreduce/reduce-scatter across hosts: two-level (allreduce_shm.c) from this many bytes, flat
 * TCP ring / recursive doubling below (measured, see allreduce.c). */
#define HR_TWOLEVEL_MIN_DEFAULT ((size_t)8 << 20)

/* One node with shared memory, where the node's ranks agreed they may (transport_shm.h): alltoall
 * reads its peers' blocks directly (alltoall_cma.c) from blocks of this many bytes, the segment's
 * two copies below. Measured with hpcring bench -B ring, HPCRING_RING_CMA=0 vs 1, 2 cores, best
 * of 2 runs, segment time / direct time: 2 ranks 0.53x at 512 KiB blocks, 1.30x at 2 MiB; 4 ranks
 * 1.16x at 256 KiB, 1.34x at 1 MiB, 1.41x at 16 MiB; 8 ranks 0.80x at 128 KiB, 1.19x at 512 KiB,
 * 1.98x at 2 MiB, 2.32x at 8 MiB (the segment's pieces are slot/L per block: more barriers).
 * Once reads started at the next rank, the cut moved down with the rank count: ring_shm.py's
 * default_cma_alltoall_min sets it per host (2 ranks 1 MiB, 4 ranks 512 KiB, 8 ranks 128 KiB);
 * this is the value for a communicator that did not set one. */
#define HR_CMA_MIN_DEFAULT ((size_t)1 << 20)
/* broadcast reads directly (broadcast_cma.c) from this many bytes; 0: never, the default.
 * Measured slower than the segment at 2-8 ranks (0.3-1.0x; again on 2026-11-29, 64 KiB-16 MiB:
 * 0.6-1.0x): the segment's pipelined pieces stay in cache, a direct read of a whole buffer does
 * not. Where many cores and no hypervisor change that, set it (HPCRING_RING_CMA_GATHER_MIN).
 * allgather has its own cut, c->cma_allgather_min, which ring_shm.py sets where a direct read
 * paid: the host's ranks each with a core (2 ranks on 2 cores: 64 KiB 10 vs 39 us, 1 MiB 108 vs
 * 530 us, 16 MiB 2.7 vs 9.6 ms; 8 ranks on 2 cores it lost, 64 KiB 306-376 vs 112-165 us). */
#define HR_CMA_GATHER_MIN_DEFAULT ((size_t)0)

/* allreduce: messages below this many bytes use recursive doubling (measured, allreduce.c). */
#define HR_RD_THRESHOLD_DEFAULT ((size_t)262144)

/* allreduce from the RD threshold up: recursive halving/doubling (allreduce_rh.c) while each
 * rank's share (bytes / size) is below this, the ring from there (measured, allreduce.c; at the
 * defaults only from 5 ranks up). 0 turns it off. */
#define HR_RH_CHUNK_DEFAULT ((size_t)65536)

/* allreduce on at most HR_DIRECT_MAX_RANKS ranks: one round of direct exchange
 * (allreduce_direct.c) while the bytes each rank sends, (n-1) S, are at most c->direct_max
 * (measured, allreduce.c). 0 turns it off. At most 3 ranks: the ring's neighbours are then every
 * rank, so connections on demand hold what it needs. */
#define HR_DIRECT_MAX_RANKS 3
#define HR_DIRECT_MAX_DEFAULT ((size_t)32768)

/* Element types. Numbers are part of the Python binding's ABI: the module exports them (DTYPES,
 * OPS) and hpcring.collectives.dtypes checks its table against them at import. */
enum hr_dtype {
    HR_F16 = 0, HR_BF16 = 1, HR_F32 = 2, HR_F64 = 3,
    HR_I32 = 4, HR_I64 = 5, HR_U8 = 6, HR_NDTYPES = 7
};

/* Reduction operators. AVG = SUM, then division by the world size (float types only). */
enum hr_redop { HR_SUM = 0, HR_PROD = 1, HR_MIN = 2, HR_MAX = 3, HR_AVG = 4, HR_NOPS = 5 };

/* Collective kinds, carried in the header. */
enum hr_kind {
    HR_K_ALLREDUCE = 1, HR_K_ALLGATHER = 2, HR_K_REDUCE_SCATTER = 3, HR_K_BROADCAST = 4,
    HR_K_ALLTOALL = 5, HR_K_BARRIER = 6
};

/* Per-collective header: sent once per (collective, peer, direction) before data. */
typedef struct hr_hdr {
    uint8_t magic;      /* 0xA7 */
    uint8_t kind;       /* enum hr_kind */
    uint8_t dtype;      /* enum hr_dtype */
    uint8_t redop;      /* enum hr_redop */
    uint32_t seq;       /* collective sequence number on this communicator */
    uint64_t count;     /* element count as the caller passed it */
    int32_t root;       /* broadcast root, else -1 */
    uint32_t reserved;
} hr_hdr_t;

#define HR_HDR_MAGIC 0xA7

/* Time a ring pass spent waiting on one peer, summed over the communicator's life: sends the
 * peer's link would not take (socket buffer full) and receives it had not sent yet. The straggler
 * watcher tells a slow link from a slow rank with it. A few slots: a rank's ring peers are few. */
#define HR_LINK_SLOTS 8
typedef struct hr_link {
    int peer;
    double send_wait, recv_wait;    /* seconds */
} hr_link_t;

typedef struct hr_comm {
    int rank, size;
    hr_tcp_t tcp;
    char **hosts;               /* host name of each rank, for messages */
    double timeout;             /* default deadline of one collective, seconds */
    size_t rd_threshold;        /* allreduce: bytes below which recursive doubling is used */
    size_t rh_chunk;            /* allreduce: bytes per rank below which recursive halving is used */
    size_t direct_max;          /* allreduce: bytes sent per rank up to which direct exchange is used */
    size_t bcast_tree_max;      /* broadcast: bytes below which the binomial tree is used */
    size_t twolevel_min;        /* several hosts: bytes from which the two-level allreduce runs */
    size_t cma_min;             /* one node: alltoall block bytes from which alltoall_cma.c runs */
    size_t cma_gather_min;      /* one node: bytes from which broadcast_cma.c runs (0: never) */
    size_t cma_allgather_min;   /* one node: bytes per peer from which allgather_cma.c runs (0: never) */
    uint32_t seq;               /* number of collectives started */
    int streams;                /* connections per peer the ring passes stripe over (<= tcp.nconn) */
    int threads;                /* I/O threads per ring pass (1 = the caller only) */
    size_t stripe_min;          /* bytes of a chunk per stream before another stream is used */
    int failed;                 /* sticky error flag (read by all I/O threads, set under errlock) */
    pthread_mutex_t errlock;    /* the first failing thread wins c->err */
    char err[HR_ERRLEN];        /* first error */
    unsigned char *stage;       /* receive staging buffer for reductions */
    size_t stage_cap;
    unsigned char *tmp;         /* scratch (recursive doubling, in-place alltoall) */
    size_t tmp_cap;
    hr_shm_t shm;               /* ranks of this node, when attached (shm.base != NULL) */
    hr_link_t links[HR_LINK_SLOTS]; /* waits per ring peer (hr_link_add); nlinks used */
    int nlinks;
} hr_comm_t;

/* One collective in flight. */
typedef struct hr_op {
    hr_comm_t *c;
    const char *name;           /* "allreduce", ... */
    hr_hdr_t hdr;               /* what this rank sends */
    double deadline;            /* absolute, hr_now() clock */
    double timeout;
    size_t tx_done, tx_total;   /* payload bytes over the whole collective, for messages */
    size_t rx_done, rx_total;
    unsigned shm_signals;       /* shared-memory phases signalled by this collective */
    uint32_t shm_start;         /* phase of its first signal */
} hr_op_t;

/* ---- comm.c ---- */
size_t hr_dtype_size(int dtype);             /* bytes per element; 0 for an unknown code */
const char *hr_dtype_name(int dtype);        /* "float32", ...; "?" for an unknown code */
const char *hr_redop_name(int op);           /* "sum", ...; "?" for an unknown code */
const char *hr_kind_name(int kind);

/* Start a collective: checks the sticky error and argument ranges, fills op. */
int hr_op_begin(hr_op_t *op, hr_comm_t *c, int kind, int dtype, int redop, uint64_t count,
                int root, double timeout);
/* Record the first error of the communicator (printf-style), abort all connections. */
int hr_op_fail(hr_op_t *op, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same without an op (a connection the Python side could not open, module.c abort). */
int hr_comm_fail(hr_comm_t *c, const char *msg);
/* Record a transport failure with peer, host and progress in the message. is_recv selects
 * "recv from" / "send to"; why is e.g. "timed out after 30.0 s" or "failed: recv(): ...". */
int hr_op_fail_peer(hr_op_t *op, int is_recv, int peer, const char *why);
/* Same for one stream of a striped pass: the message names the stream and its bytes done. */
int hr_op_fail_stream(hr_op_t *op, int is_recv, int peer, int stream, int nstreams, size_t done,
                      size_t total, const char *why);
/* Validate a received header against op->hdr; on mismatch records the error. */
int hr_op_check_hdr(hr_op_t *op, const hr_hdr_t *got, int peer);
/* Add a ring pass's waits on peer to its slot (a new slot for a new peer; once all are taken
 * the last is reused). Called by the pass's own thread after its I/O threads have joined. */
void hr_link_add(hr_comm_t *c, int peer, double send_wait, double recv_wait);
/* Grow the staging / scratch buffers. */
int hr_comm_stage(hr_op_t *op, size_t bytes);
int hr_comm_tmp(hr_op_t *op, size_t bytes);

/* An iovec covering bytes [done, total) of hlen header bytes at h followed by the data at d.
 * Returns the iovec count (0..2). */
int hr_window(struct iovec *iov, void *h, size_t hlen, void *d, size_t done, size_t total);

/* Exchange: send shdr(optional)+sbuf to speer while receiving rhdr(optional)+rbuf from rpeer,
 * until both complete or the deadline passes. speer/rpeer may be -1 (no send / no receive).
 * Header validation is done here when rhdr is given. */
int hr_sendrecv(hr_op_t *op, int speer, const void *sbuf, size_t slen, int send_hdr,
                int rpeer, void *rbuf, size_t rlen, int recv_hdr);

/* Chunking: element offsets and counts of n near-equal chunks of count elements
 * (the first count % n chunks get one element more). */
void hr_chunks(uint64_t count, int n, size_t *off, size_t *cnt);

/* Pipelined ring pass (ring_pass.c), used by ring allreduce, reduce-scatter and allgather. */
/* src (reduce mode; NULL = base) holds this rank's input: the step-0 chunk is sent from it and
 * reductions write base = src OP received, so an out-of-place allreduce needs no copy. */
int hr_ring_pass(hr_op_t *op, unsigned char *base, const unsigned char *src, const size_t *off,
                 const size_t *cnt, int first, int reduce, int dtype, int redop, int send_hdr);

/* The same over the sub-ring members[0..nm-1] (global ranks), this rank being members[pos]. */
int hr_ring_pass_in(hr_op_t *op, const int *members, int nm, int pos, unsigned char *base,
                    const unsigned char *src, const size_t *off, const size_t *cnt, int first,
                    int reduce, int dtype, int redop, int send_hdr);

/* ---- reduce.c ---- */
/* dst[i] = dst[i] OP src[i] for i < n. AVG reduces like SUM. */
void hr_reduce(void *dst, const void *src, size_t n, int dtype, int redop);
/* dst[i] = a[i] OP b[i]; dst may be a (then it is hr_reduce) but must not otherwise overlap. */
void hr_reduce3(void *dst, const void *a, const void *b, size_t n, int dtype, int redop);
/* buf[i] /= divisor (float types). */
void hr_divide(void *buf, size_t n, int dtype, int divisor);

/* ---- comm.c: the node's shared memory (transport_shm.c reports status, these word the errors) ---- */
/* Bump this rank's phase (publishing op->hdr on the collective's first signal) and wake waiters. */
void hr_op_shm_signal(hr_op_t *op);
/* Wait until every local peer reached this rank's phase. Returns HR_OK, or HR_ERR with the
 * error recorded: a deadline, a dead or failed peer, a peer out of step (what: the step, for the
 * message). */
int hr_op_shm_wait(hr_op_t *op, const char *what);
/* After the first wait: check the local peers' collective headers against op->hdr. Returns
 * HR_OK, or HR_ERR with the mismatch recorded. */
int hr_op_shm_check_peers(hr_op_t *op);
/* Publish buf as this rank's buffer of the collective in progress (before its first signal). */
void hr_op_cma_publish(hr_op_t *op, const void *buf);
/* Read n bytes at byte offset off of local peer l's published buffer into dst. Returns HR_OK, or
 * HR_ERR with the error recorded (naming the peer; ESRCH: it died). */
int hr_op_cma_read(hr_op_t *op, int l, void *dst, size_t off, size_t n);
/* 1 when the collective should read its peers directly: the node agreed, and each read is at
 * least cut bytes (c->cma_min, c->cma_gather_min or c->cma_allgather_min; a cut of 0 never). */
static inline int hr_use_cma(const hr_comm_t *c, size_t bytes, size_t cut) {
    return c->shm.cma && cut && bytes >= cut;
}
/* Attach the comm to an already created/opened segment: lranks[lsize] are the global ranks of
 * this node (this rank among them), col[ncol] the ranks with the same local index on every node
 * (ncol = 1: one node; NULL: nodes differ in rank count, no two-level allreduce). */
int hr_comm_shm_attach(hr_comm_t *c, unsigned char *base, size_t slot, const int *lranks,
                       int lsize, const int *col, int ncol, char *err, size_t errlen);

/* ---- algorithms ---- */
/* Shared-memory allreduce on one node, or two-level (intra-node reduce, inter-node ring of the
 * ranks with the same local index, intra-node copy out) across nodes. Keeps elements [lo, hi)
 * of the result in rbuf[0 ..] (allreduce: 0, count; reduce-scatter: this rank's chunk). */
int hr_allreduce_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype,
                     int redop, size_t lo, size_t hi);
/* Reduce-scatter on one node: rank's elements [lo, hi) into rbuf, one barrier per piece. */
int hr_reduce_scatter_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype,
                          int redop, size_t lo, size_t hi);
int hr_allgather_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype);
int hr_broadcast_shm(hr_op_t *op, void *buf, size_t count, int dtype, int root);
int hr_alltoall_shm(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype);
int hr_barrier_shm(hr_op_t *op);
/* The same through cross-memory attach (two barriers, one copy; hr_use_cma says when). */
int hr_allgather_cma(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype);
int hr_broadcast_cma(hr_op_t *op, void *buf, size_t count, int dtype, int root);
int hr_alltoall_cma(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype);
int hr_allreduce(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype, int redop,
                 double timeout);
int hr_allreduce_ring(hr_op_t *op, const void *sbuf, void *buf, size_t count, int dtype, int redop);
int hr_allreduce_rd(hr_op_t *op, void *buf, size_t count, int dtype, int redop);
/* allreduce_direct.c: every rank sends its input to every other and reduces in rank order (at
 * most HR_DIRECT_MAX_RANKS ranks; sbuf == rbuf means in place). HR_OK or HR_ERR. */
int hr_allreduce_direct(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype, int redop);
/* One stream of a direct exchange (direct.c): the payload sent to peer after the header, and
 * the payload received from it; the rest is the exchange's own progress. */
typedef struct hr_xfer {
    int peer;
    const void *s;
    size_t sn;
    void *r;
    size_t rn;
    size_t sd, rd;              /* bytes sent / received so far, headers included */
    int hdr_ok;
    hr_hdr_t rh;
} hr_xfer_t;
/* Every stream of xs at once, until all are done (np <= HR_DIRECT_MAX_RANKS - 1 peers, all
 * connected). HR_OK, or HR_ERR with the error recorded. */
int hr_direct_exchange(hr_op_t *op, hr_xfer_t *xs, int np);
/* The direct algorithms of the other collectives (direct_others.c), on at most
 * HR_DIRECT_MAX_RANKS ranks; hr_use_direct says when. */
int hr_use_direct(const hr_comm_t *c, size_t sent);
int hr_allgather_direct(hr_op_t *op, void *rbuf, size_t count, int dtype);
int hr_reduce_scatter_direct(hr_op_t *op, const void *sbuf, void *rbuf, const size_t *off,
                             const size_t *cnt, int dtype, int redop);
int hr_alltoall_direct(hr_op_t *op, const void *sbuf, void *rbuf, size_t count, int dtype);
int hr_barrier_direct(hr_op_t *op);
/* allreduce_rd.c, shared with allreduce_rh.c: for n not a power of two p, the first 2(n-p) ranks
 * pair up; the even one sends its buffer (with the header) to the odd one, which reduces it.
 * Sets *v to this rank's virtual rank among the p that go on (-1: it sits out until hr_unfold,
 * which sends the odd rank's result back). c->tmp must hold count elements. HR_OK or HR_ERR. */
int hr_fold(hr_op_t *op, void *buf, size_t count, int dtype, int redop, int *v);
int hr_unfold(hr_op_t *op, void *buf, size_t bytes);
int hr_allreduce_rh(hr_op_t *op, void *buf, size_t count, int dtype, int redop);
int hr_allgather_ring(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype,
                      double timeout);
int hr_reduce_scatter_ring(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype,
                           int redop, double timeout);
int hr_broadcast(hr_comm_t *c, void *buf, size_t count, int dtype, int root, double timeout);
int hr_broadcast_tree(hr_op_t *op, void *buf, size_t count, int dtype, int root);
int hr_broadcast_pipeline(hr_comm_t *c, void *buf, size_t count, int dtype, int root,
                          double timeout);
int hr_alltoall(hr_comm_t *c, const void *sbuf, void *rbuf, size_t count, int dtype,
                double timeout, int d0, int d1);
int hr_barrier(hr_comm_t *c, double timeout);

/* Create a communicator over already-connected sockets (see transport_tcp.h for fds). hosts is
 * copied. timeout (the default deadline of its collectives, s) must be finite and > 0. Returns
 * HR_OK, or HR_ERR with a message in err; on failure the fds are not owned. */
int hr_comm_init(hr_comm_t *c, int rank, int size, const int *fds, int nconn, int sockbuf,
                 const char *const *hosts, double timeout, char *err, size_t errlen);
/* Close the sockets and free everything; idempotent. */
void hr_comm_destroy(hr_comm_t *c);

#endif
