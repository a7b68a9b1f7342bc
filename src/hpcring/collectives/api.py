"""Communicator: the user-facing collectives on numpy arrays, torch tensors and CuPy arrays.

Semantics (all ranks call the same collectives in the same order with matching arguments):

* ``out=None`` returns a new array; ``out=x`` works in place; any other ``out`` must have the
  right dtype, element count and be C-contiguous and writable. The result has the type of the
  input (numpy -> numpy, torch -> torch on the input's device, CuPy -> CuPy).
* dtypes: float16, bfloat16, float32, float64, int32, int64, uint8. bfloat16 is 2-byte storage:
  a torch.bfloat16 tensor, an ml_dtypes bfloat16 array, or a uint16 array passed with
  ``dtype="bfloat16"``. ops: sum, prod, min, max, avg (avg only for floating-point dtypes).
* deadlines: every call has one: ``timeout=`` on the call, else the communicator's default
  (``Communicator(timeout=)``, else HPCRING_TIMEOUT, which ``hpcring submit/run --timeout`` sets,
  else 300 s; all resolved by :func:`hpcring.config.envvars.collective_timeout`). A missed deadline
  or a dead peer raises :class:`~hpcring.errors.CollectiveError` naming the op, peer rank and host, and the
  communicator stays failed (every later call raises the first error).
* async: ``*_async`` returns a :class:`Handle`; ops run in submission order on one worker thread
  per communicator (synchronous calls queue behind pending async ones).

Host memory goes to the backend without copies (numpy views, DLPack for torch CPU tensors).
Device memory is staged through host memory for a host backend (ring, mpi). A device backend
(``backend.device == "cuda"``, NCCL) receives device memory without copies: CuPy arrays as flat
views, CUDA torch tensors (and other CUDA DLPack objects) through ``cupy.from_dlpack``; results are
new CuPy arrays / CUDA tensors on the backend's GPU (or ``out``/``x`` itself). Such a call runs on
the caller's current stream on that GPU, captured when the call is made (also for ``*_async``):
torch's current stream when a CUDA torch tensor is involved, else CuPy's. Such calls are
stream-ordered: enqueued in the calling thread, they return without waiting for the GPU (results
are valid in stream order; ``*_async`` handles complete, and done-callbacks run, once the GPU
finished; :meth:`Communicator.synchronize` waits for all), and a poller thread keeps each one's
deadline. numpy inputs on a device backend are staged by the backend and waited for.
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from hpcring.collectives.arrays import (_DT2TAG, CudaContext, active_on, adapt, check_op, check_out, fuse,
                                        kind_of, new_like, store_into, finish)
from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS, Backend, chunk_counts
from hpcring.collectives.engine import Completions, Handle, Worker
from hpcring.collectives.precheck import precheck_default, precheck_message, signature_code
from hpcring.collectives.recorder import FlightRecorder, Record
from hpcring.ranks import globalize
from hpcring.errors import CollectiveError, HpcringError, UsageError


_GENERAL = object()      # a short path's answer: "take the general path"


def _twins(impl: Callable) -> tuple[Callable, Callable]:
    """``op`` and ``op_async`` from one implementation ``_op(self, ..., is_async=False)``: same
    parameters (shown by help() and IDEs), the implementation's docstring; the async one queues
    the call and returns a :class:`Handle` (device collectives: completed by the GPU)."""
    name = impl.__name__.lstrip("_")
    sig = inspect.signature(impl)
    public = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "is_async"])

    def sync(self, *args, **kwargs):
        return impl(self, *args, is_async=False, **kwargs)

    def async_(self, *args, **kwargs):
        return impl(self, *args, is_async=True, **kwargs)
    for fn, fname, doc in ((sync, name, impl.__doc__),
                           (async_, f"{name}_async", f"Like :meth:`{name}`, returning a :class:`Handle` at once; "
                                                     "the arrays must not be touched until it is done.")):
        fn.__name__ = fn.__qualname__ = fname
        # stacks and hang reports read the frame's code name: "in allreduce", not "in sync"
        fn.__code__ = fn.__code__.replace(co_name=fname, **({"co_qualname": f"Communicator.{fname}"}
                                                            if hasattr(fn.__code__, "co_qualname") else {}))
        fn.__doc__ = doc
        fn.__signature__ = public if fn is sync else public.replace(return_annotation=Handle)
    return sync, async_


# ---------------------------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------------------------
class Communicator:
    """Collectives over a :class:`~hpcring.collectives.backends.Backend`."""

    def __init__(self, backend: Backend, *, timeout: float | None = None, watchdog=None,
                 members=None, group: str | None = None) -> None:
        from hpcring.config.envvars import collective_timeout
        self.backend = backend
        # a group's communicator (hpcring.collectives.groups): the global rank of each member, and
        # the group's name in flight records and reports; None for the job's own communicators
        self.members = tuple(members) if members is not None else None
        self.group = group
        self.timeout = collective_timeout(timeout)     # finite and > 0, checked there
        self._worker = Worker(f"hpcring-comm:{backend.rank}")
        self.recorder = FlightRecorder(backend.rank, backend.size, backend.name, group=group,
                                       members=self.members)
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.register(self)
        self.precheck = precheck_default()
        self._ordered = Completions(self) if getattr(backend, "stream_ordered", False) else None

    @classmethod
    def create(cls, topology, store, secret: bytes | str, *, timeout: float | None = None,
               backend: str = "ring", watchdog=None, members=None, group: str | None = None,
               **backend_options) -> "Communicator":
        """Communicator for ``topology`` on ``backend`` ("ring": address exchange through
        ``store``; "mpi": MPI_COMM_WORLD via mpi4py; "nccl": unique id through ``store``).
        ``watchdog`` (:class:`hpcring.diagnostics.watchdog.Watchdog`) turns failures into a
        job-wide report. ``members`` / ``group``: see :mod:`hpcring.collectives.groups`
        (``topology`` is then the group's sub-topology)."""
        if backend == "ring":
            from hpcring.collectives.ring import RingBackend as impl
        elif backend == "mpi":
            from hpcring.collectives.mpi import MpiBackend as impl
        elif backend == "nccl":
            from hpcring.collectives.nccl import NcclBackend as impl
        else:
            raise UsageError(f"unknown backend {backend!r}; choose one of ring, mpi, nccl")
        if backend in ("ring", "mpi"):  # they meet in the first collective, under its deadline
            backend_options.setdefault("lazy", True)
        from hpcring.config.envvars import collective_timeout
        timeout = collective_timeout(timeout)   # resolved once; backend and communicator get the value
        be = impl.create(topology, store, secret, timeout, **backend_options)
        return cls(be, timeout=timeout, watchdog=watchdog, members=members, group=group)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def error(self) -> str | None:
        """The backend's sticky error; a group's names global ranks."""
        if self.members is None:
            return self.backend.error
        return globalize(self.backend.error, self.members)

    # -- what upper layers may know of the backend (they ask here, not the backend) ----------
    @property
    def backend_name(self) -> str:
        """"ring", "mpi" or "nccl" (flight records, timelines, tables)."""
        return self.backend.name

    @property
    def device(self) -> str:
        """Memory the collectives take without staging: "cpu" (numpy) or "cuda" (CuPy arrays on
        GPU :attr:`device_id`)."""
        return getattr(self.backend, "device", "cpu")

    @property
    def device_id(self) -> int:
        return int(getattr(self.backend, "device_id", 0))

    @property
    def array_module(self):
        """The CuPy module of a "cuda" communicator's buffers; None on a host backend."""
        return getattr(self.backend, "array_module", None)

    @property
    def stream_ordered(self) -> bool:
        """Calls are queued on the caller's stream (NCCL): point-to-point is held for a group."""
        return self._ordered is not None

    def describe(self) -> str | None:
        """The transport in use, one line (the ring's: shared memory or tcp, streams,
        connections); None where the backend does not say."""
        describe = getattr(self.backend, "describe", None)
        return describe() if describe is not None else None

    def close(self) -> None:
        if self._ordered is not None:
            self._ordered.stop()
        self._worker.stop()
        self.backend.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- execution ------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        if timeout is None:             # the hot path: no import, no check
            return self.timeout
        from hpcring.config.envvars import collective_timeout
        return collective_timeout(timeout, "timeout")

    def _record(self, op: str, dtype: str | None, count: int, root: int | None, timeout: float) -> Record:
        return self.recorder.queue(op, dtype, count, root, timeout)

    def _run(self, rec: Record, fn: Callable[[], Any], is_async: bool, dev: "CudaContext | None" = None):
        if self._ordered is not None:
            return self._run_ordered(rec, fn, is_async, dev)

        def execute():
            FlightRecorder.start(rec)
            try:
                if self.precheck and self.size > 1:
                    self._precheck(rec)
                result = fn()
            except BaseException as e:
                raise self._failed(rec, e) from None
            FlightRecorder.finish(rec)
            return result
        name = f"{rec.op}#{rec.seq}"
        if is_async:
            return self._worker.submit(name, execute)
        if self._worker.pending:
            return self._worker.submit(name, execute).wait()
        return execute()

    def _failed(self, rec: Record, e: BaseException) -> BaseException:
        """Record a failed collective; a CollectiveError goes through the watchdog (which may end
        the process) and comes back with the job-wide report."""
        if self.members is not None and type(e) is CollectiveError:
            e = CollectiveError(globalize(e.message, self.members), hint=e.hint)
        FlightRecorder.finish(rec, e)
        if isinstance(e, CollectiveError) and self.watchdog is not None:
            return self.watchdog.on_failure(self, rec, e)
        return e

    def _run_ordered(self, rec: Record, fn, is_async: bool, dev):
        """A stream-ordered (device) backend: enqueue in the caller's thread -- the order of
        enqueues is the order of the collectives, the same on every rank -- and return without
        waiting for the GPU. The completion event is recorded after everything ``fn`` put on the
        caller's stream (unpacking included); :class:`_Completions` completes record and handle."""
        FlightRecorder.start(rec)
        try:
            if self.precheck and self.size > 1:
                self._precheck(rec)
            with active_on(dev):
                result = fn()
        except BaseException as e:
            err = self._failed(rec, e)
            if not is_async:
                raise err from None
            h = Handle(f"{rec.op}#{rec.seq}")
            h._set(error=err)
            return h
        pending = self.backend.take_pending()
        h = Handle(f"{rec.op}#{rec.seq}") if is_async else None
        if pending is None:             # staged or blocking: already complete
            FlightRecorder.finish(rec)
            if h is not None:
                h._set(result)
            return h if is_async else result
        if dev is not None:
            pending.event.record(dev.stream)
        if h is not None:
            h.cuda_event = pending.event
        self._ordered.add(rec, pending, h, result)
        return h if is_async else result

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every collective issued so far has completed (device collectives run
        asynchronously on their streams; host ones are waited for by their handles). Raises the
        first failure."""
        if self._ordered is not None:
            self._ordered.drain(timeout)
        elif self._worker.pending:
            self._worker.submit("synchronize", lambda: None).wait(timeout)
        if self.backend.error is not None:
            raise CollectiveError(self.error)

    def _precheck(self, rec: Record) -> None:
        """HPCRING_CHECK_COLLECTIVES=1: every rank's (op, dtype, count, root) through a 40-byte
        allgather before the collective itself; a difference fails at once on every rank."""
        mine = np.array(signature_code(rec), dtype=np.int64)
        table = np.empty(self.size * mine.size, dtype=np.int64)
        self.backend.allgather(mine, table, "int64", rec.timeout)
        rows = [tuple(int(v) for v in row) for row in table.reshape(self.size, mine.size)]
        if len(set(rows)) > 1:
            raise CollectiveError(precheck_message(rec.seq, rows),
                                  hint="every rank must call the same collectives in the same order with "
                                       "the same sizes, dtypes and roots")

    def _cuda(self, *arrays) -> CudaContext | None:
        """For a ``device == "cuda"`` backend: its GPU and the caller's stream for this call
        (torch's current stream when any of ``arrays`` is a CUDA torch tensor, else CuPy's);
        None for a host backend (device arrays are then staged through host memory)."""
        be = self.backend
        if getattr(be, "device", "cpu") != "cuda":
            return None
        cp = getattr(be, "array_module", None)
        if cp is None:
            import cupy as cp
        torch_stream = any(kind_of(x) == "torch" and x.device.type == "cuda" for x in arrays)
        return CudaContext.capture(cp, int(getattr(be, "device_id", 0)), torch_stream=torch_stream)

    # -- allreduce --------------------------------------------------------------------------
    # The short path (issue 23): the common call -- one C-contiguous array of a supported dtype,
    # out=None, out=x or an out= of the same type and dtype with the result's element count, no dtype=,
    # a synchronous call with nothing queued -- runs
    # the same steps as the general one (same checks, flight record, deadline, precheck,
    # failure path and result) without the general path's per-call machinery (closures,
    # nested device contexts, re-validation of the op string, a second completion event).
    # ``short_path = False`` (class or instance) sends every call the general way.
    short_path = True

    def _allreduce(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                   dtype: str | None = None, is_async: bool = False):
        """Element-wise ``op`` over all ranks' ``x``; returns ``out`` (a new array when None;
        ``out=x`` for in place). Identical on all ranks."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "allreduce input", writable=out is x, dev=dev)
            check_op(op, a.tag, "allreduce")
            t = self._deadline(timeout)
            if out is x:
                res = a
            elif out is None:
                res = new_like(a, a.shape)
            else:
                res = adapt(out, dtype if a.tag != "bfloat16" else "bfloat16", "allreduce out", writable=True,
                             dev=dev)
                check_out(res, a, a.flat.size, "allreduce")

        def run():
            with active_on(dev):
                self.backend.allreduce(a.flat, res.flat, a.tag, op, t)
                return finish(res, a)
        return self._run(self._record("allreduce", a.tag, a.flat.size, None, t), run, is_async, dev)

    def _short_ops(self) -> dict:
        """{(op, dtype): True} for the pairs the backend takes (check_op's rules), per communicator."""
        ok = self.__dict__.get("_ok_ops")
        if ok is None:
            ok = self.__dict__["_ok_ops"] = {(o, d): True for o in OPS for d in DTYPES
                                             if o != "avg" or d in FLOAT_DTYPES}
        return ok

    def _prechecked(self, kind: str, tag, count: int, root, t: float, res, call):
        """The short path's call under the precheck, which reads a Record (the general store):
        the record begun, the precheck, ``call()``, the record finished; ``res`` returned."""
        rec = self.recorder.begin(kind, tag, count, root, t)
        try:
            self._precheck(rec)
            call()
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
        if self.precheck and self.size > 1:
            return self._prechecked("allreduce", tag, flat.size, None, t, res,
                                    lambda: be.allreduce(flat, rflat, tag, op, t))
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
        be = self.backend
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
            if op is not None and (op, tag) not in (self.__dict__.get("_ok_ops") or self._short_ops()):
                return _GENERAL             # the general path raises check_op's UsageError
            flat = x if x.ndim == 1 else x.reshape(-1)
            count = flat.size
            inplace = out is x
            if kind == "broadcast" or inplace:
                if not flags.writeable or (inplace and kind != "alltoall"):
                    return _GENERAL
                res, rflat = x, flat
            else:
                if kind == "allgather":
                    shape = (self.size, *x.shape)
                    n_out = count * self.size
                elif kind == "reduce_scatter":
                    if not x.ndim or x.shape[0] % self.size:
                        return _GENERAL     # uneven chunks: the general path's own shape
                    shape = (x.shape[0] // self.size, *x.shape[1:])
                    n_out = count // self.size
                else:                       # alltoall
                    if count % self.size:
                        return _GENERAL     # the general path's UsageError
                    shape, n_out = x.shape, count
                if out is None:
                    res = np.empty(shape, dtype=x.dtype)
                elif type(out) is np.ndarray and out.dtype == x.dtype and out.size == n_out:
                    oflags = out.flags
                    if not (oflags.c_contiguous and oflags.writeable):
                        return _GENERAL
                    res = out
                else:
                    return _GENERAL         # other out= forms: the general path checks or explains
                rflat = res if res.ndim == 1 else res.reshape(-1)
        t = self.timeout if timeout is None else self._short_deadline(timeout)
        if self.precheck and self.size > 1:
            return self._prechecked(kind, tag, count or 0, root, t, res,
                                    lambda: self._host_call(be, kind, flat, rflat, tag, op, root, t))
        fl = self.recorder.flight
        seq = None
        try:
            seq = fl.record(kind, tag, count or 0, root, t)
            self._host_call(be, kind, flat, rflat, tag, op, root, t)
            fl.end(seq)
        except BaseException as e:
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
        if tag is None or (op is not None and (op, tag) not in (self.__dict__.get("_ok_ops") or self._short_ops())):
            return _GENERAL
        dev_id = be.device_id
        # CuPy's own attributes (_c_contiguous, data.device_id) cost a tenth of x.flags / x.device
        if x.data.device_id != dev_id or not x._c_contiguous or cp.cuda.runtime.getDevice() != dev_id:
            return _GENERAL                 # the general path explains (UsageError), copies or switches GPU
        if kind == "allreduce":
            shape = x.shape
        elif kind == "allgather":
            shape = (self.size, *x.shape)
        elif kind == "reduce_scatter":
            if not x.ndim or x.shape[0] % self.size:
                return _GENERAL             # uneven chunks: the general path's own way
            shape = (x.shape[0] // self.size, *x.shape[1:])
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
        if self.precheck and self.size > 1:     # the precheck reads a Record: the general store
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

    def _allreduce_grouped(self, arrays: Sequence, op: str = "sum", *, timeout: float | None = None,
                           inplace: bool = False, is_async: bool = False):
        """Allreduce many arrays as one fused buffer per dtype (one collective per dtype, in a
        fixed dtype order); returns the results in input order (the inputs themselves when
        ``inplace``)."""
        arrays = list(arrays)
        dev = self._cuda(*arrays)
        with active_on(dev):
            arrs = [adapt(x, None, f"allreduce_grouped input {i}", writable=inplace, dev=dev)
                    for i, x in enumerate(arrays)]
        for a in arrs:
            check_op(op, a.tag, "allreduce_grouped")
        t = self._deadline(timeout)
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrs):
            groups.setdefault(a.tag, []).append(i)

        def run():
            results: list[Any] = [None] * len(arrs)
            with active_on(dev):
                for tag in sorted(groups, key=DTYPES.index):      # same order on every rank
                    idx = groups[tag]
                    fused = fuse([arrs[i] for i in idx], dev)
                    self.backend.allreduce(fused, fused, tag, op, t)
                    pos = 0
                    for i in idx:
                        a = arrs[i]
                        n = a.flat.size
                        r = a if inplace else new_like(a, a.shape)
                        store_into(r, fused[pos:pos + n])
                        results[i] = finish(r, a)
                        pos += n
            return results
        count = sum(a.flat.size for a in arrs)
        tags = "+".join(sorted(groups, key=DTYPES.index))
        return self._run(self._record("allreduce_grouped", tags, count, None, t), run, is_async, dev)

    # -- allgather ------------------------------------------------------------------------
    def _allgather(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None,
                   is_async: bool = False):
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)`` (``out`` may have
        any shape with that many elements)."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "allgather input", writable=False, dev=dev)
            t = self._deadline(timeout)
            shape = (self.size, *a.shape)
            if out is None:
                res = new_like(a, shape)
            else:
                res = adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "allgather out", writable=True,
                             dev=dev)
                check_out(res, a, a.flat.size * self.size, "allgather")

        def run():
            with active_on(dev):
                self.backend.allgather(a.flat, res.flat, a.tag, t)
                return finish(res, a)
        return self._run(self._record("allgather", a.tag, a.flat.size, None, t), run, is_async, dev)

    # -- broadcast ------------------------------------------------------------------------
    def _broadcast(self, x, root: int = 0, *, timeout: float | None = None, dtype: str | None = None,
                   is_async: bool = False):
        """In place: ``x`` on every rank becomes root's ``x`` (same shape and dtype everywhere);
        returns ``x``."""
        if not (0 <= root < self.size):
            raise UsageError(f"broadcast: root {root} out of range for {self.size} ranks")
        dev = self._cuda(x)
        with active_on(dev):
            a = adapt(x, dtype, "broadcast buffer", writable=True, dev=dev)
        t = self._deadline(timeout)

        def run():
            with active_on(dev):
                self.backend.broadcast(a.flat, root, a.tag, t)
                return finish(a, a)
        return self._run(self._record("broadcast", a.tag, a.flat.size, root, t), run, is_async, dev)

    # -- reduce_scatter -------------------------------------------------------------------
    def _reduce_scatter(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                        dtype: str | None = None, is_async: bool = False):
        """This rank's share of the element-wise ``op`` over ranks. When ``x.shape[0]`` is
        divisible by the world size the result has shape ``(x.shape[0] // size, *x.shape[1:])``
        (rank r gets rows r*k .. r*k+k-1); otherwise ``x`` is flattened and rank r gets
        ``len // size + (r < len % size)`` consecutive elements."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "reduce_scatter input", writable=False, dev=dev)
            check_op(op, a.tag, "reduce_scatter")
            t = self._deadline(timeout)
            n = a.flat.size
            mine = chunk_counts(n, self.size)[self.rank]
            if len(a.shape) >= 1 and a.shape[0] % self.size == 0:
                shape = (a.shape[0] // self.size, *a.shape[1:])
            else:
                shape = (mine,)
            if out is None:
                res = new_like(a, shape)
            else:
                res = adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "reduce_scatter out",
                             writable=True, dev=dev)
                check_out(res, a, mine, "reduce_scatter")

        def run():
            with active_on(dev):
                self.backend.reduce_scatter(a.flat, res.flat, a.tag, op, t)
                return finish(res, a)
        return self._run(self._record("reduce_scatter", a.tag, n, None, t), run, is_async, dev)

    # -- alltoall -------------------------------------------------------------------------
    def _alltoall(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None,
                  is_async: bool = False):
        """Block j (of ``size`` equal blocks of the flattened ``x``) goes to rank j; block i of
        the result came from rank i. Result has ``x``'s shape; ``out=x`` works in place."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "alltoall input", writable=out is x, dev=dev)
            t = self._deadline(timeout)
            if a.flat.size % self.size:
                raise UsageError(f"alltoall: {a.flat.size} elements cannot be split into {self.size} equal blocks")
            if out is x:
                res = a
            elif out is None:
                res = new_like(a, a.shape)
            else:
                res = adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "alltoall out", writable=True,
                             dev=dev)
                check_out(res, a, a.flat.size, "alltoall")

        def run():
            with active_on(dev):
                self.backend.alltoall(a.flat, res.flat, a.tag, t)
                return finish(res, a)
        return self._run(self._record("alltoall", a.tag, a.flat.size, None, t), run, is_async, dev)

    # -- barrier --------------------------------------------------------------------------
    def _barrier(self, *, timeout: float | None = None, is_async: bool = False):
        """Return once every rank has entered the barrier."""
        t = self._deadline(timeout)
        return self._run(self._record("barrier", None, 0, None, t), lambda: self.backend.barrier(t), is_async)

    # -- point-to-point ---------------------------------------------------------------------
    @property
    def p2p_log(self):
        """This communicator's point-to-point records (:class:`hpcring.collectives.p2p.P2PLog`)."""
        log = self.__dict__.get("_p2p_log")
        if log is None:
            from hpcring.collectives.p2p import P2PLog
            log = self.__dict__["_p2p_log"] = P2PLog(self.rank, self.backend.name, self.members)
        return log

    def _p2p(self, kind: str, x, peer, tag: int, timeout: float | None) -> Handle:
        return self._p2p_start([self._p2p_prepare(kind, x, peer, tag, timeout, depth=2)])[0]

    def _p2p_prepare(self, kind: str, x, peer, tag: int, timeout: float | None, depth: int) -> tuple:
        """Check the arguments (UsageError before anything moves) and record the message:
        (kind, Arr, peer, tag, deadline, record, CudaContext or None)."""
        from hpcring.collectives import p2p
        what = "isend" if kind == p2p.SEND else "irecv"
        if kind not in (p2p.SEND, p2p.RECV):
            raise UsageError(f"batch_isend_irecv: op must be 'send' or 'recv', got {kind!r}")
        peer = p2p.check_peer(peer, self.rank, self.size, what, any_ok=kind == p2p.RECV)
        tag = p2p.check_tag(tag, what)
        if not hasattr(self.backend, "p2p_batch" if self._ordered is not None else f"p2p_{kind}"):
            raise UsageError(f"{what}: the {self.backend.name} backend has no point-to-point")
        if peer is None and self._ordered is not None:
            raise UsageError(f"{what}: the {self.backend.name} backend cannot receive from any rank "
                             "(NCCL has no wildcard receive)", hint="name the source rank")
        dev = self._cuda(x)
        with active_on(dev):
            a = adapt(x, None, f"{what} buffer", writable=kind == p2p.RECV, dev=dev)
        t = self._deadline(timeout)
        rec = self.p2p_log.queue(kind, peer, tag, a.tag, a.flat.size, t, depth=depth)
        return kind, a, peer, tag, t, rec, dev

    def _p2p_start(self, preps: list) -> list[Handle]:
        """Start prepared messages: on a host backend each at once (a transport request); on a
        stream-ordered one (NCCL) all as one group on the caller's stream."""
        if self._ordered is not None:
            return self._p2p_ordered(preps)
        handles = []
        for kind, a, peer, tag, t, rec, dev in preps:
            start = getattr(self.backend, f"p2p_{kind}")
            try:
                req = start(a.flat.view(np.uint8), peer, tag, t, rec)
            except CollectiveError as e:      # a lazy setup that failed: diagnosed like a collective
                raise self._failed(rec, e) from None
            h = Handle(req.name)
            req.add_done_callback(self._p2p_done(h, a, rec, dev))
            handles.append(h)
        return handles

    def _p2p_done(self, h: Handle, a, rec, dev):
        def done(r) -> None:
            err = r.exception()
            if err is None:
                if a.staged:
                    with active_on(dev):
                        finish(a, a)
                h._set(r.source)
                return
            # the failure path may wait for the job-wide report: never on a transport thread
            threading.Thread(target=lambda: h._set(error=self._failed(rec, err)), daemon=True,
                             name=f"hpcring-p2p-failure:{self.rank}").start()
        return done

    def _p2p_ordered(self, preps: list) -> list[Handle]:
        """NCCL: one group for all of ``preps``, completed like a device collective (its event
        recorded on the caller's stream; :class:`Completions` keeps the deadline)."""
        dev = preps[0][6]
        t = min(p[4] for p in preps)
        handles = [Handle(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}")
                   for kind, _, peer, *_ in preps]
        with active_on(dev):
            try:
                self.backend.p2p_batch([(kind, a.flat, peer) for kind, a, peer, *_ in preps], t,
                                       seq=preps[0][5].seq)
            except UsageError:
                raise
            except BaseException as e:  # noqa: BLE001 - every message of the group fails with it
                for h, p in zip(handles, preps):
                    h._set(error=self._failed(p[5], e) if h is handles[0] else e)
                return handles
        pending = self.backend.take_pending()
        for h, (kind, a, peer, tag, _, rec, _) in zip(handles, preps):
            if pending is None:
                FlightRecorder.finish(rec)
                h._set(peer)
                continue
            if dev is not None:
                pending.event.record(dev.stream)
            h.cuda_event = pending.event
            self._ordered.add(rec, pending, h, peer)
        return handles

    def isend(self, x, dst: int, tag: int = 0, *, timeout: float | None = None) -> Handle:
        """Send ``x`` to rank ``dst`` (of this communicator) with ``tag``; returns a
        :class:`Handle` at once (done when the bytes are handed to the transport; ``x`` must not
        change until then). The receiver must post a receive of the same byte size and tag."""
        from hpcring.collectives.p2p import SEND
        return self._p2p(SEND, x, dst, tag, timeout)

    def irecv(self, x, src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> Handle:
        """Receive into ``x`` (written in place) from rank ``src`` (None: any rank) with ``tag``;
        the :class:`Handle`'s result is the source rank. Messages of one sender and tag arrive in
        the order sent."""
        from hpcring.collectives.p2p import RECV
        return self._p2p(RECV, x, src, tag, timeout)

    def send(self, x, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """:meth:`isend` and wait."""
        self._p2p_wait(self.isend(x, dst, tag, timeout=timeout))

    def recv(self, x, src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> int:
        """:meth:`irecv` and wait; returns the source rank."""
        return self._p2p_wait(self.irecv(x, src, tag, timeout=timeout))

    def batch_isend_irecv(self, ops: Sequence[tuple]) -> list[Handle]:
        """Start many sends and receives as one batch: ``ops`` are ``("send", x, peer[, tag])`` or
        ``("recv", x, peer[, tag])``; their order does not matter (nothing waits for another;
        on NCCL they are one group)."""
        preps = []
        for op in ops:
            kind, x, peer, *rest = op
            preps.append(self._p2p_prepare(kind, x, peer, rest[0] if rest else 0, None, depth=2))
        return self._p2p_start(preps) if preps else []

    @staticmethod
    def _p2p_wait(h: Handle):
        # the request's own deadline ends it (hpcring.collectives.p2p.KEEPER), the failure path
        # (watchdog report) adds its bounded wait
        return h.wait()

    # -- the public methods: a synchronous and an ``*_async`` twin of each implementation ----
    _allreduce_sync, allreduce_async = _twins(_allreduce)

    def allreduce(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                  dtype: str | None = None):
        # the synchronous twin, spelled out: the short path is tried first, without the twin's
        # argument repacking (same signature and docstring as _twins would give it)
        if self.short_path and dtype is None:
            res = (self._allreduce_host(x, op, out, timeout) if self._ordered is None
                   else self._short_device("allreduce", x, op, out, None, timeout))
            if res is not _GENERAL:
                return res
        return self._allreduce(x, op, out, timeout=timeout, dtype=dtype)
    allreduce.__doc__ = _allreduce.__doc__
    del _allreduce_sync
    allreduce_grouped, allreduce_grouped_async = _twins(_allreduce_grouped)
    _allgather_sync, allgather_async = _twins(_allgather)
    _broadcast_sync, broadcast_async = _twins(_broadcast)
    _reduce_scatter_sync, reduce_scatter_async = _twins(_reduce_scatter)
    del _allgather_sync, _broadcast_sync, _reduce_scatter_sync

    # the synchronous twins of allgather, broadcast and reduce_scatter, spelled out like
    # allreduce's: on a stream-ordered backend the short path is tried first
    def allgather(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None):
        if self.short_path and dtype is None:
            res = (self._short_host("allgather", x, None, out, None, timeout) if self._ordered is None
                   else self._short_device("allgather", x, None, out, None, timeout))
            if res is not _GENERAL:
                return res
        return self._allgather(x, out, timeout=timeout, dtype=dtype)
    allgather.__doc__ = _allgather.__doc__

    def broadcast(self, x, root: int = 0, *, timeout: float | None = None, dtype: str | None = None):
        if self.short_path and dtype is None and type(root) is int and 0 <= root < self.size:
            res = (self._short_host("broadcast", x, None, None, root, timeout) if self._ordered is None
                   else self._short_device("broadcast", x, None, None, root, timeout))
            if res is not _GENERAL:
                return res
        return self._broadcast(x, root, timeout=timeout, dtype=dtype)
    broadcast.__doc__ = _broadcast.__doc__

    def reduce_scatter(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                       dtype: str | None = None):
        if self.short_path and dtype is None:
            res = (self._short_host("reduce_scatter", x, op, out, None, timeout) if self._ordered is None
                   else self._short_device("reduce_scatter", x, op, out, None, timeout))
            if res is not _GENERAL:
                return res
        return self._reduce_scatter(x, op, out, timeout=timeout, dtype=dtype)
    reduce_scatter.__doc__ = _reduce_scatter.__doc__
    _alltoall_sync, alltoall_async = _twins(_alltoall)
    _barrier_sync, barrier_async = _twins(_barrier)
    del _alltoall_sync, _barrier_sync

    # alltoall and barrier: on a host backend the short path is tried first
    def alltoall(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None):
        if self.short_path and dtype is None and self._ordered is None:
            res = self._short_host("alltoall", x, None, out, None, timeout)
            if res is not _GENERAL:
                return res
        return self._alltoall(x, out, timeout=timeout, dtype=dtype)
    alltoall.__doc__ = _alltoall.__doc__

    def barrier(self, *, timeout: float | None = None):
        if self.short_path and self._ordered is None:
            res = self._short_host("barrier", None, None, None, None, timeout)
            if res is not _GENERAL:
                return res
        return self._barrier(timeout=timeout)
    barrier.__doc__ = _barrier.__doc__


__all__ = ["Communicator", "Handle", "HpcringError"]
