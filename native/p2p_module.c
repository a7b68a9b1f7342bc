/* p2p_module.c -- CPython binding of the point-to-point queue (p2p.h), added to hpcring._native.
 *
 *   P2P(rank, size, hosts): one communicator's queue and its progress thread
 *   P2P.isend(id, buf, peer, tag, timeout) -> P2PReq: the caller writes what the socket takes now
 *   P2P.irecv(id, buf, peer, tag, timeout) -> P2PReq: peer -1 is any rank
 *     buf: a C-contiguous buffer (writable for irecv), held until the request is done, even
 *     when the P2PReq is freed first (a dropped handle: the buffer is parked on the P2P and
 *     released once the request is done); the caller keeps it unchanged (isend) and unread
 *     (irecv) until then
 *   P2P.set_fd(peer, fd, incoming, direct=0): hand over a connected, authenticated socket (then
 *     owned); direct: incoming, the peer's pid whose memory this rank proved it can read;
 *     outgoing, nonzero when the peer reads this rank's sends directly (p2p_direct.c);
 *     ValueError when refused (a second one, closed), and then the caller still owns fd
 *   P2P.direct_min: sends from this many bytes go as direct-read offers (where agreed)
 *   P2P.direct_counts() -> (offers sent, offers read)
 *   peek(pid, addr, n) -> bytes: read n bytes at addr in process pid (process_vm_readv), OSError
 *   P2P.fail_peer(peer, why, hint): the pair fails, sticky
 *   P2P.take_done(timeout) -> list of ids of requests completed while nobody waited, or None
 *     once the queue is closed and drained (blocks up to timeout s, GIL released)
 *   P2P.close()
 *   P2PReq.wait(timeout) -> bool done (blocks in C, GIL released); P2PReq.result() -> None while
 *     pending, else (failed, source, why, hint); P2PReq.id
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "p2p.h"
#include "transport_shm.h"   /* hr_vm_read */
#include "transport_tcp.h"

/* A request whose P2PReq was freed before it was done: its buffer stays held until it is. */
typedef struct parked {
    struct parked *next;
    hr_p2p_req_t *r;            /* the caller's reference, kept */
    Py_buffer view;
} parked_t;

typedef struct {
    PyObject_HEAD
    hr_p2p_t b;
    int inited;
    parked_t *parked;           /* under the GIL */
} P2PObject;

typedef struct {
    PyObject_HEAD
    P2PObject *box;
    hr_p2p_req_t *r;
    Py_buffer view;
} P2PReqObject;

static PyTypeObject P2PType, P2PReqType;

/* A send up to this size keeps the GIL: its write never blocks and copies little, and handing
 * the GIL over costs more (another thread takes it, on 2 busy cores for a whole time slice). */
#define SEND_KEEP_GIL ((size_t)64 << 10)

/* ---- parked buffers ---- */
static int req_done(hr_p2p_req_t *r) { return __atomic_load_n(&r->state, __ATOMIC_ACQUIRE) == HR_P2P_DONE; }

/* Release the parked buffers whose requests are done (all of them with all = 1: after close,
 * when no thread moves bytes any more). GIL held. */
static void unpark(P2PObject *self, int all) {
    parked_t **pp = &self->parked;
    while (*pp) {
        parked_t *z = *pp;
        if (!all && !req_done(z->r)) {
            pp = &z->next;
            continue;
        }
        *pp = z->next;
        hr_p2p_req_put(&self->b, z->r);
        PyBuffer_Release(&z->view);
        PyMem_Free(z);
    }
}

/* ---- P2PReq ---- */
static void P2PReq_dealloc(P2PReqObject *self) {
    parked_t *z;
    if (self->r && self->view.obj && !req_done(self->r) && (z = PyMem_Malloc(sizeof *z))) {
        /* bytes may still move from or into the buffer: keep it until the request is done */
        z->r = self->r;
        z->view = self->view;
        z->next = self->box->parked;
        self->box->parked = z;
        self->r = NULL;
        self->view.obj = NULL;
    }
    if (self->r) hr_p2p_req_put(&self->box->b, self->r);
    if (self->view.obj) PyBuffer_Release(&self->view);
    Py_XDECREF(self->box);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *P2PReq_wait(P2PReqObject *self, PyObject *args) {
    double timeout, deadline;
    int done;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    deadline = hr_now() + (timeout > 0 ? timeout : 0);
    if (__atomic_load_n(&self->r->state, __ATOMIC_ACQUIRE) == HR_P2P_DONE) Py_RETURN_TRUE;
    Py_BEGIN_ALLOW_THREADS
    done = hr_p2p_wait(&self->box->b, self->r, deadline);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *P2PReq_result(P2PReqObject *self, PyObject *unused) {
    hr_p2p_t *b = &self->box->b;
    hr_p2p_req_t *r = self->r;
    PyObject *out;
    (void)unused;
    pthread_mutex_lock(&b->mu);
    if (r->state != HR_P2P_DONE) {
        pthread_mutex_unlock(&b->mu);
        Py_RETURN_NONE;
    }
    int failed = r->failed, source = r->source, hint = r->hint;
    pthread_mutex_unlock(&b->mu);           /* why is final once DONE */
    hr_p2p_claim(b, r);
    out = Py_BuildValue("(Nis#i)", PyBool_FromLong(failed), source, r->why,
                        (Py_ssize_t)(failed ? strlen(r->why) : 0), hint);
    return out;
}

static PyObject *P2PReq_get_id(P2PReqObject *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->r->id);
}

static PyMethodDef P2PReq_methods[] = {
    {"wait", (PyCFunction)P2PReq_wait, METH_VARARGS, "wait(timeout) -> bool: done within timeout s"},
    {"result", (PyCFunction)P2PReq_result, METH_NOARGS, "None while pending, else (failed, source, why, hint)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef P2PReq_getset[] = {
    {"id", (getter)P2PReq_get_id, NULL, "the caller's id", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

/* ---- P2P ---- */
static int P2P_init(P2PObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"rank", "size", "hosts", NULL};
    int rank, size;
    PyObject *hosts, *seq = NULL;
    const char **names = NULL;
    char err[256];
    int rc = -1;
    if (self->inited) {
        PyErr_SetString(PyExc_RuntimeError, "P2P is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiO", kwlist, &rank, &size, &hosts)) return -1;
    if (size < 1 || rank < 0 || rank >= size) {
        PyErr_Format(PyExc_ValueError, "rank %d is not in 0..%d", rank, size - 1);
        return -1;
    }
    if (!(seq = PySequence_Fast(hosts, "hosts must be a sequence of str"))) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != size) {
        PyErr_Format(PyExc_ValueError, "hosts has %zd names for %d ranks", PySequence_Fast_GET_SIZE(seq), size);
        goto done;
    }
    if (!(names = PyMem_Calloc((size_t)size, sizeof *names))) {
        PyErr_NoMemory();
        goto done;
    }
    for (int i = 0; i < size; i++)
        if (!(names[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i)))) goto done;
    if (hr_p2p_init(&self->b, rank, size, names, err, sizeof err) != 0) {
        PyErr_SetString(PyExc_OSError, err);
        goto done;
    }
    self->inited = 1;
    rc = 0;
done:
    PyMem_Free(names);
    Py_XDECREF(seq);
    return rc;
}

static void P2P_dealloc(P2PObject *self) {
    if (self->inited) {
        Py_BEGIN_ALLOW_THREADS
        hr_p2p_close(&self->b);             /* every request done, no thread on a buffer */
        Py_END_ALLOW_THREADS
        unpark(self, 1);
        Py_BEGIN_ALLOW_THREADS
        hr_p2p_free(&self->b);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check(P2PObject *self, int peer, int any_ok) {
    if (!self->inited) {
        PyErr_SetString(PyExc_ValueError, "P2P is not initialised");
        return -1;
    }
    if ((peer == -1 && any_ok) || (peer >= 0 && peer < self->b.size && peer != self->b.rank)) return 0;
    PyErr_Format(PyExc_ValueError, "peer rank %d is not another rank of 0-%d", peer, self->b.size - 1);
    return -1;
}

static PyObject *post(P2PObject *self, PyObject *args, int kind) {
    unsigned long long id;
    PyObject *buf;
    int peer;
    long long tag;
    double timeout;
    P2PReqObject *req;
    if (!PyArg_ParseTuple(args, "KOiLd", &id, &buf, &peer, &tag, &timeout)) return NULL;
    if (check(self, peer, kind == HR_P2P_RECV) < 0) return NULL;
    if (self->parked) unpark(self, 0);
    if (!(timeout > 0)) {
        PyErr_Format(PyExc_ValueError, "timeout must be > 0 s, got %g", timeout);
        return NULL;
    }
    if (!(req = PyObject_New(P2PReqObject, &P2PReqType))) return NULL;
    req->r = NULL;
    req->view.obj = NULL;
    Py_INCREF(self);
    req->box = self;
    if (PyObject_GetBuffer(buf, &req->view, PyBUF_C_CONTIGUOUS | (kind == HR_P2P_RECV ? PyBUF_WRITABLE : 0)) < 0) {
        Py_DECREF(req);
        return NULL;
    }
    if (!(req->r = hr_p2p_req_new(kind, id, req->view.buf, (size_t)req->view.len, peer, tag, timeout))) {
        Py_DECREF(req);
        return PyErr_NoMemory();
    }
    if (kind == HR_P2P_SEND && req->r->nbytes > SEND_KEEP_GIL) {
        Py_BEGIN_ALLOW_THREADS
        hr_p2p_post_send(&self->b, req->r);
        Py_END_ALLOW_THREADS
    } else if (kind == HR_P2P_SEND) {
        hr_p2p_post_send(&self->b, req->r);   /* non-blocking and short: keep the GIL */
    } else {
        hr_p2p_post_recv(&self->b, req->r);   /* never waits on I/O: only b->mu */
    }
    return (PyObject *)req;
}

static PyObject *P2P_isend(P2PObject *self, PyObject *args) { return post(self, args, HR_P2P_SEND); }
static PyObject *P2P_irecv(P2PObject *self, PyObject *args) { return post(self, args, HR_P2P_RECV); }

static PyObject *P2P_set_fd(P2PObject *self, PyObject *args) {
    int peer, fd, incoming, direct = 0;
    char err[256];
    if (!PyArg_ParseTuple(args, "iip|i", &peer, &fd, &incoming, &direct)) return NULL;
    if (check(self, peer, 0) < 0) return NULL;
    if (hr_p2p_set_fd(&self->b, peer, fd, incoming, direct, err, sizeof err) != 0) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *P2P_fail_peer(P2PObject *self, PyObject *args) {
    int peer, hint;
    const char *why;
    if (!PyArg_ParseTuple(args, "isi", &peer, &why, &hint)) return NULL;
    if (check(self, peer, 0) < 0) return NULL;
    hr_p2p_fail_peer(&self->b, peer, why, hint);
    Py_RETURN_NONE;
}

static PyObject *P2P_take_done(P2PObject *self, PyObject *args) {
    double timeout;
    uint64_t ids[64];
    int n;
    PyObject *out;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    if (check(self, -1, 1) < 0) return NULL;
    double deadline = hr_now() + (timeout > 0 ? timeout : 0);
    Py_BEGIN_ALLOW_THREADS
    n = hr_p2p_take_done(&self->b, ids, 64, deadline);
    Py_END_ALLOW_THREADS
    if (self->parked) unpark(self, n < 0);      /* closed and drained: nothing moves any more */
    if (n < 0) Py_RETURN_NONE;
    if (!(out = PyList_New(n))) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(ids[i]);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *P2P_close(P2PObject *self, PyObject *unused) {
    (void)unused;
    if (self->inited) {
        Py_BEGIN_ALLOW_THREADS
        hr_p2p_close(&self->b);
        Py_END_ALLOW_THREADS
        unpark(self, 1);
    }
    Py_RETURN_NONE;
}

static PyObject *P2P_direct_counts(P2PObject *self, PyObject *unused) {
    unsigned long long sent, read;
    (void)unused;
    if (check(self, -1, 1) < 0) return NULL;
    pthread_mutex_lock(&self->b.mu);
    sent = self->b.direct_sent;
    read = self->b.direct_read;
    pthread_mutex_unlock(&self->b.mu);
    return Py_BuildValue("(KK)", sent, read);
}

static PyObject *P2P_get_direct_min(P2PObject *self, void *unused) {
    (void)unused;
    return PyLong_FromSize_t(self->inited ? self->b.direct_min : 0);
}

static int P2P_set_direct_min(P2PObject *self, PyObject *v, void *unused) {
    size_t n;
    (void)unused;
    if (!v || check(self, -1, 1) < 0) {
        if (!v) PyErr_SetString(PyExc_AttributeError, "direct_min cannot be deleted");
        return -1;
    }
    n = PyLong_AsSize_t(v);
    if (n == (size_t)-1 && PyErr_Occurred()) return -1;
    pthread_mutex_lock(&self->b.mu);
    self->b.direct_min = n;
    pthread_mutex_unlock(&self->b.mu);
    return 0;
}

static PyGetSetDef P2P_getset[] = {
    {"direct_min", (getter)P2P_get_direct_min, (setter)P2P_set_direct_min,
     "sends from this many bytes go as direct-read offers, to peers that read directly", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef P2P_methods[] = {
    {"isend", (PyCFunction)P2P_isend, METH_VARARGS, "isend(id, buf, peer, tag, timeout) -> P2PReq"},
    {"irecv", (PyCFunction)P2P_irecv, METH_VARARGS, "irecv(id, buf, peer, tag, timeout) -> P2PReq (peer -1: any)"},
    {"set_fd", (PyCFunction)P2P_set_fd, METH_VARARGS, "set_fd(peer, fd, incoming, direct=0): hand over a connection"},
    {"direct_counts", (PyCFunction)P2P_direct_counts, METH_NOARGS, "direct_counts() -> (offers sent, offers read)"},
    {"fail_peer", (PyCFunction)P2P_fail_peer, METH_VARARGS, "fail_peer(peer, why, hint): sticky"},
    {"take_done", (PyCFunction)P2P_take_done, METH_VARARGS, "take_done(timeout) -> [ids] or None (closed)"},
    {"close", (PyCFunction)P2P_close, METH_NOARGS, "fail what is pending, close the connections"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject P2PType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpcring._native.P2P",
    .tp_basicsize = sizeof(P2PObject),
    .tp_dealloc = (destructor)P2P_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Point-to-point queue of one communicator (native/p2p.h)",
    .tp_methods = P2P_methods,
    .tp_getset = P2P_getset,
    .tp_init = (initproc)P2P_init,
    .tp_new = PyType_GenericNew,
};

static PyTypeObject P2PReqType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "hpcring._native.P2PReq",
    .tp_basicsize = sizeof(P2PReqObject),
    .tp_dealloc = (destructor)P2PReq_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One point-to-point request (P2P.isend / P2P.irecv)",
    .tp_methods = P2PReq_methods,
    .tp_getset = P2PReq_getset,
};

/* peek(pid, addr, n) -> bytes: the connection handshake's proof that this rank can read a peer's
 * memory (mailbox.py); n at most 4096. */
static PyObject *p2p_peek(PyObject *mod, PyObject *args) {
    int pid, rc, e;
    unsigned long long addr;
    Py_ssize_t n;
    char buf[4096];
    (void)mod;
    if (!PyArg_ParseTuple(args, "iKn", &pid, &addr, &n)) return NULL;
    if (n < 0 || n > (Py_ssize_t)sizeof buf) {
        PyErr_Format(PyExc_ValueError, "peek reads 0-%zu bytes, not %zd", sizeof buf, n);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = hr_vm_read(pid, buf, (uint64_t)addr, (size_t)n);
    e = errno;
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBytes_FromStringAndSize(buf, n);
}

static PyMethodDef p2p_functions[] = {
    {"peek", p2p_peek, METH_VARARGS, "peek(pid, addr, n) -> bytes: read another process's memory"},
    {NULL, NULL, 0, NULL}};

int hr_p2p_module_add(PyObject *m) {
    if (PyType_Ready(&P2PType) < 0 || PyType_Ready(&P2PReqType) < 0) return -1;
    if (PyModule_AddFunctions(m, p2p_functions) < 0) return -1;
    if (PyModule_AddObjectRef(m, "P2P", (PyObject *)&P2PType) < 0 ||
        PyModule_AddObjectRef(m, "P2PReq", (PyObject *)&P2PReqType) < 0)
        return -1;
    return 0;
}
