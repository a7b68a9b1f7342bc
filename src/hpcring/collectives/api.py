"""Communicator: the user-facing collectives on numpy arrays, torch tensors and CuPy arrays.

Semantics (all ranks call the same collectives in the same order with matching arguments):

* ``out=None`` returns a new array; ``out=x`` works in place; any other ``out`` must have the
  right dtype, element count and be C-contiguous and writable. The result has the type of the
  input (numpy -> numpy, torch -> torch on the input's device, CuPy -> CuPy).
* dtypes: float16, bfloat16, float32, float64, int32, int64, uint8. bfloat16 is 2-byte storage:
  a torch.bfloat16 tensor, an ml_dtypes bfloat16 array, or a uint16 array passed with
  ``dtype="bfloat16"``. ops: sum, prod, min, max, avg (avg only for floating-point dtypes).
* deadlines: every call has one: ``timeout=`` on the call, else the communicator's default
  (``Communicator(timeout=)``, else env HPCRING_TIMEOUT, else 300 s). A missed deadline or a dead
  peer raises :class:`~hpcring.errors.CollectiveError` naming the op, peer rank and host, and the
  communicator stays failed (every later call raises the first error).
* async: ``*_async`` returns a :class:`Handle`; ops run in submission order on one worker thread
  per communicator (synchronous calls queue behind pending async ones).

Host memory goes to the backend without copies (numpy views, DLPack for torch CPU tensors).
Device memory is staged through host memory for a host backend (ring, mpi). A device backend
(``backend.device == "cuda"``, NCCL) receives device memory without copies: CuPy arrays as flat
views, CUDA torch tensors (and other CUDA DLPack objects) through ``cupy.from_dlpack``; results are
new CuPy arrays / CUDA tensors on the backend's GPU (or ``out``/``x`` itself). Such a call runs on
the caller's current stream on that GPU, captured when the call is made (also for ``*_async``):
torch's current stream when a CUDA torch tensor is involved, else CuPy's; it returns once the
operation completed on the GPU. numpy inputs on a device backend are staged by the backend.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS, Backend, chunk_counts
from hpcring.diagnostics.recorder import FlightRecorder, Record
from hpcring.errors import CollectiveError, HpcringError, UsageError

_NP_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
              "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


# ---------------------------------------------------------------------------------------------
# array adaptation
# ---------------------------------------------------------------------------------------------
_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13     # DLPack device types a CUDA backend can use in place


class _Cuda:
    """One call's device context for a ``device == "cuda"`` backend: the backend's CuPy module,
    its GPU (``device_id``) and the stream the call runs on.

    Captured in the calling thread when the call is submitted, because CuPy's current device and
    stream (and torch's current stream) are per thread and the call may run on the
    communicator's worker thread (``*_async``, or a synchronous call queued behind them)."""

    __slots__ = ("cp", "device_id", "stream")

    def __init__(self, cp, device_id: int, stream) -> None:
        self.cp, self.device_id, self.stream = cp, device_id, stream

    @classmethod
    def capture(cls, cp, device_id: int, *, torch_stream: bool) -> "_Cuda":
        """The caller's current stream on ``device_id``: torch's (wrapped as a CuPy
        ExternalStream, so the backend's work is ordered after the kernels that produced the
        tensors and before later work on that stream) when ``torch_stream``, else CuPy's."""
        if torch_stream:
            import torch
            ptr = torch.cuda.current_stream(device_id).cuda_stream
            return cls(cp, device_id, cp.cuda.ExternalStream(ptr, device_id))
        with cp.cuda.Device(device_id):      # CuPy keeps one current stream per device
            return cls(cp, device_id, cp.cuda.get_current_stream())

    @contextlib.contextmanager
    def active(self):
        """Make the GPU and the stream current in this thread: device allocations, DLPack
        imports and the backend's NCCL calls then happen there. (CuPy requires the stream's
        device to be current when the stream is entered.)"""
        with self.cp.cuda.Device(self.device_id), self.stream:
            yield


def _active(dev: _Cuda | None):
    """``dev.active()``, or nothing for a host backend."""
    return contextlib.nullcontext() if dev is None else dev.active()


class _Arr:
    """A user array as the backend sees it.

    * ``flat``: the 1-D C-contiguous buffer handed to the backend: numpy in host memory, or (when
      ``dev`` is set) a CuPy array on ``dev``'s GPU. It shares memory with ``orig`` unless
      ``staged``.
    * ``orig``: what the call returns for this buffer (the user's array for in place / ``out=``, a
      new array for ``out=None``); None only for a staged result :func:`_finish` creates.
    * ``kind``: numpy, torch, cupy or dlpack (:func:`_kind`); ``tag``: the hpcring dtype;
      ``shape``: the user-visible shape.
    * ``staged``: ``flat`` is a host copy of device memory (host backend), so results must be
      copied back by :func:`_finish`.
    """

    __slots__ = ("orig", "kind", "flat", "tag", "shape", "staged", "dev")

    def __init__(self, orig, kind: str, buf, tag: str, shape, staged: bool = False,
                 dev: _Cuda | None = None) -> None:
        self.orig, self.kind, self.tag = orig, kind, tag
        # flattened once: in-place calls then hand the backend the same object twice
        self.flat = buf if buf.ndim == 1 else buf.reshape(-1)
        self.shape, self.staged, self.dev = tuple(shape), staged, dev


def _kind(x) -> str:
    mod = type(x).__module__ or ""
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    return "other"


_DT2TAG = {np.dtype(v): k for k, v in _NP_DTYPES.items()}


def _np_dtype(tag: str):
    """Storage dtype of an hpcring dtype (bfloat16 is uint16 bits)."""
    return np.uint16 if tag == "bfloat16" else _NP_DTYPES[tag]


def _tag_buffer(a, dtype: str | None, what: str):
    """(a, or a uint16 view for bfloat16; hpcring dtype) for a numpy or CuPy array ``a``
    (both carry numpy dtypes); ``dtype`` is the caller's explicit ``dtype=``."""
    if dtype is None:
        tag = _DT2TAG.get(a.dtype)
        if tag is not None:                      # fast path: a supported numpy dtype
            return a, tag
    name = a.dtype.name
    if name == "bfloat16":                       # ml_dtypes
        return a.view(np.uint16), "bfloat16"
    if dtype is not None:
        if dtype == "bfloat16":
            if a.dtype.itemsize != 2 or a.dtype.kind not in "ui":
                raise UsageError(f"{what}: dtype='bfloat16' needs 2-byte integer storage (uint16), got {name}")
            return a.view(np.uint16), "bfloat16"
        if dtype != name:
            raise UsageError(f"{what}: dtype={dtype!r} does not match the array's dtype {name}")
    if name not in _NP_DTYPES:
        raise UsageError(f"{what}: unsupported dtype {name}; supported: {', '.join(DTYPES)}",
                         hint="convert first (x.astype(np.float32)), or pass uint16 storage with dtype='bfloat16'")
    return a, name


def _is_cuda(x, kind: str) -> bool:
    """True when ``x`` lives in CUDA memory (CuPy array, CUDA torch tensor, CUDA DLPack object)."""
    if kind == "cupy":
        return True
    if kind == "torch":
        return x.device.type == "cuda"
    if kind == "dlpack" and hasattr(x, "__dlpack_device__"):
        try:
            return x.__dlpack_device__()[0] in (_KDL_CUDA, _KDL_CUDA_MANAGED)
        except Exception:  # noqa: BLE001 - a broken exporter is reported by the host path
            return False
    return False


def _adapt(x, dtype: str | None, what: str, *, writable: bool, dev: _Cuda | None = None) -> _Arr:
    """``x`` as a backend buffer (:class:`_Arr`). ``writable``: the backend writes into ``x`` (in
    place / ``out=``), so no copy may stand in for it. ``dev`` (a cuda backend's context, already
    active): CUDA arrays are viewed in place on its GPU; without it (host backend) they are
    copied to host memory. Host arrays are viewed without a copy (copied only when a read-only
    input is not contiguous) and are staged by the device backend itself."""
    if type(x) is np.ndarray and dtype is None and x.flags.c_contiguous:   # fast path
        tag = _DT2TAG.get(x.dtype)
        if tag is not None and (not writable or x.flags.writeable):
            return _Arr(x, "numpy", x, tag, x.shape)
    kind = _kind(x)
    if dev is not None and _is_cuda(x, kind):
        return _adapt_device(x, kind, dtype, what, writable, dev)
    return _adapt_host(x, kind, dtype, what, writable)


def _adapt_host(x, kind: str, dtype: str | None, what: str, writable: bool) -> _Arr:
    """A host view of ``x``; CuPy arrays and CUDA tensors are copied to host (``staged``)."""
    staged = False
    if kind == "numpy":
        host = x
    elif kind == "torch":
        import torch  # only when a tensor was passed
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
            staged = True
        if writable and not staged and not t.is_contiguous():
            raise UsageError(f"{what}: the tensor must be contiguous to be written in place")
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            host = np.from_dlpack(t.view(torch.int16)).view(np.uint16)
            dtype = "bfloat16"
        else:
            host = np.from_dlpack(t)
        host, tag = _tag_buffer(host, dtype, what)
        return _Arr(x, kind, host, tag, x.shape, staged)
    elif kind == "cupy":
        host = x.get()
        staged = True
    elif kind == "dlpack":
        try:
            host = np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError) as e:
            raise UsageError(f"{what}: cannot view {type(x).__name__} through DLPack: {e}") from None
    else:
        raise UsageError(f"{what}: expected a numpy array, torch tensor or CuPy array, got {type(x).__name__}")
    if not host.flags.c_contiguous:
        if writable and not staged:
            raise UsageError(f"{what}: the array must be C-contiguous to be written in place")
        host = np.ascontiguousarray(host)
    if writable and not host.flags.writeable:
        raise UsageError(f"{what}: the array is read-only")
    host, tag = _tag_buffer(host, dtype, what)
    return _Arr(x, kind, host, tag, getattr(x, "shape", host.shape), staged)


def _adapt_device(x, kind: str, dtype: str | None, what: str, writable: bool, dev: _Cuda) -> _Arr:
    """A CuPy view of the CUDA array ``x`` on ``dev``'s GPU, sharing its memory: CuPy arrays as
    they are, torch tensors and other CUDA DLPack objects through ``cupy.from_dlpack``
    (bfloat16 tensors as their int16 bits: CuPy has no bfloat16). A non-contiguous read-only
    input is copied on the device; a non-contiguous ``writable`` one is refused."""
    cp = dev.cp
    if kind == "torch":
        import torch
        t = x.detach()          # DLPack refuses tensors that require grad
        if not t.is_contiguous():
            if writable:
                raise UsageError(f"{what}: the tensor must be contiguous to be written in place")
            t = t.contiguous()  # on torch's current stream, which this call runs on
        if t.dtype == torch.bfloat16:
            t, dtype = t.view(torch.int16), "bfloat16"
        buf = _from_dlpack(cp, t, what)
    elif kind == "cupy":
        buf = x
    else:
        buf = _from_dlpack(cp, x, what)
    if int(buf.device.id) != dev.device_id:
        raise UsageError(f"{what} is on GPU {int(buf.device.id)} but this communicator uses GPU {dev.device_id}",
                         hint=f"move it first: tensor.to('cuda:{dev.device_id}'), or cupy.asarray(x) "
                              f"under cupy.cuda.Device({dev.device_id})")
    if not buf.flags.c_contiguous:
        if writable:
            raise UsageError(f"{what}: the array must be C-contiguous to be written in place")
        buf = cp.ascontiguousarray(buf)
    buf, tag = _tag_buffer(buf, dtype, what)
    return _Arr(x, kind, buf, tag, getattr(x, "shape", buf.shape), dev=dev)


def _from_dlpack(cp, x, what: str):
    """``cupy.from_dlpack(x)`` (zero copy; the exporter orders its stream before CuPy's current
    one), with export failures as UsageError."""
    try:
        return cp.from_dlpack(x)
    except (TypeError, ValueError, RuntimeError, BufferError, NotImplementedError) as e:
        raise UsageError(f"{what}: cannot view {type(x).__name__} on the GPU through DLPack: {e}") from None


def _new_like(a: _Arr, shape) -> _Arr:
    """A fresh result for input ``a``: its kind and dtype, the given ``shape``. For a device
    input, a new CuPy array / CUDA tensor on ``a.dev``'s GPU; for a staged input, a host buffer
    (:func:`_finish` creates the device result); else a numpy array / CPU tensor."""
    if a.dev is not None:
        return _new_device(a, shape)
    host = np.empty(shape, dtype=_np_dtype(a.tag))
    if a.kind == "torch" and not a.staged:
        import torch
        t = torch.from_numpy(host.view(np.int16) if a.tag == "bfloat16" else host)
        if a.tag == "bfloat16":
            t = t.view(torch.bfloat16)
        return _Arr(t, "torch", host, a.tag, shape)
    if a.kind in ("torch", "cupy"):
        return _Arr(None, a.kind, host, a.tag, shape, staged=True)
    return _Arr(host, "numpy", host, a.tag, shape)


def _new_device(a: _Arr, shape) -> _Arr:
    """Device result for :func:`_new_like`: torch inputs get a torch tensor (torch's allocator,
    torch.bfloat16 for bfloat16), anything else a CuPy array (uint16 for bfloat16); allocated on
    ``a.dev``'s GPU and stream."""
    dev = a.dev
    with dev.active():
        if a.kind == "torch":
            import torch
            t = torch.empty(shape, dtype=getattr(torch, a.tag), device=torch.device("cuda", dev.device_id))
            return _adapt_device(t, "torch", None, "result", True, dev)
        arr = dev.cp.empty(shape, dtype=_np_dtype(a.tag))
        return _Arr(arr, "cupy", arr, a.tag, shape, dev=dev)


def _finish(res: _Arr, like: _Arr):
    """The call's result in the caller's type. Unless ``res`` is staged the backend wrote into
    ``res.orig``'s memory and that object is returned; a staged (host-backend, device) result is
    copied back to the device: into ``res.orig`` for in place / ``out=``, else into a new array
    on the device of the input ``like``."""
    if not res.staged:
        return res.orig
    host = res.flat.reshape(res.shape)
    target = res.orig if res.orig is not None else like.orig     # whose device the result is on
    if res.kind == "torch":
        import torch
        t = torch.from_numpy(np.ascontiguousarray(host.view(np.int16) if res.tag == "bfloat16" else host))
        if res.tag == "bfloat16":
            t = t.view(torch.bfloat16)
        t = t.to(target.device)
        if res.orig is not None:       # out= on a device: write through
            res.orig.copy_(t)
            return res.orig
        return t
    import cupy
    if res.orig is not None:
        res.orig.set(host.view(res.orig.dtype) if res.tag == "bfloat16" else host)
        return res.orig
    with target.device:
        return cupy.asarray(host)


def _check_out(out: _Arr, x: _Arr, count: int, op: str) -> None:
    if out.tag != x.tag:
        raise UsageError(f"{op}: out has dtype {out.tag} but the input is {x.tag}")
    if out.flat.size != count:
        raise UsageError(f"{op}: out has {out.flat.size} elements (shape {out.shape}), need {count}")


def _fuse(members: list[_Arr], dev: _Cuda | None):
    """One contiguous buffer of the members' elements for a grouped allreduce: on the GPU
    (``cupy.concatenate``, host members uploaded) when any member is a device buffer, else in
    host memory."""
    if dev is not None and any(m.dev is not None for m in members):
        cp = dev.cp
        return cp.concatenate([m.flat if m.dev is not None else cp.asarray(m.flat) for m in members])
    return np.concatenate([m.flat for m in members])


def _store(dst: _Arr, piece) -> None:
    """Copy ``piece`` (a slice of the fused buffer) into ``dst.flat`` across memory kinds."""
    if dst.dev is None and not isinstance(piece, np.ndarray):
        dst.flat[...] = piece.get()     # device fuse -> host member: blocking copy on this stream
    else:
        dst.flat[...] = piece


def _check_op(op: str, tag: str, what: str) -> None:
    if op not in OPS:
        raise UsageError(f"{what}: unsupported op {op!r}; supported: {', '.join(OPS)}")
    if op == "avg" and tag not in FLOAT_DTYPES:
        raise UsageError(f"{what}: op 'avg' needs a floating-point dtype, got {tag}",
                         hint="use op='sum' and divide, or convert to float")


# ---------------------------------------------------------------------------------------------
# pre-collective check (HPCRING_CHECK_COLLECTIVES=1)
# ---------------------------------------------------------------------------------------------
_OP_NAMES = ("allreduce", "allreduce_grouped", "allgather", "broadcast", "reduce_scatter", "alltoall", "barrier")


def precheck_default() -> bool:
    """HPCRING_CHECK_COLLECTIVES=1 (or true/yes/on) turns the pre-collective check on."""
    from hpcring.config.envvars import get
    return get("HPCRING_CHECK_COLLECTIVES")


def signature_code(rec: Record) -> tuple[int, int, int, int, int]:
    """(op, dtype, count, root, seq) as integers; -1 for "none"."""
    dtype = DTYPES.index(rec.dtype) if rec.dtype in DTYPES else (-1 if rec.dtype is None else 100 + len(rec.dtype))
    return (_OP_NAMES.index(rec.op), dtype, rec.count, -1 if rec.root is None else rec.root, rec.seq)


def _describe_code(row: tuple) -> str:
    op, dtype, count, root, seq = row
    parts = [f"count={count}"]
    if 0 <= dtype < len(DTYPES):
        parts.append(f"dtype={DTYPES[dtype]}")
    if root >= 0:
        parts.append(f"root={root}")
    return f"{_OP_NAMES[op]}#{seq}({', '.join(parts)})"


def precheck_message(seq: int, rows: list[tuple]) -> str:
    """'pre-collective check before collective #5 failed: ranks 0-4 called ...; rank 5 called ...'."""
    from hpcring.diagnostics.report import rank_ranges
    groups: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    parts = [f"{'rank' if len(rs) == 1 else 'ranks'} {rank_ranges(rs)} called {_describe_code(row)}"
             for row, rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    return f"pre-collective check (HPCRING_CHECK_COLLECTIVES) before collective #{seq} failed: " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# async machinery
# ---------------------------------------------------------------------------------------------
class Handle:
    """The pending result of an ``*_async`` call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _set(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None):
        """Block until the operation finished and return its result (or raise its error).
        ``timeout`` (seconds) bounds the wait itself: CollectiveError if still running."""
        if not self._event.wait(timeout):
            raise CollectiveError(f"{self.name} did not finish within {timeout:.1f} s (still running)",
                                  hint="the operation keeps its own deadline; wait again or raise it")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        """The error of a finished operation, or None."""
        return self._error if self._event.is_set() else None


class _Worker:
    """One thread per communicator executing submitted operations in order."""

    def __init__(self, name: str) -> None:
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, name: str, fn: Callable[[], Any]) -> Handle:
        h = Handle(name)
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._q.put((h, fn))
        return h

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            h, fn = item
            try:
                h._set(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                h._set(error=e)
            finally:
                with self._lock:
                    self._pending -= 1

    def stop(self) -> None:
        with self._lock:
            t = self._thread
            self._thread = None
        if t is not None:
            self._q.put(None)
            t.join(timeout=5.0)


# ---------------------------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------------------------
class Communicator:
    """Collectives over a :class:`~hpcring.collectives.backends.Backend`."""

    def __init__(self, backend: Backend, *, timeout: float | None = None, watchdog=None) -> None:
        from hpcring.config.envvars import collective_timeout
        self.backend = backend
        self.timeout = collective_timeout(timeout)
        if self.timeout <= 0:
            raise UsageError(f"timeout must be > 0, got {timeout}")
        self._worker = _Worker(f"hpcring-comm:{backend.rank}")
        self.recorder = FlightRecorder(backend.rank, backend.size, backend.name)
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.register(self)
        self.precheck = precheck_default()

    @classmethod
    def create(cls, topology, store, secret: bytes | str, *, timeout: float | None = None,
               backend: str = "ring", watchdog=None, **backend_options) -> "Communicator":
        """Communicator for ``topology`` on ``backend`` ("ring": address exchange through
        ``store``; "mpi": MPI_COMM_WORLD via mpi4py; "nccl": unique id through ``store``).
        ``watchdog`` (:class:`hpcring.diagnostics.watchdog.Watchdog`) turns failures into a
        job-wide report."""
        if backend == "ring":
            from hpcring.collectives.ring import RingBackend as impl
        elif backend == "mpi":
            from hpcring.collectives.mpi import MpiBackend as impl
        elif backend == "nccl":
            from hpcring.collectives.nccl import NcclBackend as impl
        else:
            raise UsageError(f"unknown backend {backend!r}; choose one of ring, mpi, nccl")
        be = impl.create(topology, store, secret, timeout, **backend_options)
        return cls(be, timeout=timeout, watchdog=watchdog)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def error(self) -> str | None:
        return self.backend.error

    def close(self) -> None:
        self._worker.stop()
        self.backend.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- execution ------------------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if t <= 0:
            raise UsageError(f"timeout must be > 0, got {timeout}")
        return t

    def _record(self, op: str, dtype: str | None, count: int, root: int | None, timeout: float) -> Record:
        return self.recorder.queue(op, dtype, count, root, timeout)

    def _run(self, rec: Record, fn: Callable[[], Any], is_async: bool):
        def execute():
            FlightRecorder.start(rec)
            try:
                if self.precheck and self.size > 1:
                    self._precheck(rec)
                result = fn()
            except CollectiveError as e:
                FlightRecorder.finish(rec, e)
                if self.watchdog is not None:
                    raise self.watchdog.on_failure(self, rec, e) from None
                raise
            except BaseException as e:
                FlightRecorder.finish(rec, e)
                raise
            FlightRecorder.finish(rec)
            return result
        name = f"{rec.op}#{rec.seq}"
        if is_async:
            return self._worker.submit(name, execute)
        if self._worker.pending:
            return self._worker.submit(name, execute).wait()
        return execute()

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

    def _cuda(self, *arrays) -> _Cuda | None:
        """For a ``device == "cuda"`` backend: its GPU and the caller's stream for this call
        (torch's current stream when any of ``arrays`` is a CUDA torch tensor, else CuPy's);
        None for a host backend (device arrays are then staged through host memory)."""
        be = self.backend
        if getattr(be, "device", "cpu") != "cuda":
            return None
        cp = getattr(be, "array_module", None)
        if cp is None:
            import cupy as cp
        torch_stream = any(_kind(x) == "torch" and x.device.type == "cuda" for x in arrays)
        return _Cuda.capture(cp, int(getattr(be, "device_id", 0)), torch_stream=torch_stream)

    # -- allreduce --------------------------------------------------------------------------
    def _allreduce(self, x, op, out, timeout, dtype, is_async):
        dev = self._cuda(x, out)
        with _active(dev):
            a = _adapt(x, dtype, "allreduce input", writable=out is x, dev=dev)
            _check_op(op, a.tag, "allreduce")
            t = self._deadline(timeout)
            if out is x:
                res = a
            elif out is None:
                res = _new_like(a, a.shape)
            else:
                res = _adapt(out, dtype if a.tag != "bfloat16" else "bfloat16", "allreduce out", writable=True,
                             dev=dev)
                _check_out(res, a, a.flat.size, "allreduce")

        def run():
            with _active(dev):
                self.backend.allreduce(a.flat, res.flat, a.tag, op, t)
                return _finish(res, a)
        return self._run(self._record("allreduce", a.tag, a.flat.size, None, t), run, is_async)

    def allreduce(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                  dtype: str | None = None):
        """Element-wise ``op`` over all ranks' ``x``; returns ``out`` (a new array when None;
        ``out=x`` for in place). Identical on all ranks."""
        return self._allreduce(x, op, out, timeout, dtype, False)

    def allreduce_async(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                        dtype: str | None = None) -> Handle:
        """Like :meth:`allreduce`, queued on the communicator's worker; ``x`` and ``out`` must
        not be touched until the handle is done."""
        return self._allreduce(x, op, out, timeout, dtype, True)

    def _allreduce_grouped(self, arrays, op, timeout, inplace, is_async):
        dev = self._cuda(*arrays)
        with _active(dev):
            arrs = [_adapt(x, None, f"allreduce_grouped input {i}", writable=inplace, dev=dev)
                    for i, x in enumerate(arrays)]
        for a in arrs:
            _check_op(op, a.tag, "allreduce_grouped")
        t = self._deadline(timeout)
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrs):
            groups.setdefault(a.tag, []).append(i)

        def run():
            results: list[Any] = [None] * len(arrs)
            with _active(dev):
                for tag in sorted(groups, key=DTYPES.index):      # same order on every rank
                    idx = groups[tag]
                    fused = _fuse([arrs[i] for i in idx], dev)
                    self.backend.allreduce(fused, fused, tag, op, t)
                    pos = 0
                    for i in idx:
                        a = arrs[i]
                        n = a.flat.size
                        r = a if inplace else _new_like(a, a.shape)
                        _store(r, fused[pos:pos + n])
                        results[i] = _finish(r, a)
                        pos += n
            return results
        count = sum(a.flat.size for a in arrs)
        tags = "+".join(sorted(groups, key=DTYPES.index))
        return self._run(self._record("allreduce_grouped", tags, count, None, t), run, is_async)

    def allreduce_grouped(self, arrays: Sequence, op: str = "sum", *, timeout: float | None = None,
                          inplace: bool = False) -> list:
        """Allreduce many arrays as one fused buffer per dtype (one collective per dtype, in a
        fixed dtype order); returns the results in input order (the inputs themselves when
        ``inplace``)."""
        return self._allreduce_grouped(list(arrays), op, timeout, inplace, False)

    def allreduce_grouped_async(self, arrays: Sequence, op: str = "sum", *,
                                timeout: float | None = None, inplace: bool = False) -> Handle:
        return self._allreduce_grouped(list(arrays), op, timeout, inplace, True)

    # -- allgather ------------------------------------------------------------------------
    def _allgather(self, x, out, timeout, dtype, is_async):
        dev = self._cuda(x, out)
        with _active(dev):
            a = _adapt(x, dtype, "allgather input", writable=False, dev=dev)
            t = self._deadline(timeout)
            shape = (self.size, *a.shape)
            if out is None:
                res = _new_like(a, shape)
            else:
                res = _adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "allgather out", writable=True,
                             dev=dev)
                _check_out(res, a, a.flat.size * self.size, "allgather")

        def run():
            with _active(dev):
                self.backend.allgather(a.flat, res.flat, a.tag, t)
                return _finish(res, a)
        return self._run(self._record("allgather", a.tag, a.flat.size, None, t), run, is_async)

    def allgather(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None):
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)`` (``out`` may have
        any shape with that many elements)."""
        return self._allgather(x, out, timeout, dtype, False)

    def allgather_async(self, x, out=None, *, timeout: float | None = None,
                        dtype: str | None = None) -> Handle:
        return self._allgather(x, out, timeout, dtype, True)

    # -- broadcast ------------------------------------------------------------------------
    def _broadcast(self, x, root, timeout, dtype, is_async):
        if not (0 <= root < self.size):
            raise UsageError(f"broadcast: root {root} out of range for {self.size} ranks")
        dev = self._cuda(x)
        with _active(dev):
            a = _adapt(x, dtype, "broadcast buffer", writable=True, dev=dev)
        t = self._deadline(timeout)

        def run():
            with _active(dev):
                self.backend.broadcast(a.flat, root, a.tag, t)
                return _finish(a, a)
        return self._run(self._record("broadcast", a.tag, a.flat.size, root, t), run, is_async)

    def broadcast(self, x, root: int = 0, *, timeout: float | None = None, dtype: str | None = None):
        """In place: ``x`` on every rank becomes root's ``x`` (same shape and dtype everywhere);
        returns ``x``."""
        return self._broadcast(x, root, timeout, dtype, False)

    def broadcast_async(self, x, root: int = 0, *, timeout: float | None = None,
                        dtype: str | None = None) -> Handle:
        return self._broadcast(x, root, timeout, dtype, True)

    # -- reduce_scatter -------------------------------------------------------------------
    def _reduce_scatter(self, x, op, out, timeout, dtype, is_async):
        dev = self._cuda(x, out)
        with _active(dev):
            a = _adapt(x, dtype, "reduce_scatter input", writable=False, dev=dev)
            _check_op(op, a.tag, "reduce_scatter")
            t = self._deadline(timeout)
            n = a.flat.size
            mine = chunk_counts(n, self.size)[self.rank]
            if len(a.shape) >= 1 and a.shape[0] % self.size == 0:
                shape = (a.shape[0] // self.size, *a.shape[1:])
            else:
                shape = (mine,)
            if out is None:
                res = _new_like(a, shape)
            else:
                res = _adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "reduce_scatter out",
                             writable=True, dev=dev)
                _check_out(res, a, mine, "reduce_scatter")

        def run():
            with _active(dev):
                self.backend.reduce_scatter(a.flat, res.flat, a.tag, op, t)
                return _finish(res, a)
        return self._run(self._record("reduce_scatter", a.tag, n, None, t), run, is_async)

    def reduce_scatter(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                       dtype: str | None = None):
        """This rank's share of the element-wise ``op`` over ranks. When ``x.shape[0]`` is
        divisible by the world size the result has shape ``(x.shape[0] // size, *x.shape[1:])``
        (rank r gets rows r*k .. r*k+k-1); otherwise ``x`` is flattened and rank r gets
        ``len // size + (r < len % size)`` consecutive elements."""
        return self._reduce_scatter(x, op, out, timeout, dtype, False)

    def reduce_scatter_async(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                             dtype: str | None = None) -> Handle:
        return self._reduce_scatter(x, op, out, timeout, dtype, True)

    # -- alltoall -------------------------------------------------------------------------
    def _alltoall(self, x, out, timeout, dtype, is_async):
        dev = self._cuda(x, out)
        with _active(dev):
            a = _adapt(x, dtype, "alltoall input", writable=out is x, dev=dev)
            t = self._deadline(timeout)
            if a.flat.size % self.size:
                raise UsageError(f"alltoall: {a.flat.size} elements cannot be split into {self.size} equal blocks")
            if out is x:
                res = a
            elif out is None:
                res = _new_like(a, a.shape)
            else:
                res = _adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "alltoall out", writable=True,
                             dev=dev)
                _check_out(res, a, a.flat.size, "alltoall")

        def run():
            with _active(dev):
                self.backend.alltoall(a.flat, res.flat, a.tag, t)
                return _finish(res, a)
        return self._run(self._record("alltoall", a.tag, a.flat.size, None, t), run, is_async)

    def alltoall(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None):
        """Block j (of ``size`` equal blocks of the flattened ``x``) goes to rank j; block i of
        the result came from rank i. Result has ``x``'s shape; ``out=x`` works in place."""
        return self._alltoall(x, out, timeout, dtype, False)

    def alltoall_async(self, x, out=None, *, timeout: float | None = None,
                       dtype: str | None = None) -> Handle:
        return self._alltoall(x, out, timeout, dtype, True)

    # -- barrier --------------------------------------------------------------------------
    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        t = self._deadline(timeout)
        return self._run(self._record("barrier", None, 0, None, t), lambda: self.backend.barrier(t), False)

    def barrier_async(self, *, timeout: float | None = None) -> Handle:
        t = self._deadline(timeout)
        return self._run(self._record("barrier", None, 0, None, t), lambda: self.backend.barrier(t), True)


__all__ = ["Communicator", "Handle", "HpcringError"]
