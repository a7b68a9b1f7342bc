/* comm.c -- communicator state, sticky errors, headers and the generic send/receive exchange.
 *
 * hr_sendrecv is the building block of the latency-bound algorithms (recursive doubling,
 * alltoall, barrier): it drives one outgoing and one incoming stream at the same time with
 * non-blocking sockets, so two ranks that exchange with each other never deadlock on full
 * socket buffers, and it sleeps only in hr_tcp_wait with the collective's deadline.
 */
#define _GNU_SOURCE
#include "hr_internal.h"

#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

size_t hr_dtype_size(int dtype) {
    static const size_t sz[HR_NDTYPES] = {2, 2, 4, 8, 4, 8, 1};
    return (dtype >= 0 && dtype < HR_NDTYPES) ? sz[dtype] : 0;
}

const char *hr_dtype_name(int dtype) {
    static const char *nm[HR_NDTYPES] = {"float16", "bfloat16", "float32", "float64",
                                         "int32",   "int64",    "uint8"};
    return (dtype >= 0 && dtype < HR_NDTYPES) ? nm[dtype] : "?";
}

const char *hr_redop_name(int op) {
    static const char *nm[HR_NOPS] = {"sum", "prod", "min", "max", "avg"};
    return (op >= 0 && op < HR_NOPS) ? nm[op] : "?";
}

const char *hr_kind_name(int kind) {
    switch (kind) {
    case HR_K_ALLREDUCE: return "allreduce";
    case HR_K_ALLGATHER: return "allgather";
    case HR_K_REDUCE_SCATTER: return "reduce_scatter";
    case HR_K_BROADCAST: return "broadcast";
    case HR_K_ALLTOALL: return "alltoall";
    case HR_K_BARRIER: return "barrier";
    default: return "?";
    }
}

int hr_op_begin(hr_op_t *op, hr_comm_t *c, int kind, int dtype, int redop, uint64_t count,
                int root, double timeout) {
    memset(op, 0, sizeof(*op));
    op->c = c;
    op->name = hr_kind_name(kind);
    op->timeout = timeout > 0 ? timeout : c->timeout;
    op->deadline = hr_now() + op->timeout;
    op->hdr.magic = HR_HDR_MAGIC;
    op->hdr.kind = (uint8_t)kind;
    op->hdr.dtype = (uint8_t)dtype;
    op->hdr.redop = (uint8_t)redop;
    op->hdr.seq = ++c->seq;
    op->hdr.count = count;
    op->hdr.root = root;
    if (c->failed) return HR_ERR; /* c->err already holds the first failure */
    if (hr_dtype_size(dtype) == 0) {
        /* Argument errors are not sticky: nothing was sent. */
        c->seq--;
        return HR_ERR;
    }
    return HR_OK;
}

int hr_op_fail(hr_op_t *op, const char *fmt, ...) {
    char msg[HR_ERRLEN];
    va_list ap;
    int n;
    if (op->c->failed) return HR_ERR;
    n = snprintf(msg, sizeof(msg), "%s#%u ", op->name, (unsigned)op->hdr.seq);
    va_start(ap, fmt);
    vsnprintf(msg + n, sizeof(msg) - (size_t)n, fmt, ap);
    va_end(ap);
    return hr_comm_fail(op->c, msg);
}

void hr_link_add(hr_comm_t *c, int peer, double send_wait, double recv_wait) {
    int i;
    for (i = 0; i < c->nlinks && c->links[i].peer != peer; i++)
        ;
    if (i == c->nlinks) {
        if (c->nlinks < HR_LINK_SLOTS) c->nlinks++;
        else i = HR_LINK_SLOTS - 1;
        if (c->links[i].peer != peer) {
            c->links[i].peer = peer;
            c->links[i].send_wait = c->links[i].recv_wait = 0.0;
        }
    }
    c->links[i].send_wait += send_wait;
    c->links[i].recv_wait += recv_wait;
}

int hr_comm_fail(hr_comm_t *c, const char *msg) {
    pthread_mutex_lock(&c->errlock);
    if (c->failed) {
        pthread_mutex_unlock(&c->errlock);
        return HR_ERR;
    }
    snprintf(c->err, sizeof(c->err), "%s", msg);
    __atomic_store_n(&c->failed, 1, __ATOMIC_RELEASE);
    if (c->shm.base) hr_shm_set_failed(&c->shm);
    pthread_mutex_unlock(&c->errlock);
    hr_tcp_abort(&c->tcp); /* wakes the other I/O threads and the peers */
    return HR_ERR;
}

int hr_op_fail_stream(hr_op_t *op, int is_recv, int peer, int stream, int nstreams, size_t done,
                      size_t total, const char *why) {
    const char *host = (peer >= 0 && op->c->hosts && op->c->hosts[peer]) ? op->c->hosts[peer] : "?";
    return hr_op_fail(op, "%s rank %d (%s) on stream %d of %d %s, %zu/%zu bytes done on that stream",
                      is_recv ? "recv from" : "send to", peer, host, stream, nstreams, why, done,
                      total);
}

int hr_op_fail_peer(hr_op_t *op, int is_recv, int peer, const char *why) {
    const char *host = (peer >= 0 && op->c->hosts && op->c->hosts[peer]) ? op->c->hosts[peer] : "?";
    if (is_recv)
        return hr_op_fail(op, "recv from rank %d (%s) %s, %zu/%zu bytes done", peer, host, why,
                          op->rx_done, op->rx_total);
    return hr_op_fail(op, "send to rank %d (%s) %s, %zu/%zu bytes done", peer, host, why,
                      op->tx_done, op->tx_total);
}

int hr_op_check_hdr(hr_op_t *op, const hr_hdr_t *g, int peer) {
    const hr_hdr_t *m = &op->hdr;
    const char *host = (op->c->hosts && op->c->hosts[peer]) ? op->c->hosts[peer] : "?";
    if (g->magic != HR_HDR_MAGIC)
        return hr_op_fail(op, "recv from rank %d (%s): garbage on the connection (bad header "
                          "magic 0x%02x); the streams are out of step", peer, host, g->magic);
    if (g->kind != m->kind || g->dtype != m->dtype || g->count != m->count ||
        g->seq != m->seq || g->root != m->root ||
        (m->kind != HR_K_ALLGATHER && m->kind != HR_K_BROADCAST && m->kind != HR_K_ALLTOALL &&
         m->kind != HR_K_BARRIER && g->redop != m->redop)) {
        return hr_op_fail(op,
                          "mismatched collective: rank %d (%s) called %s#%u(count=%llu, dtype=%s, "
                          "op=%s, root=%d) but this rank (%d) called %s#%u(count=%llu, dtype=%s, "
                          "op=%s, root=%d)",
                          peer, host, hr_kind_name(g->kind), (unsigned)g->seq,
                          (unsigned long long)g->count, hr_dtype_name(g->dtype),
                          hr_redop_name(g->redop), (int)g->root, op->c->rank, op->name,
                          (unsigned)m->seq, (unsigned long long)m->count, hr_dtype_name(m->dtype),
                          hr_redop_name(m->redop), (int)m->root);
    }
    return HR_OK;
}

/* ---- the node's shared memory: transport_shm.c reports status, the messages are worded here ---- */
_Static_assert(sizeof(hr_hdr_t) == sizeof(((hr_shm_cell_t *)0)->hdr), "a shm cell holds one header");
_Static_assert(sizeof(hr_shm_cell_t) == 64, "a shm cell is one cache line");

void hr_op_shm_signal(hr_op_t *op) {
    int first = op->shm_signals++ == 0;
    uint32_t phase = hr_shm_signal(&op->c->shm, first ? &op->hdr : NULL);
    if (first) op->shm_start = phase;
}

int hr_op_shm_wait(hr_op_t *op, const char *what) {
    hr_comm_t *c = op->c;
    hr_shm_why_t w;
    char why[192];

    if (hr_shm_wait(&c->shm, &c->tcp, op->deadline, &c->failed, &w) == 0) return HR_OK;
    /* the "recv from rank ..., x/y bytes done" form (hr_op_fail_peer) is the one the hang report
     * (diagnostics/report.py) parses */
    switch (w.kind) {
    case HR_SHM_TIMEOUT:
        snprintf(why, sizeof(why), "(shared memory, %s) timed out after %.1f s", what, op->timeout);
        break;
    case HR_SHM_PEER_DIED:
        snprintf(why, sizeof(why), "failed: connection closed by peer (EOF) without an error "
                 "report: it died during the shared-memory %s (same node)", what);
        break;
    case HR_SHM_PEER_FAILED:
        snprintf(why, sizeof(why), "failed: it reported an error during the shared-memory %s "
                 "(same node; see its message)", what);
        break;
    case HR_SHM_OUT_OF_STEP:
        return hr_op_fail(op, "rank %d (%s, same node) sent TCP data while this rank waits in "
                          "shared memory (%s); the ranks are out of step (mismatched "
                          "collectives)", w.peer, c->hosts[w.peer], what);
    default:                    /* HR_SHM_ABORTED: the communicator's error is recorded already */
        return HR_ERR;
    }
    return hr_op_fail_peer(op, 1, w.peer, why);
}

int hr_op_shm_check_peers(hr_op_t *op) {
    hr_shm_t *s = &op->c->shm;
    hr_hdr_t h;
    int l;
    for (l = 0; l < s->lsize; l++)
        if (l != s->lrank && hr_shm_peer_hdr(s, l, op->shm_start, &h) &&
            hr_op_check_hdr(op, &h, s->lranks[l]) != HR_OK)
            return HR_ERR;
    return HR_OK;
}

void hr_op_cma_publish(hr_op_t *op, const void *buf) {
    __atomic_store_n(&hr_shm_cell(&op->c->shm, op->c->shm.lrank)->cma_addr, (uint64_t)(uintptr_t)buf,
                     __ATOMIC_RELEASE);
}

int hr_op_cma_read(hr_op_t *op, int l, void *dst, size_t off, size_t n) {
    hr_shm_t *s = &op->c->shm;
    uint64_t at = __atomic_load_n(&hr_shm_cell(s, l)->cma_addr, __ATOMIC_ACQUIRE);
    int peer = s->lranks[l], fd, e;
    char why[160];
    if (!n || hr_shm_cma_read(s, l, dst, at + off, n) == 0) return HR_OK;
    if ((e = errno) == ESRCH) {
        /* An exiting process drops its memory before its sockets: wait (briefly) for the EOF the
         * other ranks will see, so that they name the dead rank and not this one's failure. */
        if ((fd = hr_tcp_fd(&op->c->tcp, peer)) >= 0) {
            struct pollfd p = {fd, POLLRDHUP, 0};
            double left = op->deadline - hr_now();
            poll(&p, 1, left < 0 ? 0 : left > 2.0 ? 2000 : (int)(left * 1000));
        }
        snprintf(why, sizeof(why), "failed: its memory is gone (process_vm_readv: %s): it died "
                 "during the shared-memory %s (same node)", strerror(e), op->name);
        return hr_op_fail_peer(op, 1, peer, why);
    }
    snprintf(why, sizeof(why), "failed: reading its buffer with process_vm_readv: %s (same node)",
             strerror(e));
    return hr_op_fail_peer(op, 1, peer, why);
}

static int grow(hr_op_t *op, unsigned char **p, size_t *cap, size_t bytes) {
    unsigned char *q;
    if (*cap >= bytes) return HR_OK;
    q = realloc(*p, bytes);
    if (!q) return hr_op_fail(op, "malloc(%zu): out of memory", bytes);
    *p = q;
    *cap = bytes;
    return HR_OK;
}

int hr_comm_stage(hr_op_t *op, size_t bytes) {
    return grow(op, &op->c->stage, &op->c->stage_cap, bytes);
}

int hr_comm_tmp(hr_op_t *op, size_t bytes) {
    return grow(op, &op->c->tmp, &op->c->tmp_cap, bytes);
}

void hr_chunks(uint64_t count, int n, size_t *off, size_t *cnt) {
    size_t base = (size_t)(count / (uint64_t)n), extra = (size_t)(count % (uint64_t)n), o = 0;
    int i;
    for (i = 0; i < n; i++) {
        cnt[i] = base + ((size_t)i < extra ? 1 : 0);
        off[i] = o;
        o += cnt[i];
    }
}

int hr_window(struct iovec *iov, void *h, size_t hlen, void *d, size_t done, size_t total) {
    int k = 0;
    if (done < hlen) {
        iov[k].iov_base = (char *)h + done;
        iov[k].iov_len = hlen - done;
        k++;
        done = hlen;
    }
    if (done < total) {
        iov[k].iov_base = (char *)d + (done - hlen);
        iov[k].iov_len = total - done;
        k++;
    }
    return k;
}

int hr_sendrecv(hr_op_t *op, int speer, const void *sbuf, size_t slen, int send_hdr,
                int rpeer, void *rbuf, size_t rlen, int recv_hdr) {
    hr_comm_t *c = op->c;
    hr_hdr_t rh;
    size_t shl = send_hdr ? sizeof(hr_hdr_t) : 0, rhl = recv_hdr ? sizeof(hr_hdr_t) : 0;
    size_t stot = speer >= 0 ? shl + slen : 0, rtot = rpeer >= 0 ? rhl + rlen : 0;
    size_t sd = 0, rd = 0;
    int hdr_checked = !recv_hdr;
    char why[256];

    while (sd < stot || rd < rtot) {
        int progressed = 0, ready;
        struct iovec iov[2];
        ssize_t r;
        if (sd < stot) {
            r = hr_tcp_sendv(&c->tcp, speer, iov,
                             hr_window(iov, &op->hdr, shl, (void *)sbuf, sd, stot), why, sizeof(why));
            if (r < 0) return hr_op_fail_peer(op, 0, speer, why);
            if (r > 0) {
                size_t pay = (sd + (size_t)r > shl ? sd + (size_t)r - shl : 0) -
                             (sd > shl ? sd - shl : 0);
                op->tx_done += pay;
                sd += (size_t)r;
                progressed = 1;
            }
        }
        if (rd < rtot) {
            r = hr_tcp_recvv(&c->tcp, rpeer, iov, hr_window(iov, &rh, rhl, rbuf, rd, rtot), why,
                             sizeof(why));
            if (r < 0) return hr_op_fail_peer(op, 1, rpeer, why);
            if (r > 0) {
                size_t pay = (rd + (size_t)r > rhl ? rd + (size_t)r - rhl : 0) -
                             (rd > rhl ? rd - rhl : 0);
                op->rx_done += pay;
                rd += (size_t)r;
                progressed = 1;
                if (!hdr_checked && rd >= rhl) {
                    if (hr_op_check_hdr(op, &rh, rpeer) != HR_OK) return HR_ERR;
                    hdr_checked = 1;
                }
            }
        }
        if (progressed) continue;
        ready = hr_tcp_wait(&c->tcp, sd < stot ? speer : -1, rd < rtot ? rpeer : -1,
                            op->deadline, why, sizeof(why));
        if (ready < 0) return hr_op_fail(op, "%s", why);
        if (ready == 0) {
            snprintf(why, sizeof(why), "timed out after %.1f s", op->timeout);
            return rd < rtot ? hr_op_fail_peer(op, 1, rpeer, why)
                             : hr_op_fail_peer(op, 0, speer, why);
        }
    }
    return HR_OK;
}

int hr_comm_init(hr_comm_t *c, int rank, int size, const int *fds, int nconn, int sockbuf,
                 const char *const *hosts, double timeout, char *err, size_t errlen) {
    int i;
    memset(c, 0, sizeof(*c));
    if (size < 1 || rank < 0 || rank >= size || nconn < 1) {
        snprintf(err, errlen, "bad rank %d / size %d / nconn %d", rank, size, nconn);
        return HR_ERR;
    }
    /* the deadline is resolved by the caller (hpcring.config.envvars); no default of our own */
    if (!(timeout > 0) || !isfinite(timeout)) {
        snprintf(err, errlen, "bad timeout %g: give the collective deadline in seconds, finite and > 0",
                 timeout);
        return HR_ERR;
    }
    c->rank = rank;
    c->size = size;
    c->timeout = timeout;
    c->rd_threshold = HR_RD_THRESHOLD_DEFAULT;
    c->rh_chunk = HR_RH_CHUNK_DEFAULT;
    c->direct_max = HR_DIRECT_MAX_DEFAULT;
    c->bcast_tree_max = HR_BCAST_TREE_MAX_DEFAULT;
    c->cma_min = HR_CMA_MIN_DEFAULT;
    c->cma_gather_min = HR_CMA_GATHER_MIN_DEFAULT;
    c->cma_allgather_min = 0;        /* ring_shm.py sets the measured default */
    c->twolevel_min = HR_TWOLEVEL_MIN_DEFAULT;
    c->streams = nconn;
    c->threads = 1;
    c->stripe_min = HR_STRIPE_MIN_DEFAULT;
    pthread_mutex_init(&c->errlock, NULL);
    if (!(c->hosts = calloc((size_t)size, sizeof(char *)))) goto oom;
    for (i = 0; i < size; i++)
        if (!(c->hosts[i] = strdup(hosts && hosts[i] ? hosts[i] : "?"))) goto oom;
    if (hr_tcp_init(&c->tcp, rank, size, fds, nconn, sockbuf, err, errlen) != 0) goto fail;
    return HR_OK;
oom:
    snprintf(err, errlen, "malloc(): out of memory");
fail:
    if (c->hosts)
        for (i = 0; i < size; i++) free(c->hosts[i]);
    free(c->hosts);
    c->hosts = NULL;
    return HR_ERR;
}

int hr_comm_shm_attach(hr_comm_t *c, unsigned char *base, size_t slot, const int *lranks,
                       int lsize, const int *col, int ncol, char *err, size_t errlen) {
    hr_shm_t *s = &c->shm;
    int i, oversub;
    memset(s, 0, sizeof(*s));
    s->lrank = -1;
    for (i = 0; i < lsize; i++)
        if (lranks[i] == c->rank) s->lrank = i;
    if (lsize < 2 || s->lrank < 0 || (col && ncol < 1)) {
        snprintf(err, errlen, "bad node layout (%d local ranks, this rank %s among them)", lsize,
                 s->lrank < 0 ? "not" : "");
        return HR_ERR;
    }
    if (!(s->lranks = malloc(sizeof(int) * (size_t)lsize)) ||
        (col && !(s->col = malloc(sizeof(int) * (size_t)ncol)))) {
        free(s->lranks);
        snprintf(err, errlen, "malloc(): out of memory");
        return HR_ERR;
    }
    memcpy(s->lranks, lranks, sizeof(int) * (size_t)lsize);
    s->ncol = col ? ncol : 0;
    s->colpos = -1;
    for (i = 0; col && i < ncol; i++) {
        s->col[i] = col[i];
        if (col[i] == c->rank) s->colpos = i;
    }
    s->lsize = lsize;
    s->slot = slot;
    s->len = hr_shm_bytes(lsize, slot);
    s->base = base;
    oversub = lsize > sysconf(_SC_NPROCESSORS_ONLN);
    s->spin = oversub ? HR_SHM_YIELDS_OVERSUB : HR_SHM_YIELDS;
    s->busy = oversub ? 0 : HR_SHM_BUSY_US;
    hr_shm_cell(s, s->lrank)->pid = (int32_t)getpid();
    hr_shm_cma_publish(s);
    return HR_OK;
}

void hr_comm_destroy(hr_comm_t *c) {
    int i;
    if (c->shm.base) munmap(c->shm.base, c->shm.len);
    free(c->shm.lranks);
    free(c->shm.col);
    memset(&c->shm, 0, sizeof(c->shm));
    hr_tcp_close(&c->tcp);
    if (c->hosts)
        for (i = 0; i < c->size; i++) free(c->hosts[i]);
    free(c->hosts);
    c->hosts = NULL;
    free(c->stage);
    free(c->tmp);
    c->stage = c->tmp = NULL;
    c->stage_cap = c->tmp_cap = 0;
}
