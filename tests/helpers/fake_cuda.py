"""Fake ``cupy``, ``torch`` and NCCL for testing the device-buffer path without a GPU.

"Device memory" is host memory owned by numpy arrays, so a fake NCCL can move real bytes by
address (``ctypes.memmove``) and tests can compare pointers. The fakes mimic what the real
libraries do where it matters for correctness:

* CuPy: current device and current stream are per thread, streams are per device, entering a
  stream whose device is not current raises, ``from_dlpack`` passes the current stream of the
  array's device to the exporter and refuses bfloat16 (CuPy has no such dtype), implicit
  conversion to numpy (``np.asarray(cupy_array)``) raises TypeError, ``a[...] = numpy`` raises.
  Every host<->device copy is counted; with ``host_copies_allowed = False`` any of them raises.
* torch: ``Tensor.cpu()`` of a CUDA tensor is a counted host copy; ``__dlpack__(stream=s)`` records
  whether ``s`` differs from torch's current stream (real torch then makes ``s`` wait on an
  event); tensors requiring grad refuse DLPack export.
* NCCL (``FakeNcclComm``): the given world size where every other rank holds the same data as
  this one ("mirror ranks"), so results are predictable; every pointer must lie inside a live
  fake device allocation on the communicator's GPU, and every call is recorded with its stream,
  the current device and the calling thread.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import types

import numpy as np
import pytest

SENTINEL = 0xA5                # fresh device allocations are filled with this byte


class HostCopy(AssertionError):
    """A host<->device copy happened where none is allowed."""


# ---------------------------------------------------------------------------------------------
# cupy
# ---------------------------------------------------------------------------------------------
def make_cupy(ngpus: int = 2):
    """A fresh fake ``cupy`` module (state: per-thread device/streams, copy counters, allocations)."""
    cp = types.ModuleType("cupy")
    cp.__fake__ = True
    cp.host_copies_allowed = True
    cp.h2d = 0
    cp.d2h = 0
    cp.allocations = []          # (device id, stream ptr, shape, dtype) of every new device buffer
    cp.concatenations = []       # number of pieces of every concatenate call
    cp.live = []                 # numpy arrays backing device memory: (array, device id)
    cp.gpu_busy = False          # while True, no event completes
    cp.event_queries = 0         # Event.done reads (cudaEventQuery)
    cp.stream_waits = []         # (stream ptr, event) of every Stream.wait_event
    tls = threading.local()

    def cur_dev() -> int:
        return getattr(tls, "devices", [0])[-1]

    def stacks() -> dict:
        if not hasattr(tls, "streams"):
            tls.streams = {}
        return tls.streams

    def host_copy(kind: str) -> None:
        if not cp.host_copies_allowed:
            raise HostCopy(f"{kind} copy while host copies are forbidden")
        setattr(cp, kind, getattr(cp, kind) + 1)

    class Device:
        __module__ = "cupy.cuda.device"

        def __init__(self, device=None):
            self.id = cur_dev() if device is None else int(device)
            if not 0 <= self.id < ngpus:
                raise RuntimeError(f"invalid device {self.id}")

        def __enter__(self):
            if not hasattr(tls, "devices"):
                tls.devices = [0]
            tls.devices.append(self.id)
            return self

        def __exit__(self, *exc):
            tls.devices.pop()

        def use(self):
            if not hasattr(tls, "devices"):
                tls.devices = [0]
            tls.devices[0] = self.id

        def __eq__(self, other):
            return isinstance(other, Device) and other.id == self.id

        def __hash__(self):
            return self.id

    class Stream:
        __module__ = "cupy.cuda.stream"

        def __init__(self, ptr: int = 0, device_id: int = -1):
            self.ptr, self.device_id = int(ptr), int(device_id)

        def __enter__(self):
            dev = cur_dev() if self.device_id == -1 else self.device_id
            if dev != cur_dev():        # cupy: check_stream_device_match
                raise RuntimeError(f"The device that the stream is created on ({self.device_id}) and "
                                   f"the current device ({cur_dev()}) are different")
            stacks().setdefault(dev, []).append(self)
            return self

        def __exit__(self, *exc):
            dev = cur_dev() if self.device_id == -1 else self.device_id
            stacks()[dev].pop()

        def synchronize(self):
            pass

        def __repr__(self):
            return f"<fake Stream {self.ptr:#x} on {self.device_id}>"

    null = Stream(0, -1)

    class ExternalStream(Stream):      # deprecated in CuPy 14 (Stream.from_external)
        pass

    def from_external(cls, obj):
        ptr, dev = obj.__cuda_stream__()[1], getattr(obj, "device_index", -1)
        return cls(ptr, dev)
    Stream.from_external = classmethod(from_external)

    def wait_event(self, event):
        cp.stream_waits.append((self.ptr, event))
    Stream.wait_event = wait_event

    def get_current_stream(device_id: int = -1):
        dev = cur_dev() if device_id == -1 else device_id
        st = stacks().get(dev)
        return st[-1] if st else null

    class Event:
        """Done unless ``cp.gpu_busy``: tests hold the "GPU" busy to see work still in flight."""

        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self.stream = None

        def record(self, stream=None):
            self.stream = stream

        @property
        def done(self):
            cp.event_queries += 1
            return not cp.gpu_busy

        def synchronize(self):
            if cp.gpu_busy:
                raise AssertionError("fake GPU held busy: Event.synchronize would block forever")

    class ndarray:
        __module__ = "cupy"

        def __init__(self, a: np.ndarray, device_id: int):
            self._a, self.device = a, Device(device_id)
            # stored once, as CuPy's ndarray holds its MemoryPointer and contiguity flag (cdef
            # attributes, read without a call): a property building them per read made every
            # read cost ~1 us, which per-call benchmarks then counted as hpcring's own cost
            self.data = types.SimpleNamespace(ptr=a.ctypes.data, device_id=device_id)
            self._c_contiguous = a.flags.c_contiguous
            cp.live.append((a, device_id))

        # -- attributes ------------------------------------------------------------------
        shape = property(lambda self: self._a.shape)
        ndim = property(lambda self: self._a.ndim)
        size = property(lambda self: self._a.size)
        dtype = property(lambda self: self._a.dtype)
        nbytes = property(lambda self: self._a.nbytes)
        flags = property(lambda self: types.SimpleNamespace(c_contiguous=self._a.flags.c_contiguous,
                                                            f_contiguous=self._a.flags.f_contiguous))

        # -- views and device-side copies ------------------------------------------------
        def reshape(self, *shape):
            return ndarray(self._a.reshape(*shape), self.device.id)

        def view(self, dtype):
            return ndarray(self._a.view(dtype), self.device.id)

        def copy(self):
            return ndarray(self._a.copy(), self.device.id)

        def astype(self, dtype):
            return ndarray(self._a.astype(dtype), self.device.id)

        def __getitem__(self, key):
            return ndarray(self._a[key], self.device.id)

        def __setitem__(self, key, value):
            if isinstance(value, (int, float, np.number)):      # a scalar fill, as CuPy takes it
                self._a[key] = value
                return
            if not isinstance(value, ndarray):
                raise TypeError(f"Unsupported type {type(value)} (fake cupy: no implicit host->device)")
            if value.device.id != self.device.id:
                raise RuntimeError("peer copy between devices in a fake __setitem__")
            self._a[key] = value._a

        def __array__(self, *a, **k):
            raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()`")

        # -- host copies -----------------------------------------------------------------
        def get(self, stream=None, order="C", out=None, blocking=True):
            host_copy("d2h")
            return self._a.copy()

        def set(self, arr, stream=None):
            host_copy("h2d")
            if arr.shape != self._a.shape:
                raise ValueError(f"Shape mismatch. Old shape: {self._a.shape}, new shape: {arr.shape}")
            self._a[...] = arr

        def __repr__(self):
            return f"fake_cupy({self._a!r}, device={self.device.id})"

    def _alloc(shape, dtype):
        a = np.empty(shape, dtype=dtype)
        a.reshape(-1).view(np.uint8)[...] = SENTINEL
        cp.allocations.append((cur_dev(), get_current_stream().ptr, tuple(a.shape), a.dtype))
        return ndarray(a, cur_dev())

    def empty(shape, dtype=np.float64):
        return _alloc(shape, dtype)

    def empty_like(x):
        return _alloc(x.shape, x.dtype)

    def ones(shape, dtype=np.float64):
        r = _alloc(shape, dtype)
        r._a[...] = 1
        return r

    def asarray(x):
        if isinstance(x, ndarray):
            return x
        host_copy("h2d")
        x = np.asarray(x)
        r = _alloc(x.shape, x.dtype)
        r._a[...] = x
        return r

    def asnumpy(x):
        return x.get()

    def ascontiguousarray(x):
        if x.flags.c_contiguous:
            return x
        r = _alloc(x.shape, x.dtype)
        r._a[...] = x._a
        return r

    def concatenate(arrays):
        arrays = list(arrays)
        for a in arrays:
            if not isinstance(a, ndarray):
                raise TypeError(f"Only cupy arrays can be concatenated, got {type(a)}")
            if a.device.id != cur_dev():
                raise RuntimeError("concatenate of an array on another device")
        cp.concatenations.append(len(arrays))
        r = _alloc((sum(a.size for a in arrays),), arrays[0].dtype)
        r._a[...] = np.concatenate([a._a.reshape(-1) for a in arrays])
        return r

    def from_dlpack(obj):
        dev_type, dev_id = obj.__dlpack_device__()
        if dev_type != 2:
            raise RuntimeError("fake cupy.from_dlpack: not CUDA memory")
        with Device(dev_id):                     # cupy selects the array's device ...
            ptr = get_current_stream().ptr or 1  # ... and hands its current stream to the exporter
        cap = obj.__dlpack__(stream=ptr)
        if cap.dtype_name == "bfloat16":
            raise TypeError("CuPy does not support bfloat16 (fake)")
        return ndarray(cap.array, dev_id)

    cp.ndarray = ndarray
    cp.empty, cp.empty_like, cp.ones = empty, empty_like, ones
    cp.asarray, cp.asnumpy, cp.ascontiguousarray, cp.concatenate = asarray, asnumpy, ascontiguousarray, concatenate
    cp.from_dlpack = from_dlpack
    cp.float32, cp.uint16, cp.uint32 = np.float32, np.uint16, np.uint32
    cp.cuda = types.SimpleNamespace(Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
                                    get_current_stream=get_current_stream,
                                    runtime=types.SimpleNamespace(getDeviceCount=lambda: ngpus,
                                                                  getDevice=cur_dev))
    cp.current_device = cur_dev

    def device_array(values, device: int = 0, dtype=None):
        """A fake CuPy array on ``device`` holding ``values`` (no copy is counted)."""
        return ndarray(np.array(values, dtype=dtype), device)
    cp.device_array = device_array

    def is_device_memory(ptr: int, nbytes: int, device: int) -> bool:
        for a, dev in cp.live:
            base = a.ctypes.data
            if dev == device and base <= ptr and ptr + nbytes <= base + a.nbytes:
                return True
        return False
    cp.is_device_memory = is_device_memory
    return cp


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------
def make_torch(cp):
    """A fresh fake ``torch`` module whose CUDA tensors live in ``cp``'s fake device memory."""
    torch = types.ModuleType("torch")
    torch.__fake__ = True
    torch.dlpack_exports = []     # (tensor storage ptr, stream passed, synced: stream != current)
    torch.current_streams = {}    # device index -> torch's current stream pointer

    class dtype:
        __module__ = "torch"

        def __init__(self, name, np_dtype):
            self.name, self.np = name, np.dtype(np_dtype)

        def __repr__(self):
            return f"torch.{self.name}"
    for name, npd in [("float16", np.float16), ("bfloat16", np.uint16), ("float32", np.float32),
                      ("float64", np.float64), ("int16", np.int16), ("int32", np.int32), ("int64", np.int64),
                      ("uint8", np.uint8)]:
        setattr(torch, name, dtype(name, npd))

    class device:
        __module__ = "torch"

        def __init__(self, type, index=None):
            if isinstance(type, str) and ":" in type:
                type, index = type.split(":")[0], int(type.split(":")[1])
            self.type, self.index = type, (None if index is None else int(index))

        def __eq__(self, other):
            return isinstance(other, device) and (other.type, other.index) == (self.type, self.index)

        def __repr__(self):
            return f"device(type={self.type!r}, index={self.index})"
    torch.device = device

    class _Capsule:
        def __init__(self, array, dtype_name):
            self.array, self.dtype_name = array, dtype_name

    class Tensor:
        __module__ = "torch"

        def __init__(self, a: np.ndarray, dt, dev, requires_grad=False):
            self._a, self.dtype, self.device, self.requires_grad = a, dt, dev, requires_grad
            if dev.type == "cuda":
                cp.live.append((a, dev.index))

        shape = property(lambda self: tuple(self._a.shape))

        def numel(self):
            return self._a.size

        def data_ptr(self):
            return self._a.ctypes.data

        def detach(self):
            return Tensor(self._a, self.dtype, self.device)

        def is_contiguous(self):
            return self._a.flags.c_contiguous

        def contiguous(self):
            return self if self.is_contiguous() else Tensor(np.ascontiguousarray(self._a), self.dtype, self.device)

        def view(self, dt):
            return Tensor(self._a.view(dt.np), dt, self.device, self.requires_grad)

        def __getitem__(self, key):
            return Tensor(self._a[key], self.dtype, self.device, self.requires_grad)

        def cpu(self):
            if self.device.type == "cpu":
                return self
            if not cp.host_copies_allowed:
                raise HostCopy("Tensor.cpu() of a CUDA tensor")
            cp.d2h += 1
            return Tensor(self._a.copy(), self.dtype, device("cpu"))

        def to(self, dev):
            dev = dev if isinstance(dev, device) else device(dev)
            if dev == self.device:
                return self
            if not cp.host_copies_allowed:
                raise HostCopy(f"Tensor.to({dev})")
            cp.h2d += 1
            return Tensor(self._a.copy(), self.dtype, dev)

        def copy_(self, src):
            if src.device != self.device:
                if not cp.host_copies_allowed:
                    raise HostCopy("Tensor.copy_ across devices")
                cp.h2d += 1
            self._a[...] = src._a
            return self

        def __dlpack_device__(self):
            return (2, self.device.index) if self.device.type == "cuda" else (1, 0)

        def __dlpack__(self, stream=None, **kw):
            if self.requires_grad:
                raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
            if self.device.type == "cpu":
                if self.dtype.name == "bfloat16":
                    raise BufferError("bfloat16 is not a numpy dtype (fake)")
                return self._a.__dlpack__(**kw)    # numpy marks legacy capsules read-only
            cur = torch.current_streams.get(self.device.index, 0)
            torch.dlpack_exports.append((self.data_ptr(), stream, stream not in (None, -1) and
                                         (stream if stream != 1 else 0) != cur))
            return _Capsule(self._a, self.dtype.name)

        def __repr__(self):
            return f"fake_tensor({self._a!r}, dtype={self.dtype}, device={self.device})"
    torch.Tensor = Tensor

    def empty(shape, dtype=None, device=None):
        dev = device if device is not None else torch.device("cpu")
        dev = dev if isinstance(dev, torch.device) else torch.device(dev)
        a = np.empty(shape, dtype=dtype.np)
        a.reshape(-1).view(np.uint8)[...] = SENTINEL
        if dev.type == "cuda":
            cp.allocations.append((dev.index, torch.current_streams.get(dev.index, 0), tuple(a.shape), a.dtype))
        return Tensor(a, dtype, dev)
    torch.empty = empty

    def from_numpy(a):
        dt = next(d for d in (torch.float16, torch.float32, torch.float64, torch.int16, torch.int32,
                              torch.int64, torch.uint8) if d.np == a.dtype)
        return Tensor(a, dt, torch.device("cpu"))
    torch.from_numpy = from_numpy

    def cuda_tensor(values, dtype, device_index: int = 0, requires_grad=False):
        """A fake CUDA tensor holding ``values`` (bfloat16: pass uint16 bits)."""
        return Tensor(np.array(values, dtype=dtype.np), dtype, torch.device("cuda", device_index), requires_grad)
    torch.cuda_tensor = cuda_tensor

    def cpu_tensor(values, dtype):
        return Tensor(np.array(values, dtype=dtype.np), dtype, torch.device("cpu"))
    torch.cpu_tensor = cpu_tensor

    class Stream:
        """torch.cuda.Stream: ``cuda_stream`` (the pointer), ``device_index`` and, like real torch
        >= 2.x, the CUDA stream protocol ``__cuda_stream__() -> (version, ptr)``."""

        def __init__(self, ptr: int, idx: int):
            self.cuda_stream, self.device_index = ptr, idx

        def __cuda_stream__(self):
            return (0, self.cuda_stream)

    def current_stream(device=None):
        idx = device.index if isinstance(device, torch.device) else (0 if device is None else int(device))
        return Stream(torch.current_streams.get(idx, 0), idx)
    torch.cuda = types.SimpleNamespace(current_stream=current_stream)
    return torch


# ---------------------------------------------------------------------------------------------
# NCCL
# ---------------------------------------------------------------------------------------------
_NCCL_NP = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
            7: np.float32, 8: np.float64, 9: np.uint16}


def _mem(ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, dtype)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class FakeNcclComm:
    """``cupy.cuda.nccl.NcclCommunicator`` for one rank among ``size`` mirror ranks on fake GPU
    ``device_id``. ``calls``: dicts with op, pointers, count, dtype, stream, current device, thread."""

    def __init__(self, cp, size: int, rank: int, device_id: int):
        self.cp, self.size, self.rank, self.device_id = cp, size, rank, device_id
        self.calls: list[dict] = []
        self.groups: list[list] = []       # each ended group: [(kind, bytes, peer)]
        self._group: list | None = None

    def _call(self, op, stream, **kw):
        rec = dict(op=op, stream=stream, device=self.cp.current_device(), thread=threading.get_ident(), **kw)
        self.calls.append(rec)
        return rec

    def _check(self, ptr: int, nbytes: int) -> None:
        if nbytes and not self.cp.is_device_memory(ptr, nbytes, self.device_id):
            raise AssertionError(f"NCCL got {ptr:#x}+{nbytes}: not fake device memory on GPU {self.device_id}")

    def _reduce(self, vals: np.ndarray, op: int) -> np.ndarray:
        if self.size == 1 or op in (2, 3, 4):        # max, min, avg of identical values
            return vals
        if vals.dtype == np.uint16:
            raise NotImplementedError("fake NCCL: bfloat16 arithmetic")
        with np.errstate(over="ignore"):
            return vals * self.size if op == 0 else vals ** self.size

    def allReduce(self, send, recv, count, dtype, op, stream):
        self._call("allReduce", stream, send=send, recv=recv, count=count, dtype=dtype, nccl_op=op)
        item = np.dtype(_NCCL_NP[dtype]).itemsize
        self._check(send, count * item)
        self._check(recv, count * item)
        vals = _mem(send, count * item, _NCCL_NP[dtype]).copy()
        _mem(recv, count * item, _NCCL_NP[dtype])[...] = self._reduce(vals, op)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        self._call("reduceScatter", stream, send=send, recv=recv, count=count, dtype=dtype, nccl_op=op)
        item = np.dtype(_NCCL_NP[dtype]).itemsize
        self._check(send, count * self.size * item)
        self._check(recv, count * item)
        full = self._reduce(_mem(send, count * self.size * item, _NCCL_NP[dtype]).copy(), op)
        _mem(recv, count * item, _NCCL_NP[dtype])[...] = full[self.rank * count:(self.rank + 1) * count]

    def allGather(self, send, recv, count, dtype, stream):
        self._call("allGather", stream, send=send, recv=recv, count=count, dtype=dtype)
        n = count * np.dtype(_NCCL_NP[dtype]).itemsize
        self._check(send, n)
        self._check(recv, n * self.size)
        data = _mem(send, n).copy()
        out = _mem(recv, n * self.size)
        for r in range(self.size):
            out[r * n:(r + 1) * n] = data

    def broadcast(self, send, recv, count, dtype, root, stream):
        self._call("broadcast", stream, send=send, recv=recv, count=count, dtype=dtype, root=root)
        n = count * np.dtype(_NCCL_NP[dtype]).itemsize
        self._check(send, n)
        self._check(recv, n)
        _mem(recv, n)[...] = _mem(send, n).copy()

    def send(self, ptr, count, dtype, peer, stream):
        self._call("send", stream, send=ptr, count=count, dtype=dtype, peer=peer)
        n = count * np.dtype(_NCCL_NP[dtype]).itemsize
        self._check(ptr, n)
        self._group.append(("send", ptr, n, peer))

    def recv(self, ptr, count, dtype, peer, stream):
        self._call("recv", stream, recv=ptr, count=count, dtype=dtype, peer=peer)
        n = count * np.dtype(_NCCL_NP[dtype]).itemsize
        self._check(ptr, n)
        self._group.append(("recv", ptr, n, peer))

    def _group_end(self):
        sends = {peer: (ptr, n) for kind, ptr, n, peer in self._group if kind == "send"}
        recvs = [(ptr, n, peer) for kind, ptr, n, peer in self._group if kind == "recv"]
        self.groups.append([(kind, n, peer) for kind, _, n, peer in self._group])
        self._group = None
        if self.rank in sends:
            # alltoall: a mirror peer p sends me its block for rank self.rank == my own block for myself
            mine = _mem(*sends[self.rank]).copy()
            for ptr, n, _ in recvs:
                _mem(ptr, n)[...] = mine
            return
        # point-to-point: mirror peer p sends me what I send to p (else a send of the same size);
        # a receive nothing in the group matches stays untouched (real NCCL would wait)
        for ptr, n, peer in recvs:
            src = sends.get(peer) if sends.get(peer, (0, -1))[1] == n else next(
                (v for v in sends.values() if v[1] == n), None)
            if src is not None:
                _mem(ptr, n)[...] = _mem(*src).copy()

    async_error: str | None = None
    aborted = False

    def check_async_error(self):
        if self.async_error:
            raise RuntimeError(self.async_error)

    def abort(self):
        self.aborted = True

    def destroy(self):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake ``cupy`` and ``torch`` in ``sys.modules`` for one test: namespace(cp, torch)."""
    cp = make_cupy(ngpus=2)
    torch = make_torch(cp)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return types.SimpleNamespace(cp=cp, torch=torch)


def make_nccl_module(comm_holder: list):
    """A fake ``cupy.cuda.nccl`` whose groupStart/groupEnd drive the communicators in ``comm_holder``."""
    def group_start():
        for c in comm_holder:
            c._group = []

    def group_end():
        for c in comm_holder:
            c._group_end()
    def get_unique_id():
        return bytes(range(128))          # CuPy >= 14 hands out bytes
    return types.SimpleNamespace(groupStart=group_start, groupEnd=group_end, get_version=lambda: 22000,
                                 get_unique_id=get_unique_id)
