"""Array adaptation for the Communicator: numpy arrays, torch tensors (DLPack), CuPy arrays and
other DLPack objects as the 1-D contiguous buffers a backend moves, and results back in the
caller's type.

Host memory goes to the backend without copies (numpy views, DLPack for torch CPU tensors).
Device memory is staged through host memory for a host backend (ring, mpi). A device backend
(``backend.device == "cuda"``, NCCL) receives device memory without copies: CuPy arrays as flat
views, CUDA torch tensors (and other CUDA DLPack objects) through ``cupy.from_dlpack``; results are
new CuPy arrays / CUDA tensors on the backend's GPU (or ``out``/``x`` itself), made on the caller's
stream (:class:`CudaContext`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from hpcring.collectives.dtypes import BY_NAME, DTYPES, FLOAT_DTYPES, OPS, TABLE
from hpcring.errors import UsageError

# the numpy types that name an hpcring dtype by themselves (a uint16 array is bfloat16 only when asked)
_NP_DTYPES = {d.name: np.dtype(d.storage).type for d in TABLE if d.storage == d.name}


_KDL_CUDA, _KDL_CUDA_MANAGED = 2, 13     # DLPack device types a CUDA backend can use in place


class CudaContext:
    """One call's device context for a ``device == "cuda"`` backend: the backend's CuPy module,
    its GPU (``device_id``) and the stream the call runs on.

    Captured in the calling thread when the call is submitted, because CuPy's current device and
    stream (and torch's current stream) are per thread and the call may run on the
    communicator's worker thread (``*_async``, or a synchronous call queued behind them)."""

    __slots__ = ("cp", "device_id", "stream")

    def __init__(self, cp, device_id: int, stream) -> None:
        self.cp, self.device_id, self.stream = cp, device_id, stream

    @classmethod
    def capture(cls, cp, device_id: int, *, torch_stream: bool) -> "CudaContext":
        """The caller's current stream on ``device_id``: torch's (wrapped as a CuPy stream, so
        the backend's work is ordered after the kernels that produced the tensors and before
        later work on that stream) when ``torch_stream``, else CuPy's."""
        if torch_stream:
            import torch
            return cls(cp, device_id, _cupy_stream(cp, torch.cuda.current_stream(device_id), device_id))
        return cls(cp, device_id, cp.cuda.get_current_stream(device_id))   # one per device and thread

    def active(self) -> "_Active":
        """Make the GPU and the stream current in this thread: device allocations, DLPack
        imports and the backend's NCCL calls then happen there. (CuPy requires the stream's
        device to be current when the stream is entered.) Re-entrant at no cost."""
        return _Active(self)


_THREAD = threading.local()


class _Active:
    """Context manager of :meth:`CudaContext.active` (a class: a generator-based one costs more than
    the rest of a small device collective); entering it again inside itself does nothing."""

    __slots__ = ("dev", "outer", "ctx")

    def __init__(self, dev: CudaContext) -> None:
        self.dev, self.outer, self.ctx = dev, False, None

    def __enter__(self):
        if getattr(_THREAD, "dev", None) is self.dev:
            return self
        self.outer = True
        dev = self.dev
        self.ctx = (dev.cp.cuda.Device(dev.device_id), dev.stream)
        self.ctx[0].__enter__()
        try:
            self.ctx[1].__enter__()
        except BaseException:
            self.ctx[0].__exit__(None, None, None)
            raise
        _THREAD.dev = dev
        return self

    def __exit__(self, *exc):
        if self.outer:
            _THREAD.dev = None
            try:
                self.ctx[1].__exit__(*exc)
            finally:
                self.ctx[0].__exit__(*exc)
        return False


_WRAPPED: dict[tuple[int, int, int], Any] = {}     # (CuPy module, stream ptr, device) -> CuPy stream


def _cupy_stream(cp, torch_stream, device_id: int):
    """A CuPy view of a torch CUDA stream, made once per stream (wrapping costs more than the
    rest of a small collective). CuPy >= 14: ``Stream.from_external`` (the CUDA stream protocol);
    older CuPy: ``ExternalStream(ptr, device)``."""
    key = (id(cp), int(torch_stream.cuda_stream), device_id)
    s = _WRAPPED.get(key)
    if s is None:
        from_external = getattr(cp.cuda.Stream, "from_external", None)
        if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
            s = from_external(torch_stream)
        else:
            s = cp.cuda.ExternalStream(key[1], device_id)
        if len(_WRAPPED) > 256:          # streams come and go (torch.cuda.Stream()): stay bounded
            _WRAPPED.clear()
        _WRAPPED[key] = s
    return s


def active_dev() -> CudaContext | None:
    """The CudaContext this thread is inside (its GPU and stream current), or None."""
    return getattr(_THREAD, "dev", None)


def active_on(dev: CudaContext | None):
    """``dev.active()``, or nothing for a host backend."""
    return contextlib.nullcontext() if dev is None else dev.active()


class Arr:
    """A user array as the backend sees it.

    * ``flat``: the 1-D C-contiguous buffer handed to the backend: numpy in host memory, or (when
      ``dev`` is set) a CuPy array on ``dev``'s GPU. It shares memory with ``orig`` unless
      ``staged``.
    * ``orig``: what the call returns for this buffer (the user's array for in place / ``out=``, a
      new array for ``out=None``); None only for a staged result :func:`finish` creates.
    * ``kind``: numpy, torch, cupy or dlpack (:func:`kind_of`); ``tag``: the hpcring dtype;
      ``shape``: the user-visible shape.
    * ``staged``: ``flat`` is a host copy of device memory (host backend), so results must be
      copied back by :func:`finish`.
    """

    __slots__ = ("orig", "kind", "flat", "tag", "shape", "staged", "dev")

    def __init__(self, orig, kind: str, buf, tag: str, shape, staged: bool = False,
                 dev: CudaContext | None = None) -> None:
        self.orig, self.kind, self.tag = orig, kind, tag
        # flattened once: in-place calls then hand the backend the same object twice
        self.flat = buf if buf.ndim == 1 else buf.reshape(-1)
        self.shape, self.staged, self.dev = tuple(shape), staged, dev


def kind_of(x) -> str:
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


def storage_dtype(tag: str):
    """Storage dtype of an hpcring dtype (bfloat16 is uint16 bits)."""
    return np.dtype(BY_NAME[tag].storage).type


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


def adapt(x, dtype: str | None, what: str, *, writable: bool, dev: CudaContext | None = None) -> Arr:
    """``x`` as a backend buffer (:class:`Arr`). ``writable``: the backend writes into ``x`` (in
    place / ``out=``), so no copy may stand in for it. ``dev`` (a cuda backend's context, already
    active): CUDA arrays are viewed in place on its GPU; without it (host backend) they are
    copied to host memory. Host arrays are viewed without a copy (copied only when a read-only
    input is not contiguous) and are staged by the device backend itself."""
    if type(x) is np.ndarray and dtype is None and x.flags.c_contiguous:   # fast path
        tag = _DT2TAG.get(x.dtype)
        if tag is not None and (not writable or x.flags.writeable):
            return Arr(x, "numpy", x, tag, x.shape)
    kind = kind_of(x)
    if dev is not None and _is_cuda(x, kind):
        return _adapt_device(x, kind, dtype, what, writable, dev)
    return _adapt_host(x, kind, dtype, what, writable)


def _adapt_host(x, kind: str, dtype: str | None, what: str, writable: bool) -> Arr:
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
        return Arr(x, kind, host, tag, x.shape, staged)
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
    return Arr(x, kind, host, tag, getattr(x, "shape", host.shape), staged)


def _adapt_device(x, kind: str, dtype: str | None, what: str, writable: bool, dev: CudaContext) -> Arr:
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
    return Arr(x, kind, buf, tag, getattr(x, "shape", buf.shape), dev=dev)


def _from_dlpack(cp, x, what: str):
    """``cupy.from_dlpack(x)`` (zero copy; the exporter orders its stream before CuPy's current
    one), with export failures as UsageError."""
    try:
        return cp.from_dlpack(x)
    except (TypeError, ValueError, RuntimeError, BufferError, NotImplementedError) as e:
        raise UsageError(f"{what}: cannot view {type(x).__name__} on the GPU through DLPack: {e}") from None


def new_like(a: Arr, shape) -> Arr:
    """A fresh result for input ``a``: its kind and dtype, the given ``shape``. For a device
    input, a new CuPy array / CUDA tensor on ``a.dev``'s GPU; for a staged input, a host buffer
    (:func:`finish` creates the device result); else a numpy array / CPU tensor."""
    if a.dev is not None:
        return _new_device(a, shape)
    host = np.empty(shape, dtype=storage_dtype(a.tag))
    if a.kind == "torch" and not a.staged:
        import torch
        t = torch.from_numpy(host.view(np.int16) if a.tag == "bfloat16" else host)
        if a.tag == "bfloat16":
            t = t.view(torch.bfloat16)
        return Arr(t, "torch", host, a.tag, shape)
    if a.kind in ("torch", "cupy"):
        return Arr(None, a.kind, host, a.tag, shape, staged=True)
    return Arr(host, "numpy", host, a.tag, shape)


def _new_device(a: Arr, shape) -> Arr:
    """Device result for :func:`new_like`: torch inputs get a torch tensor (torch's allocator,
    torch.bfloat16 for bfloat16), anything else a CuPy array (uint16 for bfloat16); allocated on
    ``a.dev``'s GPU and stream."""
    dev = a.dev
    with dev.active():
        if a.kind == "torch":
            import torch
            t = torch.empty(shape, dtype=getattr(torch, a.tag), device=torch.device("cuda", dev.device_id))
            return _adapt_device(t, "torch", None, "result", True, dev)
        arr = dev.cp.empty(shape, dtype=storage_dtype(a.tag))
        return Arr(arr, "cupy", arr, a.tag, shape, dev=dev)


def finish(res: Arr, like: Arr):
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


def check_out(out: Arr, x: Arr, count: int, op: str) -> None:
    if out.tag != x.tag:
        raise UsageError(f"{op}: out has dtype {out.tag} but the input is {x.tag}")
    if out.flat.size != count:
        raise UsageError(f"{op}: out has {out.flat.size} elements (shape {out.shape}), need {count}")


def fuse(members: list[Arr], dev: CudaContext | None):
    """One contiguous buffer of the members' elements for a grouped allreduce: on the GPU
    (``cupy.concatenate``, host members uploaded) when any member is a device buffer, else in
    host memory."""
    if dev is not None and any(m.dev is not None for m in members):
        cp = dev.cp
        return cp.concatenate([m.flat if m.dev is not None else cp.asarray(m.flat) for m in members])
    return np.concatenate([m.flat for m in members])


def store_into(dst: Arr, piece) -> None:
    """Copy ``piece`` (a slice of the fused buffer) into ``dst.flat`` across memory kinds."""
    if dst.dev is None and not isinstance(piece, np.ndarray):
        dst.flat[...] = piece.get()     # device fuse -> host member: blocking copy on this stream
    else:
        dst.flat[...] = piece


def check_op(op: str, tag: str, what: str) -> None:
    if op not in OPS:
        raise UsageError(f"{what}: unsupported op {op!r}; supported: {', '.join(OPS)}")
    if op == "avg" and tag not in FLOAT_DTYPES:
        raise UsageError(f"{what}: op 'avg' needs a floating-point dtype, got {tag}",
                         hint="use op='sum' and divide, or convert to float")
