/* module.c -- CPython binding: hpcring._native.
 *
 *   Comm(rank, size, fds, hosts, timeout, sockbuf=0)
 *     fds: sequence of `size` entries, each None (self, or a peer not connected), an int fd, or a
 *     sequence of int fds (several connections per peer; all entries the same length, -1 for
 *     a connection not opened). On success the Comm owns and
 *     eventually closes the descriptors; if the constructor raises, the caller still owns them.
 *   Comm.allreduce(sendbuf, recvbuf, dtype, op, timeout=0.0)
 *   Comm.allgather(sendbuf, recvbuf, dtype, timeout=0.0)
 *   Comm.reduce_scatter(sendbuf, recvbuf, dtype, op, timeout=0.0)
 *   Comm.broadcast(buf, dtype, root, timeout=0.0)
 *   Comm.alltoall(sendbuf, recvbuf, dtype, timeout=0.0, first=1, last=size/2+1): distances
 *     [first, last) only (alltoall.c; a window of one collective when first > 1)
 *   Comm.set_peer(peer, fds), drop_peer(peer), peers(), descriptors: connections on demand;
 *   Comm.abort(message): that message becomes the sticky error, every connection is shut
 *   Comm.allreduce_rec(flight, sendbuf, recvbuf, dtype, op, timeout): allreduce recorded in a
 *     Flight (module_flight.c: the flight recorder's ring of records, filled in C); numpy and
 *     CPU torch tensors (their numpy views)
 *   Comm.short_setup(...), Comm.short(kind, x, out, op, root, timeout): the Communicator's
 *     common numpy call checked, recorded and run in one call (fastpath.py's fast path)
 *   Comm.barrier(timeout=0.0)
 *   Comm.close(); attributes rank, size, seq, failed, error, timeout; settable cut-overs
 *   rd_threshold, rh_chunk, direct_max, bcast_tree_max, twolevel_min (allreduce.c, broadcast.c),
 *   streams (<= connections per peer), threads, stripe_min (see ring_pass.c)
 *   Comm.shm_attach(name, create, local_ranks, column, slot); shm_unlink(name): shared memory
 *   between the ranks of a node (transport_shm.h; setup and unlinking in collectives/ring.py);
 *   Comm.shm_cma_probe(), shm_cma, cma_min, cma_gather_min, cma_allgather_min: reading peers'
 *   memory directly (*_cma.c)
 *   reduce(dst, src, dtype, op)   local kernel dst = dst OP src (tests, fused host-side use)
 *   DTYPES {name: (code, itemsize)}, OPS {name: code}: the enums below, by name
 *   P2P, P2PReq: point-to-point (p2p_module.c)
 *
 * Buffers are any C-contiguous buffer-protocol objects (numpy arrays, memoryviews); lengths are
 * in bytes and checked against the dtype. dtype / op are the integers of enum hr_dtype /
 * hr_redop. timeout <= 0 means the communicator's default. Communication runs with the GIL
 * released; one call at a time per Comm (a second concurrent call raises). Failures raise
 * hpcring._native.NativeError carrying the communicator's sticky message; argument problems
 * raise ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#include "hr_internal.h"
#include "module_flight.h"

int hr_p2p_module_add(PyObject *m);   /* p2p_module.c: P2P, P2PReq */

#include <stddef.h>

#include <sys/mman.h>

static PyObject *NativeError;
static PyObject *dtype_strs[HR_NDTYPES];   /* record fields, made once */

/* The short call's settings (short_setup): what Comm.short needs to read a numpy array and
 * record the call without Python in between. */
typedef struct {
    PyObject *flight;           /* the recorder's Flight */
    PyObject *ndarray, *empty;  /* numpy.ndarray (exactly), numpy.empty */
    PyObject *dtypes;           /* {numpy dtype: enum hr_dtype code} */
    PyObject *ops;              /* {op name: enum hr_redop code} */
    PyObject *general;          /* the answer "take the general path" */
    int a2a_direct;             /* alltoall may run here at any time (every connection given) */
} short_t;

typedef struct {
    PyObject_HEAD
    hr_comm_t c;
    int open;
    PyThread_type_lock lock;
    short_t sh;
} CommObject;

static int check_open(CommObject *self) {
    if (!self->open) {
        PyErr_SetString(PyExc_ValueError, "communicator is closed");
        return -1;
    }
    return 0;
}

static int check_dtype_op(int dtype, int op, int need_op) {
    if (dtype < 0 || dtype >= HR_NDTYPES) {
        PyErr_Format(PyExc_ValueError, "unsupported dtype code %d", dtype);
        return -1;
    }
    if (need_op) {
        if (op < 0 || op >= HR_NOPS) {
            PyErr_Format(PyExc_ValueError, "unsupported reduction op code %d", op);
            return -1;
        }
        if (op == HR_AVG && dtype != HR_F16 && dtype != HR_BF16 && dtype != HR_F32 &&
            dtype != HR_F64) {
            PyErr_Format(PyExc_ValueError, "op avg needs a floating-point dtype, got %s",
                         hr_dtype_name(dtype));
            return -1;
        }
    }
    return 0;
}

static int check_len(const Py_buffer *b, int dtype, const char *what) {
    if (b->len % (Py_ssize_t)hr_dtype_size(dtype)) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes, not a whole number of %s elements", what,
                     b->len, hr_dtype_name(dtype));
        return -1;
    }
    return 0;
}

/* Run fn with the GIL released and the per-communicator lock held. */
#define RUN_LOCKED(self, rcvar, call)                                                            \
    do {                                                                                         \
        if (!PyThread_acquire_lock((self)->lock, NOWAIT_LOCK)) {                                 \
            PyErr_SetString(PyExc_RuntimeError,                                                  \
                            "communicator is already running a collective in another thread");  \
            goto cleanup;                                                                        \
        }                                                                                        \
        Py_BEGIN_ALLOW_THREADS rcvar = (call);                                                   \
        Py_END_ALLOW_THREADS PyThread_release_lock((self)->lock);                                \
    } while (0)

static PyObject *raise_native(CommObject *self) {
    PyErr_SetString(NativeError, self->c.err[0] ? self->c.err : "collective failed");
    return NULL;
}

static int Comm_init(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"rank", "size", "fds", "hosts", "timeout", "sockbuf", NULL};
    int rank, size, sockbuf = 0, nconn = 1, i, k, *fds = NULL, rc = -1;
    double timeout;
    PyObject *pfds, *phosts, *fseq = NULL, *hseq = NULL;
    const char **hosts = NULL;
    char err[512];

    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Comm already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiOOd|i", kwlist, &rank, &size, &pfds, &phosts,
                                     &timeout, &sockbuf))
        return -1;
    if (size < 1 || rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "rank %d out of range for size %d", rank, size);
        return -1;
    }
    if (!(fseq = PySequence_Fast(pfds, "fds must be a sequence"))) goto cleanup;
    if (!(hseq = PySequence_Fast(phosts, "hosts must be a sequence"))) goto cleanup;
    if (PySequence_Fast_GET_SIZE(fseq) != size || PySequence_Fast_GET_SIZE(hseq) != size) {
        PyErr_Format(PyExc_ValueError, "fds and hosts need %d entries", size);
        goto cleanup;
    }
    for (i = 0; i < size; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(fseq, i);
        if (e != Py_None && !PyLong_Check(e)) {
            Py_ssize_t l = PySequence_Size(e);
            if (l < 1) {
                PyErr_Format(PyExc_ValueError, "fds[%d] must be None, an int or ints", i);
                goto cleanup;
            }
            if (l > nconn) nconn = (int)l;
        }
    }
    if (!(fds = PyMem_Malloc(sizeof(int) * (size_t)size * (size_t)nconn))) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < size; i++) {
        PyObject *e = PySequence_Fast_GET_ITEM(fseq, i);
        for (k = 0; k < nconn; k++) fds[i * nconn + k] = -1;
        if (e == Py_None) continue;
        if (PyLong_Check(e)) {
            if (nconn != 1) {
                PyErr_Format(PyExc_ValueError, "fds[%d]: give every peer %d fds", i, nconn);
                goto cleanup;
            }
            fds[i * nconn] = (int)PyLong_AsLong(e);
        } else {
            if (PySequence_Size(e) != nconn) {
                PyErr_Format(PyExc_ValueError, "fds[%d]: give every peer %d fds", i, nconn);
                goto cleanup;
            }
            for (k = 0; k < nconn; k++) {
                PyObject *x = PySequence_GetItem(e, k);
                if (!x) goto cleanup;
                fds[i * nconn + k] = (int)PyLong_AsLong(x);
                Py_DECREF(x);
            }
        }
        if (PyErr_Occurred()) goto cleanup;
    }
    if (!(hosts = PyMem_Malloc(sizeof(char *) * (size_t)size))) {
        PyErr_NoMemory();
        goto cleanup;
    }
    for (i = 0; i < size; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(hseq, i);
        if (!PyUnicode_Check(h) || !(hosts[i] = PyUnicode_AsUTF8(h))) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "hosts[%d] must be str", i);
            goto cleanup;
        }
    }
    if (hr_comm_init(&self->c, rank, size, fds, nconn, sockbuf, hosts, timeout, err,
                     sizeof(err)) != HR_OK) {
        PyErr_SetString(NativeError, err);
        goto cleanup;
    }
    self->open = 1;
    rc = 0;
cleanup:
    PyMem_Free(fds);
    PyMem_Free(hosts);
    Py_XDECREF(fseq);
    Py_XDECREF(hseq);
    return rc;
}

static PyObject *Comm_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    CommObject *self = (CommObject *)type->tp_alloc(type, 0);
    (void)args; (void)kw;
    if (!self) return NULL;
    self->open = 0;
    if (!(self->lock = PyThread_allocate_lock())) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void short_clear(short_t *sh) {
    Py_CLEAR(sh->flight);
    Py_CLEAR(sh->ndarray);
    Py_CLEAR(sh->empty);
    Py_CLEAR(sh->dtypes);
    Py_CLEAR(sh->ops);
    Py_CLEAR(sh->general);
}

static void Comm_dealloc(CommObject *self) {
    short_clear(&self->sh);
    if (self->open) hr_comm_destroy(&self->c);
    self->open = 0;
    if (self->lock) PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Comm_close(CommObject *self, PyObject *unused) {
    (void)unused;
    if (self->open) {
        if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
            PyErr_SetString(PyExc_RuntimeError, "cannot close: a collective is running");
            return NULL;
        }
        hr_comm_destroy(&self->c);
        self->open = 0;
        PyThread_release_lock(self->lock);
    }
    Py_RETURN_NONE;
}

/* One collective's arguments, checked: what run_plain and run_rec hand to the C library. */
typedef struct {
    int kind;               /* K_* below */
    void *s, *r;
    size_t count;           /* elements: the result's (allreduce), the input's (the others) */
    int dtype, op, root, d0, d1;
    double timeout;
} call_t;

enum { K_ALLREDUCE, K_ALLGATHER, K_REDUCE_SCATTER, K_BROADCAST, K_ALLTOALL, K_BARRIER, K_N };
static PyObject *kind_strs[K_N];    /* record fields, made once */
static const char *const kind_names[K_N] = {"allreduce", "allgather", "reduce_scatter",
                                             "broadcast", "alltoall", "barrier"};

static int call_run(hr_comm_t *c, const call_t *k) {
    switch (k->kind) {
    case K_ALLREDUCE: return hr_allreduce(c, k->s, k->r, k->count, k->dtype, k->op, k->timeout);
    case K_ALLGATHER: return hr_allgather_ring(c, k->s, k->r, k->count, k->dtype, k->timeout);
    case K_REDUCE_SCATTER:
        return hr_reduce_scatter_ring(c, k->s, k->r, k->count, k->dtype, k->op, k->timeout);
    case K_BROADCAST: return hr_broadcast(c, k->r, k->count, k->dtype, k->root, k->timeout);
    case K_ALLTOALL: return hr_alltoall(c, k->s, k->r, k->count, k->dtype, k->timeout, k->d0, k->d1);
    default: return hr_barrier(c, k->timeout);
    }
}

/* allreduce: a known dtype and op, equal whole-element buffers. */
static int check_allreduce(CommObject *self, const Py_buffer *s, const Py_buffer *r, call_t *k) {
    if (check_open(self) || check_dtype_op(k->dtype, k->op, 1) || check_len(r, k->dtype, "recvbuf"))
        return -1;
    if (s->len != r->len) {
        PyErr_Format(PyExc_ValueError, "sendbuf is %zd bytes but recvbuf %zd", s->len, r->len);
        return -1;
    }
    k->kind = K_ALLREDUCE;
    k->s = s->buf, k->r = r->buf;
    k->count = (size_t)r->len / hr_dtype_size(k->dtype);
    return 0;
}

/* allgather: recvbuf holds size copies of sendbuf. */
static int check_allgather(CommObject *self, const Py_buffer *s, const Py_buffer *r, call_t *k) {
    if (check_open(self) || check_dtype_op(k->dtype, 0, 0) || check_len(s, k->dtype, "sendbuf"))
        return -1;
    if (r->len != s->len * self->c.size) {
        PyErr_Format(PyExc_ValueError, "recvbuf is %zd bytes, need size * %zd = %zd", r->len,
                     s->len, s->len * self->c.size);
        return -1;
    }
    k->kind = K_ALLGATHER;
    k->s = s->buf, k->r = r->buf;
    k->count = (size_t)s->len / hr_dtype_size(k->dtype);
    return 0;
}

/* reduce_scatter: recvbuf holds this rank's share (the first count % size ranks one more). */
static int check_reduce_scatter(CommObject *self, const Py_buffer *s, const Py_buffer *r, call_t *k) {
    int n;
    size_t mine;
    if (check_open(self) || check_dtype_op(k->dtype, k->op, 1) || check_len(s, k->dtype, "sendbuf"))
        return -1;
    n = self->c.size;
    k->count = (size_t)s->len / hr_dtype_size(k->dtype);
    mine = k->count / (size_t)n + ((size_t)self->c.rank < k->count % (size_t)n ? 1 : 0);
    if ((size_t)r->len != mine * hr_dtype_size(k->dtype)) {
        PyErr_Format(PyExc_ValueError, "recvbuf is %zd bytes, rank %d's share of %zu elements is %zu",
                     r->len, self->c.rank, k->count, mine);
        return -1;
    }
    k->kind = K_REDUCE_SCATTER;
    k->s = s->buf, k->r = r->buf;
    return 0;
}

/* broadcast: in place, root in range. */
static int check_broadcast(CommObject *self, const Py_buffer *b, call_t *k) {
    if (check_open(self) || check_dtype_op(k->dtype, 0, 0) || check_len(b, k->dtype, "buf"))
        return -1;
    if (k->root < 0 || k->root >= self->c.size) {
        PyErr_Format(PyExc_ValueError, "root %d out of range for size %d", k->root, self->c.size);
        return -1;
    }
    k->kind = K_BROADCAST;
    k->s = k->r = b->buf;
    k->count = (size_t)b->len / hr_dtype_size(k->dtype);
    return 0;
}

/* alltoall: equal sizes, a count divisible by size, buffers the same or apart, a window
 * [d0, d1) of distances (d1 < 0: all of them). */
static int check_alltoall(CommObject *self, const Py_buffer *s, const Py_buffer *r, call_t *k) {
    if (k->d1 < 0) k->d1 = self->c.size / 2 + 1;
    if (k->d0 < 1 || k->d1 < k->d0) {
        PyErr_Format(PyExc_ValueError, "alltoall distances [%d, %d) out of range", k->d0, k->d1);
        return -1;
    }
    if (k->d0 > 1 && s->buf == r->buf) {
        PyErr_SetString(PyExc_ValueError, "a later alltoall window cannot run in place");
        return -1;
    }
    if (check_open(self) || check_dtype_op(k->dtype, 0, 0) || check_len(s, k->dtype, "sendbuf"))
        return -1;
    k->count = (size_t)s->len / hr_dtype_size(k->dtype);
    if (s->len != r->len || k->count % (size_t)self->c.size) {
        PyErr_Format(PyExc_ValueError, "alltoall needs equal send/recv sizes (%zd, %zd bytes) "
                     "and a count divisible by %d (got %zu)", s->len, r->len, self->c.size, k->count);
        return -1;
    }
    if (s->buf != r->buf && (char *)s->buf < (char *)r->buf + r->len &&
        (char *)r->buf < (char *)s->buf + s->len) {
        PyErr_SetString(PyExc_ValueError, "alltoall buffers overlap partially");
        return -1;
    }
    k->kind = K_ALLTOALL;
    k->s = s->buf, k->r = r->buf;
    return 0;
}

/* The plain call: run k with the GIL released; None, or NativeError with the sticky message. */
static PyObject *run_plain(CommObject *self, const call_t *k) {
    int rc = HR_ERR;
    RUN_LOCKED(self, rc, call_run(&self->c, k));
    if (rc != HR_OK) return raise_native(self);
    Py_RETURN_NONE;
cleanup:
    return NULL;
}

/* The recorded call: k recorded in flight (module_flight.c) as one "started" record before it
 * runs and "done" or "failed" after, in this one call (no Python between). Returns the record's
 * seq; a failure raises NativeError whose .seq is the record's. The lock is taken before the
 * record, so a refused call leaves none open. */
static PyObject *run_rec(CommObject *self, PyObject *flight, const call_t *k) {
    PyObject *msg, *exc, *q;
    long long seq;
    int rc;
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyErr_SetString(PyExc_RuntimeError, "communicator is already running a collective in another thread");
        return NULL;
    }
    seq = fl_begin((FlightObject *)flight, kind_strs[k->kind],
                   k->kind == K_BARRIER ? Py_None : dtype_strs[k->dtype],
                   k->kind == K_BARRIER ? 0 : (long long)k->count,
                   k->kind == K_BROADCAST ? k->root : -1, k->timeout);
    Py_BEGIN_ALLOW_THREADS
    rc = call_run(&self->c, k);
    Py_END_ALLOW_THREADS
    PyThread_release_lock(self->lock);
    if (rc == HR_OK) {
        fl_end((FlightObject *)flight, seq, NULL);
        return PyLong_FromLongLong(seq);
    }
    if (!(msg = PyUnicode_FromString(self->c.err[0] ? self->c.err : "collective failed"))) return NULL;
    fl_end((FlightObject *)flight, seq, msg);
    exc = PyObject_CallOneArg(NativeError, msg);
    Py_DECREF(msg);
    if (!exc) return NULL;
    q = PyLong_FromLongLong(seq);
    if (q && PyObject_SetAttrString(exc, "seq", q) == 0) PyErr_SetObject(NativeError, exc);
    Py_XDECREF(q);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *Comm_allreduce(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sendbuf", "recvbuf", "dtype", "op", "timeout", NULL};
    Py_buffer s = {0}, r = {0};
    call_t k = {0};
    PyObject *ret = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*w*ii|d", kwlist, &s, &r, &k.dtype, &k.op, &k.timeout))
        return NULL;
    if (!check_allreduce(self, &s, &r, &k)) ret = run_plain(self, &k);
    PyBuffer_Release(&s);
    PyBuffer_Release(&r);
    return ret;
}

/* allreduce_rec: the plain call's arguments after a Flight, positional only (hot path);
 * returns the record's seq (run_rec). */
static PyObject *Comm_allreduce_rec(CommObject *self, PyObject *args) {
    PyObject *flight, *ret = NULL;
    Py_buffer s = {0}, r = {0};
    call_t k = {0};
    if (!PyArg_ParseTuple(args, "O!y*w*iid", &FlightType, &flight, &s, &r, &k.dtype, &k.op, &k.timeout))
        return NULL;
    if (!check_allreduce(self, &s, &r, &k)) ret = run_rec(self, flight, &k);
    PyBuffer_Release(&s);
    PyBuffer_Release(&r);
    return ret;
}

static PyObject *Comm_allgather(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sendbuf", "recvbuf", "dtype", "timeout", NULL};
    Py_buffer s = {0}, r = {0};
    call_t k = {0};
    PyObject *ret = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*w*i|d", kwlist, &s, &r, &k.dtype, &k.timeout))
        return NULL;
    if (!check_allgather(self, &s, &r, &k)) ret = run_plain(self, &k);
    PyBuffer_Release(&s);
    PyBuffer_Release(&r);
    return ret;
}

static PyObject *Comm_reduce_scatter(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sendbuf", "recvbuf", "dtype", "op", "timeout", NULL};
    Py_buffer s = {0}, r = {0};
    call_t k = {0};
    PyObject *ret = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*w*ii|d", kwlist, &s, &r, &k.dtype, &k.op, &k.timeout))
        return NULL;
    if (!check_reduce_scatter(self, &s, &r, &k)) ret = run_plain(self, &k);
    PyBuffer_Release(&s);
    PyBuffer_Release(&r);
    return ret;
}

static PyObject *Comm_broadcast(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buf", "dtype", "root", "timeout", NULL};
    Py_buffer b = {0};
    call_t k = {0};
    PyObject *ret = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "w*ii|d", kwlist, &b, &k.dtype, &k.root, &k.timeout))
        return NULL;
    if (!check_broadcast(self, &b, &k)) ret = run_plain(self, &k);
    PyBuffer_Release(&b);
    return ret;
}

static PyObject *Comm_alltoall(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"sendbuf", "recvbuf", "dtype", "timeout", "first", "last", NULL};
    Py_buffer s = {0}, r = {0};
    call_t k = {0};
    PyObject *ret = NULL;
    k.d0 = 1, k.d1 = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*w*i|dii", kwlist, &s, &r, &k.dtype, &k.timeout,
                                     &k.d0, &k.d1))
        return NULL;
    if (!check_alltoall(self, &s, &r, &k)) ret = run_plain(self, &k);
    PyBuffer_Release(&s);
    PyBuffer_Release(&r);
    return ret;
}

static PyObject *Comm_barrier(CommObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    call_t k = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d", kwlist, &k.timeout)) return NULL;
    if (check_open(self)) return NULL;
    k.kind = K_BARRIER;
    return run_plain(self, &k);
}

/* short_setup(flight, ndarray, empty, dtypes, ops, general, a2a_direct): arm Comm.short. */
static PyObject *Comm_short_setup(CommObject *self, PyObject *args) {
    PyObject *fl, *nd, *em, *dt, *ops, *gen;
    int a2a;
    if (!PyArg_ParseTuple(args, "O!O!OO!O!Op", &FlightType, &fl, &PyType_Type, &nd, &em, &PyDict_Type,
                          &dt, &PyDict_Type, &ops, &gen, &a2a))
        return NULL;
    short_clear(&self->sh);
    self->sh.flight = Py_NewRef(fl);
    self->sh.ndarray = Py_NewRef(nd);
    self->sh.empty = Py_NewRef(em);
    self->sh.dtypes = Py_NewRef(dt);
    self->sh.ops = Py_NewRef(ops);
    self->sh.general = Py_NewRef(gen);
    self->sh.a2a_direct = a2a;
    Py_RETURN_NONE;
}

static PyObject *str_dtype;         /* "dtype", interned */

/* The result's shape for out=None: (n, *shape) for allgather, (shape[0] / n, *shape[1:]) for
 * reduce_scatter, shape otherwise. */
static PyObject *short_shape(const Py_buffer *b, int kind, int n) {
    int extra = kind == K_ALLGATHER, i;
    PyObject *t = PyTuple_New(b->ndim + extra), *v;
    if (!t) return NULL;
    if (extra && (!(v = PyLong_FromLong(n)) || PyTuple_SetItem(t, 0, v) < 0)) goto fail;
    for (i = 0; i < b->ndim; i++) {
        Py_ssize_t d = b->shape[i];
        if (kind == K_REDUCE_SCATTER && i == 0) d /= n;
        if (!(v = PyLong_FromSsize_t(d)) || PyTuple_SetItem(t, i + extra, v) < 0) goto fail;
    }
    return t;
fail:
    Py_DECREF(t);
    return NULL;
}

/* short(kind, x, out, op, root, timeout) -> result: the Communicator's common synchronous call
 * read, checked, recorded and run in C (kind: the K_* code; op: name or None; root: int or None;
 * timeout: the deadline already resolved). Takes exactly what fastpath.py's short path takes --
 * a C-contiguous numpy.ndarray of a mapped dtype; out None, x (alltoall, allreduce) or a
 * C-contiguous writable ndarray of x's dtype and the result's element count; an op the dtype
 * takes; a root in range -- and answers `general` (short_setup), with nothing done or recorded,
 * for anything else, a closed communicator included. Failures raise as allreduce_rec's do. */
static PyObject *Comm_short(CommObject *self, PyObject *const *args, Py_ssize_t nargs) {
    short_t *sh = &self->sh;
    PyObject *x, *out, *op, *root, *dt = NULL, *code, *res = NULL, *ret = NULL, *shape, *odt;
    Py_buffer xb = {0}, rb = {0};
    int kind, n = self->c.size, flags, eq;
    size_t count, n_out = 0;
    call_t k = {0};

    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "short(kind, x, out, op, root, timeout)");
        return NULL;
    }
    if (!sh->general) {
        PyErr_SetString(PyExc_RuntimeError, "short() before short_setup()");
        return NULL;
    }
    kind = (int)PyLong_AsLong(args[0]);
    x = args[1], out = args[2], op = args[3], root = args[4];
    k.timeout = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (kind < 0 || kind >= K_N || !self->open) return Py_NewRef(sh->general);
    k.kind = kind, k.d0 = 1, k.d1 = -1, k.root = -1;
    if (kind == K_BARRIER) {
        if (!(ret = run_rec(self, sh->flight, &k))) return NULL;
        Py_DECREF(ret);
        Py_RETURN_NONE;
    }
    if (!Py_IS_TYPE(x, (PyTypeObject *)sh->ndarray) || (out == x && kind != K_ALLTOALL && kind != K_ALLREDUCE))
        return Py_NewRef(sh->general);
    if (!(dt = PyObject_GetAttr(x, str_dtype))) return NULL;
    if (!(code = PyDict_GetItemWithError(sh->dtypes, dt))) goto general;      /* borrowed */
    k.dtype = (int)PyLong_AsLong(code);
    if (kind == K_ALLREDUCE || kind == K_REDUCE_SCATTER) {     /* the reducing kinds: a named op */
        if (!PyUnicode_CheckExact(op) || !(code = PyDict_GetItemWithError(sh->ops, op))) goto general;
        k.op = (int)PyLong_AsLong(code);
        if (check_dtype_op(k.dtype, k.op, 1)) goto general;     /* avg of integers: explained there */
    }
    flags = PyBUF_C_CONTIGUOUS | ((kind == K_BROADCAST || out == x) ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(x, &xb, flags) < 0) goto general;
    count = (size_t)xb.len / (size_t)xb.itemsize;
    switch (kind) {
    case K_ALLREDUCE: n_out = count; break;
    case K_ALLGATHER: n_out = count * (size_t)n; break;
    case K_REDUCE_SCATTER:
        if (xb.ndim < 1 || xb.shape[0] % n) goto general;       /* uneven: the general path's shape */
        n_out = count / (size_t)n;
        break;
    case K_ALLTOALL:
        if (count % (size_t)n ||
            !(sh->a2a_direct || self->c.failed || (self->c.shm.base && self->c.shm.ncol == 1)))
            goto general;               /* across hosts alltoall's windows connect peers (ring.py) */
        n_out = count;
        break;
    default:                            /* K_BROADCAST */
        if (!PyLong_CheckExact(root) || (k.root = (int)PyLong_AsLong(root)) < 0 || k.root >= n) {
            PyErr_Clear();
            goto general;
        }
    }
    if (kind == K_BROADCAST || out == x) {
        res = Py_NewRef(x);
    } else if (out == Py_None) {
        if (!(shape = short_shape(&xb, kind, n))) goto done;
        res = PyObject_CallFunctionObjArgs(sh->empty, shape, dt, NULL);
        Py_DECREF(shape);
        if (!res || PyObject_GetBuffer(res, &rb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    } else {
        if (!Py_IS_TYPE(out, (PyTypeObject *)sh->ndarray)) goto general;
        if (!(odt = PyObject_GetAttr(out, str_dtype))) goto done;
        eq = PyObject_RichCompareBool(odt, dt, Py_EQ);          /* identity first: no call */
        Py_DECREF(odt);
        if (eq < 0) goto done;
        if (!eq || PyObject_GetBuffer(out, &rb, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto general;
        if ((size_t)rb.len != n_out * (size_t)xb.itemsize) goto general;
        res = Py_NewRef(out);
    }
    {
        const Py_buffer *r = rb.obj ? &rb : &xb;
        int bad = kind == K_ALLREDUCE ? check_allreduce(self, &xb, r, &k)
                  : kind == K_ALLGATHER ? check_allgather(self, &xb, r, &k)
                  : kind == K_REDUCE_SCATTER ? check_reduce_scatter(self, &xb, r, &k)
                  : kind == K_ALLTOALL ? check_alltoall(self, &xb, r, &k)
                  : check_broadcast(self, &xb, &k);
        PyObject *seq;
        if (bad) goto done;             /* ValueError (overlapping alltoall buffers) */
        if (!(seq = run_rec(self, sh->flight, &k))) goto done;
        Py_DECREF(seq);
        ret = Py_NewRef(res);
    }
    goto done;
general:
    PyErr_Clear();
    ret = Py_NewRef(sh->general);
done:
    if (xb.obj) PyBuffer_Release(&xb);
    if (rb.obj) PyBuffer_Release(&rb);
    Py_XDECREF(res);
    Py_XDECREF(dt);
    return ret;
}

/* shm_attach(name, create, local_ranks, column, slot): create (node's first rank) or open the
 * POSIX shm object, map it and route the node's collectives through it. column: global ranks of
 * this local index on every node, or None when nodes differ in rank count. Every local rank
 * must attach before any collective runs; unlinking the name is the caller's job (shm_unlink). */
static int int_list(PyObject *o, int **out, int *n, const char *what) {
    PyObject *f = PySequence_Fast(o, what);
    int i;
    if (!f) return -1;
    *n = (int)PySequence_Fast_GET_SIZE(f);
    if (!(*out = PyMem_Malloc(sizeof(int) * (size_t)(*n + 1)))) {
        Py_DECREF(f);
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < *n; i++) (*out)[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(f, i));
    Py_DECREF(f);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *Comm_shm_attach(CommObject *self, PyObject *args) {
    const char *name;
    int create, nl = 0, nc = 0, rc;
    PyObject *pl, *pc;
    Py_ssize_t slot;
    int *lr = NULL, *col = NULL;
    unsigned char *base = NULL;
    char err[512];
    PyObject *ret = NULL;
    if (!PyArg_ParseTuple(args, "spOOn", &name, &create, &pl, &pc, &slot)) return NULL;
    if (check_open(self)) return NULL;
    if (self->c.shm.base) {
        PyErr_SetString(PyExc_ValueError, "shared memory already attached");
        return NULL;
    }
    if (slot < 4096 || slot % 64) {
        PyErr_Format(PyExc_ValueError, "shm piece size %zd must be >= 4096 and a multiple of 64", slot);
        return NULL;
    }
    if (int_list(pl, &lr, &nl, "local_ranks must be a sequence") ||
        (pc != Py_None && int_list(pc, &col, &nc, "column must be a sequence")))
        goto cleanup;
    if (nl < 2) {
        PyErr_SetString(PyExc_ValueError, "shared memory needs at least 2 local ranks");
        goto cleanup;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = hr_shm_map(name, create, hr_shm_bytes(nl, (size_t)slot), &base, err, sizeof(err));
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetString(NativeError, err);
        goto cleanup;
    }
    if (hr_comm_shm_attach(&self->c, base, (size_t)slot, lr, nl, col, nc, err, sizeof(err)) != HR_OK) {
        munmap(base, hr_shm_bytes(nl, (size_t)slot));
        PyErr_SetString(NativeError, err);
        goto cleanup;
    }
    ret = Py_NewRef(Py_None);
cleanup:
    PyMem_Free(lr);
    PyMem_Free(col);
    return ret;
}

/* Connections on demand (collectives/ring.py): set_peer(peer, fds) hands the Comm a peer's
 * authenticated connections (it owns them on success), drop_peer(peer) closes them, peers()
 * lists the connected ranks. Between collectives only (the lock says so otherwise). */
static PyObject *Comm_set_peer(CommObject *self, PyObject *args) {
    int peer, n, k, fds[HR_MAX_STREAMS], rc;
    PyObject *seq, *fast;
    char err[256];
    if (!PyArg_ParseTuple(args, "iO", &peer, &seq) || check_open(self)) return NULL;
    if (!(fast = PySequence_Fast(seq, "fds must be a sequence of ints"))) return NULL;
    n = (int)PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > HR_MAX_STREAMS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "give 1..%d fds, got %d", HR_MAX_STREAMS, n);
        return NULL;
    }
    for (k = 0; k < n; k++) {
        PyObject *x = PySequence_Fast_GET_ITEM(fast, k);
        fds[k] = x == Py_None ? -1 : (int)PyLong_AsLong(x);
    }
    Py_DECREF(fast);
    if (PyErr_Occurred()) return NULL;
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyErr_SetString(PyExc_RuntimeError, "cannot add a connection: a collective is running");
        return NULL;
    }
    rc = hr_tcp_set(&self->c.tcp, peer, fds, n, err, sizeof(err));
    PyThread_release_lock(self->lock);
    if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Comm_drop_peer(CommObject *self, PyObject *args) {
    int peer;
    if (!PyArg_ParseTuple(args, "i", &peer) || check_open(self)) return NULL;
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyErr_SetString(PyExc_RuntimeError, "cannot drop a connection: a collective is running");
        return NULL;
    }
    hr_tcp_drop(&self->c.tcp, peer);
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

static PyObject *Comm_peers(CommObject *self, PyObject *unused) {
    PyObject *out;
    int p;
    (void)unused;
    if (check_open(self) || !(out = PyList_New(0))) return NULL;
    for (p = 0; p < self->c.size; p++) {
        PyObject *x;
        if (hr_tcp_fd(&self->c.tcp, p) < 0) continue;
        if (!(x = PyLong_FromLong(p)) || PyList_Append(out, x) < 0) {
            Py_XDECREF(x);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(x);
    }
    return out;
}

/* links() -> [(peer, send_wait_s, recv_wait_s), ...]: the ring passes' waits per peer so far
 * (hr_link_t). Read without a lock while a collective may run: a figure may lag by one pass. */
static PyObject *Comm_links(CommObject *self, PyObject *unused) {
    PyObject *out;
    int i;
    (void)unused;
    if (check_open(self) || !(out = PyList_New(0))) return NULL;
    for (i = 0; i < self->c.nlinks; i++) {
        hr_link_t l = self->c.links[i];
        PyObject *x = Py_BuildValue("(idd)", l.peer, l.send_wait, l.recv_wait);
        if (!x || PyList_Append(out, x) < 0) {
            Py_XDECREF(x);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(x);
    }
    return out;
}

/* abort(message): make message the sticky error and shut every connection, as a failing
 * collective does (the Python side failed to open a connection an op needs). */
static PyObject *Comm_abort(CommObject *self, PyObject *args) {
    const char *msg;
    if (!PyArg_ParseTuple(args, "s", &msg) || check_open(self)) return NULL;
    hr_comm_fail(&self->c, msg);
    Py_RETURN_NONE;
}

static PyObject *Comm_get_descriptors(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromLong(self->open ? hr_tcp_count(&self->c.tcp) : 0);
}

static PyObject *Comm_get_error(CommObject *self, void *unused) {
    (void)unused;
    if (!self->c.failed) Py_RETURN_NONE;
    return PyUnicode_FromString(self->c.err);
}
static PyObject *Comm_get_failed(CommObject *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(self->c.failed);
}
static PyObject *Comm_get_rank(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromLong(self->c.rank);
}
static PyObject *Comm_get_size(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromLong(self->c.size);
}
static PyObject *Comm_get_seq(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLong(self->c.seq);
}
static PyObject *Comm_get_timeout(CommObject *self, void *unused) {
    (void)unused;
    return PyFloat_FromDouble(self->c.timeout);
}
/* The cut-overs (rd_threshold, rh_chunk, bcast_tree_max, twolevel_min): size_t fields of the
 * hr_comm_t, named by their offset in the getset table's closure. Every rank must agree on them. */
static PyObject *Comm_get_cut(CommObject *self, void *off) {
    return PyLong_FromSize_t(*(size_t *)((char *)&self->c + (size_t)off));
}
static int Comm_set_cut(CommObject *self, PyObject *v, void *off) {
    size_t t;
    if (!v) return -1;
    t = PyLong_AsSize_t(v);
    if (PyErr_Occurred()) return -1;
    *(size_t *)((char *)&self->c + (size_t)off) = t;
    return 0;
}

/* streams / threads / stripe_min: every rank must set the same values (they decide how a pass
 * is cut, see ring_pass.c); the setters only check ranges. */
static int set_int_range(PyObject *v, long lo, long hi, const char *what, long *out) {
    long x;
    if (!v) return -1;
    x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be in %ld..%ld, got %ld", what, lo, hi, x);
        return -1;
    }
    *out = x;
    return 0;
}
static PyObject *Comm_get_streams(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromLong(self->c.streams);
}
static int Comm_set_streams(CommObject *self, PyObject *v, void *unused) {
    long x;
    long hi = self->c.tcp.nconn < HR_MAX_STREAMS ? self->c.tcp.nconn : HR_MAX_STREAMS;
    (void)unused;
    if (set_int_range(v, 1, hi, "streams (connections per peer opened)", &x)) return -1;
    self->c.streams = (int)x;
    return 0;
}
static PyObject *Comm_get_threads(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromLong(self->c.threads);
}
static int Comm_set_threads(CommObject *self, PyObject *v, void *unused) {
    long x;
    (void)unused;
    if (set_int_range(v, 1, HR_MAX_STREAMS, "threads", &x)) return -1;
    self->c.threads = (int)x;
    return 0;
}
static PyObject *Comm_get_stripe_min(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromSize_t(self->c.stripe_min);
}
static int Comm_set_stripe_min(CommObject *self, PyObject *v, void *unused) {
    long x;
    (void)unused;
    if (set_int_range(v, 1, 1L << 40, "stripe_min", &x)) return -1;
    self->c.stripe_min = (size_t)x;
    return 0;
}

/* shm_cma_probe() -> (ok, errno): can this rank read every local peer's memory (process_vm_readv)?
 * Only after every local rank attached. ok is the rank's own answer; the node decides (all ranks
 * must say yes) and sets shm_cma on every rank alike (collectives/ring_shm.py). */
static PyObject *Comm_shm_cma_probe(CommObject *self, PyObject *unused) {
    int ok, err;
    (void)unused;
    if (check_open(self)) return NULL;
    if (!self->c.shm.base) {
        PyErr_SetString(PyExc_ValueError, "no shared memory attached");
        return NULL;
    }
    ok = hr_shm_cma_probe(&self->c.shm, &err);
    return Py_BuildValue("(Oi)", ok ? Py_True : Py_False, err);
}

static PyObject *Comm_get_shm_cma(CommObject *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(self->c.shm.base && self->c.shm.cma);
}
static int Comm_set_shm_cma(CommObject *self, PyObject *v, void *unused) {
    int on;
    (void)unused;
    if (!v || (on = PyObject_IsTrue(v)) < 0) return -1;
    if (on && !self->c.shm.base) {
        PyErr_SetString(PyExc_ValueError, "no shared memory attached");
        return -1;
    }
    self->c.shm.cma = on;
    return 0;
}

static PyObject *Comm_get_shm_phase(CommObject *self, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLong(self->c.shm.base ? self->c.shm.phase : 0);
}

static PyObject *Comm_get_shm(CommObject *self, void *unused) {
    (void)unused;
    if (!self->c.shm.base) Py_RETURN_NONE;
    return Py_BuildValue("(ii)", self->c.shm.lsize, self->c.shm.ncol);
}

static PyGetSetDef Comm_getset[] = {
    {"descriptors", (getter)Comm_get_descriptors, NULL, "TCP connections held (all streams)", NULL},
    {"twolevel_min", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "bytes from which allreduce/reduce_scatter across hosts run two-level", (void *)offsetof(hr_comm_t, twolevel_min)},
    {"shm", (getter)Comm_get_shm, NULL,
     "(ranks sharing memory on this host, nodes in the two-level ring or 0), or None", NULL},
    {"bcast_tree_max", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "broadcast bytes below which the binomial tree is used", (void *)offsetof(hr_comm_t, bcast_tree_max)},
    {"shm_cma", (getter)Comm_get_shm_cma, (setter)Comm_set_shm_cma,
     "one node: allgather/broadcast/alltoall read peers' memory directly (every local rank the same)", NULL},
    {"shm_phase", (getter)Comm_get_shm_phase, NULL,
     "shared-memory barriers (signals) this rank has taken part in so far (0 without a segment)", NULL},
    {"cma_min", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "alltoall block bytes from which shm_cma is used (0: never; every rank the same)", (void *)offsetof(hr_comm_t, cma_min)},
    {"cma_gather_min", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "broadcast bytes from which shm_cma is used (0: never; every rank the same)",
     (void *)offsetof(hr_comm_t, cma_gather_min)},
    {"cma_allgather_min", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "allgather bytes per peer from which shm_cma is used (0: never; every rank the same)",
     (void *)offsetof(hr_comm_t, cma_allgather_min)},
    {"streams", (getter)Comm_get_streams, (setter)Comm_set_streams,
     "connections per peer a ring pass stripes over", NULL},
    {"threads", (getter)Comm_get_threads, (setter)Comm_set_threads,
     "I/O threads per ring pass", NULL},
    {"stripe_min", (getter)Comm_get_stripe_min, (setter)Comm_set_stripe_min,
     "chunk bytes per stream before another stream is used", NULL},
    {"error", (getter)Comm_get_error, NULL, "first (sticky) error message, or None", NULL},
    {"failed", (getter)Comm_get_failed, NULL, "True once a collective failed", NULL},
    {"rank", (getter)Comm_get_rank, NULL, NULL, NULL},
    {"size", (getter)Comm_get_size, NULL, NULL, NULL},
    {"seq", (getter)Comm_get_seq, NULL, "collectives started so far", NULL},
    {"timeout", (getter)Comm_get_timeout, NULL, "default deadline, s (read-only: given at creation)", NULL},
    {"rd_threshold", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "allreduce bytes below which recursive doubling is used", (void *)offsetof(hr_comm_t, rd_threshold)},
    {"direct_max", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "allreduce on at most DIRECT_MAX_RANKS ranks: bytes sent per rank ((n-1) x message) up to which direct exchange is used (0: never; every rank the same)",
     (void *)offsetof(hr_comm_t, direct_max)},
    {"rh_chunk", (getter)Comm_get_cut, (setter)Comm_set_cut,
     "allreduce bytes per rank below which recursive halving is used (0: never; every rank the same)", (void *)offsetof(hr_comm_t, rh_chunk)},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef Comm_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Comm_allreduce, METH_VARARGS | METH_KEYWORDS, NULL},
    {"allreduce_rec", (PyCFunction)Comm_allreduce_rec, METH_VARARGS,
     "allreduce_rec(flight, sendbuf, recvbuf, dtype, op, timeout) -> seq"},
    {"short_setup", (PyCFunction)Comm_short_setup, METH_VARARGS,
     "short_setup(flight, ndarray, empty, dtypes, ops, general, a2a_direct)"},
    {"short", (PyCFunction)(void (*)(void))Comm_short, METH_FASTCALL,
     "short(kind, x, out, op, root, timeout) -> result, or short_setup's general"},
    {"allgather", (PyCFunction)(void (*)(void))Comm_allgather, METH_VARARGS | METH_KEYWORDS, NULL},
    {"reduce_scatter", (PyCFunction)(void (*)(void))Comm_reduce_scatter,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"broadcast", (PyCFunction)(void (*)(void))Comm_broadcast, METH_VARARGS | METH_KEYWORDS, NULL},
    {"alltoall", (PyCFunction)(void (*)(void))Comm_alltoall, METH_VARARGS | METH_KEYWORDS, NULL},
    {"barrier", (PyCFunction)(void (*)(void))Comm_barrier, METH_VARARGS | METH_KEYWORDS, NULL},
    {"close", (PyCFunction)Comm_close, METH_NOARGS, NULL},
    {"shm_attach", (PyCFunction)Comm_shm_attach, METH_VARARGS, NULL},
    {"shm_cma_probe", (PyCFunction)Comm_shm_cma_probe, METH_NOARGS, "shm_cma_probe() -> (ok, errno)"},
    {"set_peer", (PyCFunction)Comm_set_peer, METH_VARARGS, "set_peer(peer, fds)"},
    {"drop_peer", (PyCFunction)Comm_drop_peer, METH_VARARGS, "drop_peer(peer)"},
    {"peers", (PyCFunction)Comm_peers, METH_NOARGS, "connected peer ranks"},
    {"links", (PyCFunction)Comm_links, METH_NOARGS, "[(peer, send_wait_s, recv_wait_s)] of the ring passes"},
    {"abort", (PyCFunction)Comm_abort, METH_VARARGS, "abort(message): sticky error, shut all"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CommType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpcring._native.Comm",
    .tp_basicsize = sizeof(CommObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring communicator over connected, authenticated sockets.",
    .tp_new = Comm_new,
    .tp_init = (initproc)Comm_init,
    .tp_dealloc = (destructor)Comm_dealloc,
    .tp_methods = Comm_methods,
    .tp_getset = Comm_getset,
};

static PyObject *mod_reduce(PyObject *m, PyObject *args) {
    Py_buffer d = {0}, s = {0};
    int dtype, op;
    PyObject *ret = NULL;
    (void)m;
    if (!PyArg_ParseTuple(args, "w*y*ii", &d, &s, &dtype, &op)) return NULL;
    if (check_dtype_op(dtype, op, 1) || check_len(&d, dtype, "dst")) goto cleanup;
    if (d.len != s.len) {
        PyErr_SetString(PyExc_ValueError, "dst and src differ in size");
        goto cleanup;
    }
    Py_BEGIN_ALLOW_THREADS
    hr_reduce(d.buf, s.buf, (size_t)d.len / hr_dtype_size(dtype), dtype, op);
    Py_END_ALLOW_THREADS
    ret = Py_NewRef(Py_None);
cleanup:
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    return ret;
}

static PyObject *mod_divide(PyObject *m, PyObject *args) {
    Py_buffer d = {0};
    int dtype, n;
    (void)m;
    if (!PyArg_ParseTuple(args, "w*ii", &d, &dtype, &n)) return NULL;
    if (check_dtype_op(dtype, HR_AVG, 1) || check_len(&d, dtype, "buf") || n < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "divisor must be >= 1");
        PyBuffer_Release(&d);
        return NULL;
    }
    hr_divide(d.buf, (size_t)d.len / hr_dtype_size(dtype), dtype, n);
    PyBuffer_Release(&d);
    Py_RETURN_NONE;
}

static PyObject *mod_shm_unlink(PyObject *m, PyObject *args) {
    const char *name;
    char err[512];
    (void)m;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (hr_shm_unlink(name, err, sizeof(err)) != 0) {
        PyErr_SetString(NativeError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef mod_methods[] = {
    {"shm_unlink", mod_shm_unlink, METH_VARARGS, "shm_unlink(name); a missing name is fine"},
    {"reduce", mod_reduce, METH_VARARGS, "reduce(dst, src, dtype, op): dst = dst OP src"},
    {"divide", mod_divide, METH_VARARGS, "divide(buf, dtype, n): buf /= n (float dtypes)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "hpcring._native",
                                    "Compiled ring collectives over TCP.", -1, mod_methods,
                                    NULL, NULL, NULL, NULL};

/* {name: (code, itemsize)} of enum hr_dtype and {name: code} of enum hr_redop, so that Python's
 * one table (hpcring.collectives.dtypes) is checked against the codes instead of trusting their
 * order. Returns 0, or -1 with a Python error set. */
static int mod_add_codes(PyObject *m) {
    PyObject *dt = PyDict_New(), *ops = PyDict_New(), *v;
    int i, rc = -1;
    if (!dt || !ops) goto done;
    for (i = 0; i < HR_NDTYPES; i++) {
        if (!(v = Py_BuildValue("(in)", i, (Py_ssize_t)hr_dtype_size(i)))) goto done;
        if (PyDict_SetItemString(dt, hr_dtype_name(i), v) < 0) { Py_DECREF(v); goto done; }
        Py_DECREF(v);
    }
    for (i = 0; i < HR_NOPS; i++) {
        if (!(v = PyLong_FromLong(i))) goto done;
        if (PyDict_SetItemString(ops, hr_redop_name(i), v) < 0) { Py_DECREF(v); goto done; }
        Py_DECREF(v);
    }
    if (PyModule_AddObjectRef(m, "DTYPES", dt) < 0 || PyModule_AddObjectRef(m, "OPS", ops) < 0) goto done;
    rc = 0;
done:
    Py_XDECREF(dt);
    Py_XDECREF(ops);
    return rc;
}

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m;
    int i;
    if (PyType_Ready(&CommType) < 0 || PyType_Ready(&FlightType) < 0) return NULL;
    for (i = 0; i < K_N; i++)
        if (!(kind_strs[i] = PyUnicode_InternFromString(kind_names[i]))) return NULL;
    if (!(str_dtype = PyUnicode_InternFromString("dtype"))) return NULL;
    for (i = 0; i < HR_NDTYPES; i++)
        if (!(dtype_strs[i] = PyUnicode_InternFromString(hr_dtype_name(i)))) return NULL;
    if (!(m = PyModule_Create(&moddef))) return NULL;
    {
        PyObject *kinds = PyDict_New(), *v;
        if (!kinds) return NULL;
        for (i = 0; i < K_N; i++) {
            if (!(v = PyLong_FromLong(i)) || PyDict_SetItemString(kinds, kind_names[i], v) < 0) return NULL;
            Py_DECREF(v);
        }
        if (PyModule_AddObject(m, "SHORT_KINDS", kinds) < 0) return NULL;     /* Comm.short's kind codes */
    }
    NativeError = PyErr_NewException("hpcring._native.NativeError", PyExc_RuntimeError, NULL);
    if (!NativeError || PyModule_AddObjectRef(m, "NativeError", NativeError) < 0 ||
        PyModule_AddObjectRef(m, "Comm", (PyObject *)&CommType) < 0 ||
        PyModule_AddObjectRef(m, "Flight", (PyObject *)&FlightType) < 0 ||
        PyModule_AddIntConstant(m, "RD_THRESHOLD_DEFAULT", (long)HR_RD_THRESHOLD_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "RH_CHUNK_DEFAULT", (long)HR_RH_CHUNK_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "DIRECT_MAX_DEFAULT", (long)HR_DIRECT_MAX_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "DIRECT_MAX_RANKS", (long)HR_DIRECT_MAX_RANKS) < 0 ||
        PyModule_AddIntConstant(m, "BCAST_TREE_MAX_DEFAULT", (long)HR_BCAST_TREE_MAX_DEFAULT) < 0 ||
        mod_add_codes(m) < 0 || hr_p2p_module_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
