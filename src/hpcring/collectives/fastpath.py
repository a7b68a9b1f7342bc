"""The Communicator's short path: a common synchronous call without the general
path's per-call machinery; mixed into :class:`~hpcring.collectives.api.Communicator`."""
from __future__ import annotations

import math
import sys
import weakref

import numpy as np

from hpcring.collectives.arrays import _DT2TAG
from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS
from hpcring.collectives.recorder import FlightRecorder
from hpcring import _native

# Comm.short's kind codes, by name (the C enum's owner exports them)
_KA, _KG, _KR, _KB, _KT, _KZ = (_native.SHORT_KINDS[k] for k in (
    "allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "barrier"))

_GENERAL = object()      # a short path's answer: "take the general path"


class ShortPath:
    """The short path's steps; the Communicator's public synchronous collectives try them first."""

    # The short path: the common call -- one C-contiguous array of a supported dtype,
    # out=None, out=x or an out= of the same type and dtype with the result's element count, no dtype=,
    # a synchronous call with nothing queued -- runs
    # the same steps as the general one (same checks, flight record, deadline, precheck,
    # failure path and result) without the general path's per-call machinery (closures,
    # nested device contexts, re-validation of the op string, a second completion event).
    # ``short_path = False`` (class or instance) sends every call the general way.
    short_path = True

    # The fast path: the backend's whole short path in one C call (the ring: ``Comm.short``),
    # armed after its lazy setup (None: not yet, False: the backend has none). Python's part is
    # the few attribute reads that may change between calls (precheck, queued ops, deadline).
    _fast = None

    def _fast_arm(self) -> None:
        arm = getattr(self.backend, "fast_call", None)
        self._fast = (arm(self.recorder.flight, _GENERAL) if arm is not None else None) or False

    def _fast_try(self, code: int, kind: str, x, out, op, root, timeout):
        """``kind`` through the armed fast path; _GENERAL when the precheck is on, async ops are
        queued or the C call leaves it to Python. A bad ``timeout`` raises the general path's
        UsageError before anything is recorded."""
        if self.precheck or self._worker._pending:
            return _GENERAL
        t = self.timeout if timeout is None else self._short_deadline(timeout)
        try:
            return self._fast(code, x, out, op, root, t)
        except BaseException as e:
            raise self._fast_failed(kind, e, x, root, t) from None

    def _fast_failed(self, kind: str, e: BaseException, x, root, t: float) -> BaseException:
        """The short path's failure path for a fast call: the failed record (written in C), or
        one made now for a call refused before it was recorded."""
        err = self.backend.fast_error(e)
        seq = getattr(err, "seq", None)
        rec = self.recorder.record_of(seq) if seq is not None else None
        if rec is None:
            tag = _DT2TAG.get(x.dtype) if isinstance(x, np.ndarray) else None
            count = x.size if isinstance(x, np.ndarray) else 0
            rec = self.recorder.begin(kind, tag, count, root if kind == "broadcast" else None, t)
        return self._failed(rec, err)

    def _short_ops(self) -> dict:
        """{(op, dtype): True} for the pairs the backend takes (check_op's rules), per communicator."""
        ok = self.__dict__.get("_ok_ops")
        if ok is None:
            ok = self.__dict__["_ok_ops"] = {(o, d): True for o in OPS for d in DTYPES
                                             if o != "avg" or d in FLOAT_DTYPES}
        return ok

    def _prechecked(self, kind: str, tag, count: int, root, t: float, res, call, *args):
        """The short path's call under the precheck, which reads a Record (the general store):
        the record begun, the precheck, ``call(*args)``, the record finished; ``res`` returned.
        (A callable and its arguments, not a closure: a lambda in a short path would make cells
        of its variables on every call, taken or not.)"""
        rec = self.recorder.begin(kind, tag, count, root, t)
        try:
            self._precheck(rec)
            call(*args)
        except BaseException as e:
            raise self._failed(rec, e) from None
        FlightRecorder.finish(rec)
        return res

    def _short_deadline(self, timeout: float | None) -> float:
        """:meth:`_deadline`, validated once per distinct ``timeout=`` value (the last few kept)."""
        if timeout is None:
            return self.timeout
        if type(timeout) not in (int, float):
            return self._deadline(timeout)      # validated every time (no odd dict keys)
        seen = self.__dict__.setdefault("_deadlines", {})
        t = seen.get(timeout)
        if t is None:
            t = self._deadline(timeout)         # raises the general path's UsageError
            if len(seen) >= 8:
                seen.clear()
            seen[timeout] = t
        return t

    def _allreduce_host(self, x, op: str, out=None, timeout: float | None = None):
        """The short path on a host backend (ring, mpi): a numpy array or a CPU torch tensor
        (else _GENERAL); ``out`` None, ``x``, or a C-contiguous numpy array of x's dtype and size."""
        inplace = out is x
        if self._worker._pending:               # queued async ops: in order, the general way
            return _GENERAL
        if type(x) is np.ndarray:
            host, tensor = x, False
        else:
            host, tensor = self._tensor_view(x), True
            if host is None:
                return _GENERAL
        flags = host.flags
        tag = _DT2TAG.get(host.dtype)
        if tag is None or not flags.c_contiguous or (inplace and not flags.writeable):
            return _GENERAL
        ok = self.__dict__.get("_ok_ops") or self._short_ops()
        if (op, tag) not in ok:
            return _GENERAL                # the general path raises check_op's UsageError
        t = self.timeout if timeout is None else self._short_deadline(timeout)
        flat = host if host.ndim == 1 else host.reshape(-1)
        if inplace:
            res, rflat = x, flat
        elif out is None:
            res = np.empty(x.shape, dtype=host.dtype)
            rflat = res if res.ndim == 1 else res.reshape(-1)
            if tensor:
                res = sys.modules["torch"].from_numpy(res)
        elif type(out) is np.ndarray and not tensor and out.size == host.size and out.dtype == host.dtype:
            oflags = out.flags
            if not (oflags.c_contiguous and oflags.writeable):
                return _GENERAL
            res, rflat = out, (out if out.ndim == 1 else out.reshape(-1))
        else:
            return _GENERAL                # other out= forms: the general path checks or explains
        be = self.backend
        if self.precheck and self._n > 1:
            return self._prechecked("allreduce", tag, flat.size, None, t, res,
                                    be.allreduce, flat, rflat, tag, op, t)
        # the record is a slot of the recorder's C ring (recorder.py): written by the ring's
        # native call itself, or around the backend's call here
        fl = self.recorder.flight
        seq = None
        try:
            rec_call = getattr(be, "allreduce_rec", None)
            if rec_call is None or not rec_call(fl, flat, rflat, tag, op, t):
                seq = fl.record("allreduce", tag, flat.size, None, t)
                be.allreduce(flat, rflat, tag, op, t)
                fl.end(seq)
            if self._fast is None:
                self._fast_arm()
        except BaseException as e:
            seq = seq if seq is not None else getattr(e, "seq", None)
            rec = self.recorder.record_of(seq) if seq is not None else None
            if rec is None:                     # refused before it was recorded: record it now
                rec = self.recorder.begin("allreduce", tag, flat.size, None, t)
            raise self._failed(rec, e) from None
        return res

    def _short_host(self, kind: str, x, op: str | None, out, root: int | None, timeout: float | None):
        """The short path on a host backend (ring, mpi) for allgather, reduce_scatter (first
        dimension divisible by the size), broadcast, alltoall and barrier (``x`` None): a
        C-contiguous numpy array of a supported dtype (else _GENERAL), a synchronous call with
        nothing queued. ``out``: None, or a C-contiguous writable numpy array of x's dtype and the
        result's element count (any shape, as in general); ``x`` itself for alltoall in place
        (broadcast is always in place). The same steps as the general path (checks, flight
        record, deadline, precheck, failure path, result) without its per-call machinery, as
        :meth:`_allreduce_host` does for allreduce."""
        if self._worker._pending:               # queued async ops: in order, the general way
            return _GENERAL
        n = self._n                             # the backend's size, read once (a property chain)
        if kind == "barrier":
            tag = count = None
            flat = rflat = res = None
        else:
            if type(x) is not np.ndarray:
                return _GENERAL
            flags = x.flags
            tag = _DT2TAG.get(x.dtype)
            if tag is None or not flags.c_contiguous:
                return _GENERAL
            if kind == "reduce_scatter" and (op, tag) not in (self.__dict__.get("_ok_ops") or self._short_ops()):
                return _GENERAL             # the general path raises check_op's UsageError (op None too)
            flat = x if x.ndim == 1 else x.reshape(-1)
            count = flat.size
            inplace = out is x
            if kind == "broadcast" or inplace:
                if not flags.writeable or (inplace and kind != "alltoall"):
                    return _GENERAL
                res, rflat = x, flat
            else:
                if kind == "allgather":
                    n_out = count * n
                elif kind == "reduce_scatter":
                    if not x.ndim or x.shape[0] % n:
                        return _GENERAL     # uneven chunks: the general path's own shape
                    n_out = count // n
                elif count % n:             # alltoall
                    return _GENERAL         # the general path's UsageError
                else:
                    n_out = count
                if out is None:             # the result's shape: built only here
                    shape = ((n, *x.shape) if kind == "allgather" else
                             (x.shape[0] // n, *x.shape[1:]) if kind == "reduce_scatter" else x.shape)
                    res = np.empty(shape, dtype=x.dtype)
                elif type(out) is np.ndarray and out.size == n_out and (out.dtype is x.dtype or out.dtype == x.dtype):
                    oflags = out.flags
                    if not (oflags.c_contiguous and oflags.writeable):
                        return _GENERAL
                    res = out
                else:
                    return _GENERAL         # other out= forms: the general path checks or explains
                rflat = res if res.ndim == 1 else res.reshape(-1)
        t = self.timeout if timeout is None else self._short_deadline(timeout)
        be = self.backend
        if self.precheck and n > 1:
            return self._prechecked(kind, tag, count or 0, root, t, res,
                                    self._host_call, be, kind, flat, rflat, tag, op, root, t)
        fl = self.recorder.flight
        seq = None
        try:
            seq = fl.record(kind, tag, count or 0, root, t)    # the ring's later calls: _fast_try
            self._host_call(be, kind, flat, rflat, tag, op, root, t)
            fl.end(seq)
            if self._fast is None:
                self._fast_arm()
        except BaseException as e:
            seq = seq if seq is not None else getattr(e, "seq", None)
            rec = self.recorder.record_of(seq) if seq is not None else None
            if rec is None:
                rec = self.recorder.begin(kind, tag, count or 0, root, t)
            raise self._failed(rec, e) from None
        return res

    @staticmethod
    def _host_call(be, kind, flat, rflat, tag, op, root, t) -> None:
        if kind == "allgather":
            be.allgather(flat, rflat, tag, t)
        elif kind == "reduce_scatter":
            be.reduce_scatter(flat, rflat, tag, op, t)
        elif kind == "broadcast":
            be.broadcast(flat, root, tag, t)
        elif kind == "alltoall":
            be.alltoall(flat, rflat, tag, t)
        else:
            be.barrier(t)

    _VIEWS_MAX = 64

    def _tensor_view(self, x):
        """The numpy view of a contiguous CPU torch tensor (as adapt makes it, through DLPack),
        cached per tensor: reused while the tensor lives at the same address with the same shape
        and dtype (an entry goes when its tensor dies; at most _VIEWS_MAX are kept). None: not
        such a tensor (bfloat16, another device, a subclass...): the general path."""
        torch = sys.modules.get("torch")
        if torch is None or type(x) is not torch.Tensor or not x.is_contiguous():
            return None
        views = self.__dict__.get("_views")
        if views is None:
            views = self.__dict__["_views"] = {}
        key = id(x)
        e = views.get(key)
        ptr = x.data_ptr()
        if e is not None and e[0]() is x and e[1] == ptr and e[2] == x.shape and e[3] is x.dtype:
            return e[4]
        if x.device.type != "cpu" or x.dtype is torch.bfloat16:
            return None
        try:
            host = np.from_dlpack(x.detach())
        except (TypeError, RuntimeError, BufferError):
            return None
        if len(views) >= self._VIEWS_MAX:
            views.clear()
        views[key] = (weakref.ref(x, lambda _, k=key, v=views: v.pop(k, None)), ptr, x.shape, x.dtype, host)
        return host

    def _short_device(self, kind: str, x, op: str | None, out, root: int | None, timeout: float | None):
        """The short path on a stream-ordered backend (NCCL) for allreduce, allgather, broadcast
        and reduce_scatter (first dimension divisible by the size): a C-contiguous CuPy array on
        the backend's GPU, that GPU current (else _GENERAL); enqueued on the caller's current
        CuPy stream there. ``out``: None, or a C-contiguous CuPy array of the result's dtype and
        element count on that GPU; ``x`` itself for allreduce in place (broadcast is always in place)."""
        be = self.backend
        cp = getattr(be, "array_module", None) or sys.modules.get("cupy")    # as _cuda finds it
        if cp is None or type(x) is not cp.ndarray or not hasattr(be, "enqueue"):
            return _GENERAL
        tag = _DT2TAG.get(x.dtype)
        if tag is None or (kind in ("allreduce", "reduce_scatter")
                           and (op, tag) not in (self.__dict__.get("_ok_ops") or self._short_ops())):
            return _GENERAL                 # op None included: the general path's UsageError
        dev_id = be.device_id
        # CuPy's own attributes (_c_contiguous, data.device_id) cost a tenth of x.flags / x.device
        if x.data.device_id != dev_id or not x._c_contiguous or cp.cuda.runtime.getDevice() != dev_id:
            return _GENERAL                 # the general path explains (UsageError), copies or switches GPU
        if kind == "allreduce":
            shape = x.shape
        elif kind == "allgather":
            shape = (self._n, *x.shape)
        elif kind == "reduce_scatter":
            if not x.ndim or x.shape[0] % self._n:
                return _GENERAL             # uneven chunks: the general path's own way
            shape = (x.shape[0] // self._n, *x.shape[1:])
        else:                               # broadcast: in place
            shape = None
        inplace = out is x
        if inplace and kind != "allreduce":
            return _GENERAL
        if not (out is None or inplace or (shape is not None and type(out) is cp.ndarray and out.dtype == x.dtype
                                           and out.size == math.prod(shape) and out._c_contiguous
                                           and out.data.device_id == dev_id)):
            return _GENERAL                 # any out= shape with the result's element count, as in general
        t = self._short_deadline(timeout)
        stream = cp.cuda.get_current_stream(dev_id)
        flat = x if x.ndim == 1 else x.reshape(-1)
        if inplace or shape is None:
            res, rflat = x, flat
        else:
            res = cp.empty(shape, dtype=x.dtype) if out is None else out
            rflat = res if res.ndim == 1 else res.reshape(-1)
        if self.precheck and self._n > 1:     # the precheck reads a Record: the general store
            rec = self.recorder.begin(kind, tag, flat.size, root, t)
            try:
                self._precheck(rec)
                pending = be.enqueue(kind, flat, rflat, tag, op, root, t, stream)
            except BaseException as e:
                raise self._failed(rec, e) from None
            self._ordered.add(rec, pending, None, res)
            return res
        # a slot of the recorder's C ring; the poller ends it (engine.Completions)
        seq = self.recorder.flight.record(kind, tag, flat.size, root, t)
        try:
            pending = be.enqueue(kind, flat, rflat, tag, op, root, t, stream)
        except BaseException as e:
            raise self._failed(self.recorder.record_of(seq) or self.recorder.begin(kind, tag, flat.size, root, t),
                               e) from None
        self._ordered.add(seq, pending, None, res)
        return res
