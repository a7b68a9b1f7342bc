/* module_flight.c -- CPython binding: hpcring._native.Flight, the flight recorder's ring of
 * records filled in C (issue 23's per-call path).
 *
 *   Flight(capacity, skip)   skip: tuple of path prefixes; a record's call site is the innermost
 *                            Python frame whose file starts with none of them
 *   Flight.record(op, dtype, count, root, timeout) -> seq   a record in state "started"
 *   Flight.end(seq, error=None)        "done", or "failed" with the error text; a no-op when seq's
 *                                      slot holds a newer record
 *   Flight.take() -> seq               the next sequence number, for a record kept elsewhere
 *   Flight.snapshot() -> [(seq, op, dtype, count, root, timeout, state, t_queued, t_started,
 *                          t_ended, site, error), ...] oldest first; site (file, line, function)
 *   Flight.get(seq) -> that tuple, or None once overwritten
 *   Flight.seq                         the newest sequence number (0 before the first)
 *   Flight.totals() -> {"done", "failed", "base", "first_started", "last_ended", "sum_started",
 *                       "sum_inside", "sum_failed"}   every record ended since the start, overwritten
 *                                      ones included (hpcring report's rank summary): O(1), kept by fl_end
 *   Comm.allreduce_rec(flight, sendbuf, recvbuf, dtype, op, timeout) (module.c): the record and
 *                                      the collective in one call
 *
 * Why: a Python record object (allocation, frame walk, lock, three clock reads) cost ~2 us of a
 * 4 KiB allreduce's ~6 us on one host (benchmarks/per_call.py); here a record is a slot of a
 * preallocated ring, written with the GIL held, and its Python form is built only when a report
 * or a dump reads it. The sequence counter is this object's, shared with records kept in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#include "module_flight.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ST_FREE = 0, ST_STARTED, ST_DONE, ST_FAILED };

/* Code objects whose skip answer is kept (direct-mapped by address): a call site walks 3-4
 * frames, and matching each file against the prefixes took a tenth of a small collective. */
#define FL_SEEN 64
#if PY_VERSION_HEX >= 0x030B0000
#define FL_LASTI 1              /* PyFrame_GetLasti: 3.11 */
#endif
static const char *state_names[] = {"free", "started", "done", "failed"};

typedef struct {
    long long seq;
    PyObject *op, *dtype;       /* str (references) */
    long long count;
    long root;                  /* -1: none */
    int state;
    double timeout, t_queued, t_started, t_ended;
    PyObject *code;             /* call site's code object (reference) or NULL */
    int line;                   /* its line; with FL_LASTI, the byte offset (the line is worked
                                 * out when a report reads the record, not per call) */
    PyObject *error;            /* str or NULL */
} fl_slot_t;

/* Totals of every record ended (done or failed) since the start: a few adds per record in fl_end,
 * so what the ring overwrites still counts. Times are sums relative to base (the first ended
 * record's start): epoch seconds summed over millions of records would lose their microseconds. */
typedef struct {
    long long done, failed;
    double base, first_started, last_ended;
    double sum_started;         /* sum of (t_started - base) over done records */
    double sum_inside;          /* sum of (t_ended - t_started) over done records */
    double sum_failed;          /* the same over failed records */
} fl_totals_t;

struct FlightObject {
    PyObject_HEAD
    fl_slot_t *slots;
    Py_ssize_t capacity;
    long long seq;
    PyObject *skip;             /* tuple of str */
    fl_totals_t tot;
    PyObject *seen[FL_SEEN];    /* code objects met in call sites (references), by address */
    char seen_skip[FL_SEEN];    /* whether each one's file is a skipped prefix */
};

static double fl_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void fl_clear(fl_slot_t *s) {
    Py_CLEAR(s->op);
    Py_CLEAR(s->dtype);
    Py_CLEAR(s->code);
    Py_CLEAR(s->error);
    s->state = ST_FREE;
}

/* The innermost frame outside the skipped prefixes: its code object (new reference) and line;
 * NULL when every frame is skipped. Clears any error of the attribute reads. */
static int fl_skipped(FlightObject *f, PyCodeObject *code) {
    size_t h = ((uintptr_t)code >> 4) % FL_SEEN;
    Py_ssize_t i, n = PyTuple_GET_SIZE(f->skip);
    int skipped = 0;
    if (f->seen[h] == (PyObject *)code) return f->seen_skip[h];
    for (i = 0; i < n && !skipped; i++)
        skipped = PyUnicode_Tailmatch(code->co_filename, PyTuple_GET_ITEM(f->skip, i), 0,
                                      PY_SSIZE_T_MAX, -1) == 1;
    Py_XSETREF(f->seen[h], Py_NewRef((PyObject *)code));   /* held: its address stays its own */
    f->seen_skip[h] = (char)skipped;
    return skipped;
}

static PyObject *fl_site(FlightObject *f, int *line) {
    PyFrameObject *fr = PyEval_GetFrame();
    Py_XINCREF(fr);
    while (fr) {
        PyCodeObject *code = PyFrame_GetCode(fr);
        PyFrameObject *back;
        if (!fl_skipped(f, code)) {
#ifdef FL_LASTI
            *line = PyFrame_GetLasti(fr);
#else
            *line = PyFrame_GetLineNumber(fr);
#endif
            Py_DECREF(fr);
            return (PyObject *)code;
        }
        Py_DECREF(code);
        back = PyFrame_GetBack(fr);
        Py_DECREF(fr);
        fr = back;
    }
    PyErr_Clear();
    return NULL;
}

long long fl_begin(FlightObject *f, PyObject *op, PyObject *dtype, long long count, long root,
                   double timeout) {
    long long seq = ++f->seq;
    fl_slot_t *s = &f->slots[seq % f->capacity];
    fl_clear(s);
    s->seq = seq;
    s->op = Py_NewRef(op);
    s->dtype = Py_NewRef(dtype);
    s->count = count;
    s->root = root;
    s->timeout = timeout;
    s->t_queued = s->t_started = fl_wall();
    s->t_ended = 0;
    s->code = fl_site(f, &s->line);
    s->state = ST_STARTED;
    return seq;
}

static void fl_count(fl_totals_t *t, double started, double ended, int failed) {
    if (t->done + t->failed == 0) {
        t->base = t->first_started = started;
        t->last_ended = ended;
    }
    if (started < t->first_started) t->first_started = started;
    if (ended > t->last_ended) t->last_ended = ended;
    if (failed) {
        t->failed++;
        t->sum_failed += ended - started;
    } else {
        t->done++;
        t->sum_started += started - t->base;
        t->sum_inside += ended - started;
    }
}

int fl_end(FlightObject *f, long long seq, PyObject *error) {
    fl_slot_t *s = &f->slots[seq % f->capacity];
    int first;
    if (seq <= 0 || s->seq != seq || s->state == ST_FREE) return 0;
    first = s->state == ST_STARTED;       /* ended once: a second end rewrites, never counts twice */
    s->t_ended = fl_wall();
    s->state = error ? ST_FAILED : ST_DONE;
    Py_XSETREF(s->error, Py_XNewRef(error));
    if (first) fl_count(&f->tot, s->t_started, s->t_ended, error != NULL);
    return 1;
}

static PyObject *fl_tuple(const fl_slot_t *s) {
    PyObject *site = Py_None;
    if (s->code) {
        PyCodeObject *c = (PyCodeObject *)s->code;
#ifdef FL_LASTI
        int line = s->line < 0 ? -1 : PyCode_Addr2Line(c, s->line);
#else
        int line = s->line;
#endif
        if (!(site = Py_BuildValue("(OiO)", c->co_filename, line, c->co_name))) return NULL;
    } else {
        Py_INCREF(site);
    }
    /* "N": the new references are handed over */
    return Py_BuildValue("(LOOLNdsNNNNO)", s->seq, s->op, s->dtype, s->count,
                         s->root < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(s->root), s->timeout,
                         state_names[s->state], PyFloat_FromDouble(s->t_queued),
                         PyFloat_FromDouble(s->t_started),
                         s->state == ST_STARTED ? Py_NewRef(Py_None) : PyFloat_FromDouble(s->t_ended),
                         site, s->error ? s->error : Py_None);
}

static int Flight_init(FlightObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"capacity", "skip", NULL};
    Py_ssize_t cap, i;
    PyObject *skip;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO!", kwlist, &cap, &PyTuple_Type, &skip)) return -1;
    if (cap < 1 || cap > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "capacity must be 1..%d records, got %zd", 1 << 24, cap);
        return -1;
    }
    for (i = 0; i < PyTuple_GET_SIZE(skip); i++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(skip, i))) {
            PyErr_SetString(PyExc_TypeError, "skip must be a tuple of str");
            return -1;
        }
    if (self->slots) {
        PyErr_SetString(PyExc_RuntimeError, "Flight already initialised");
        return -1;
    }
    if (!(self->slots = PyMem_Calloc((size_t)cap, sizeof(fl_slot_t)))) {
        PyErr_NoMemory();
        return -1;
    }
    self->capacity = cap;
    self->skip = Py_NewRef(skip);
    return 0;
}

static void Flight_dealloc(FlightObject *self) {
    Py_ssize_t i;
    for (i = 0; self->slots && i < self->capacity; i++) fl_clear(&self->slots[i]);
    for (i = 0; i < FL_SEEN; i++) Py_CLEAR(self->seen[i]);
    PyMem_Free(self->slots);
    Py_XDECREF(self->skip);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_ready(FlightObject *self) {
    if (self->slots) return 0;
    PyErr_SetString(PyExc_RuntimeError, "Flight not initialised");
    return -1;
}

static PyObject *Flight_record(FlightObject *self, PyObject *args) {
    PyObject *op, *dtype, *root;
    long long count;
    double timeout;
    long r = -1;
    if (check_ready(self) || !PyArg_ParseTuple(args, "UOLOd", &op, &dtype, &count, &root, &timeout)) return NULL;
    if (root != Py_None && (r = PyLong_AsLong(root)) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "root must be None or >= 0");
        return NULL;
    }
    return PyLong_FromLongLong(fl_begin(self, op, dtype, count, r, timeout));
}

static PyObject *Flight_end(FlightObject *self, PyObject *args) {
    long long seq;
    PyObject *error = Py_None;
    if (check_ready(self) || !PyArg_ParseTuple(args, "L|O", &seq, &error)) return NULL;
    if (error != Py_None && !PyUnicode_Check(error)) {
        PyErr_SetString(PyExc_TypeError, "error must be None or str");
        return NULL;
    }
    return PyBool_FromLong(fl_end(self, seq, error == Py_None ? NULL : error));
}

static PyObject *Flight_take(FlightObject *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(++self->seq);
}

static PyObject *Flight_get(FlightObject *self, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    fl_slot_t *s;
    if (seq == -1 && PyErr_Occurred()) return NULL;
    if (check_ready(self)) return NULL;
    s = &self->slots[(seq < 0 ? 0 : seq) % self->capacity];
    if (seq <= 0 || s->seq != seq || s->state == ST_FREE) Py_RETURN_NONE;
    return fl_tuple(s);
}

static PyObject *Flight_snapshot(FlightObject *self, PyObject *unused) {
    PyObject *out, *t;
    long long first, q;
    (void)unused;
    if (check_ready(self) || !(out = PyList_New(0))) return NULL;
    first = self->seq - self->capacity + 1;
    for (q = first < 1 ? 1 : first; q <= self->seq; q++) {
        fl_slot_t *s = &self->slots[q % self->capacity];
        if (s->seq != q || s->state == ST_FREE) continue;   /* a number taken for a Python record */
        if (!(t = fl_tuple(s)) || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
    }
    return out;
}

static PyObject *Flight_totals(FlightObject *self, PyObject *unused) {
    const fl_totals_t *t = &self->tot;
    (void)unused;
    if (check_ready(self)) return NULL;
    return Py_BuildValue("{sLsLsdsdsdsdsdsd}", "done", t->done, "failed", t->failed, "base", t->base,
                         "first_started", t->first_started, "last_ended", t->last_ended,
                         "sum_started", t->sum_started, "sum_inside", t->sum_inside, "sum_failed", t->sum_failed);
}

static PyObject *Flight_get_seq(FlightObject *self, void *unused) {
    (void)unused;
    return PyLong_FromLongLong(self->seq);
}

static PyObject *Flight_get_capacity(FlightObject *self, void *unused) {
    (void)unused;
    return PyLong_FromSsize_t(self->capacity);
}

static PyGetSetDef Flight_getset[] = {
    {"seq", (getter)Flight_get_seq, NULL, "newest sequence number", NULL},
    {"capacity", (getter)Flight_get_capacity, NULL, "slots in the ring", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef Flight_methods[] = {
    {"record", (PyCFunction)Flight_record, METH_VARARGS, "record(op, dtype, count, root, timeout) -> seq"},
    {"end", (PyCFunction)Flight_end, METH_VARARGS, "end(seq, error=None) -> whether the slot was seq's"},
    {"take", (PyCFunction)Flight_take, METH_NOARGS, "the next sequence number"},
    {"get", (PyCFunction)Flight_get, METH_O, "get(seq) -> the record's tuple or None"},
    {"snapshot", (PyCFunction)Flight_snapshot, METH_NOARGS, "every record's tuple, oldest first"},
    {"totals", (PyCFunction)Flight_totals, METH_NOARGS, "totals of every record ended since the start"},
    {NULL, NULL, 0, NULL}};

PyTypeObject FlightType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hpcring._native.Flight",
    .tp_basicsize = sizeof(FlightObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A preallocated ring of flight records written in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Flight_init,
    .tp_dealloc = (destructor)Flight_dealloc,
    .tp_methods = Flight_methods,
    .tp_getset = Flight_getset,
};
