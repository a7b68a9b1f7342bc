"""Device buffers through the Communicator.

Without a GPU (always run): fake ``cupy``/``torch`` modules and a fake NCCL communicator
(tests/helpers/fake_cuda.py) injected into the real NcclBackend the way test_nccl_backend.py
injects fakes. They assert that on a cuda backend CuPy arrays and CUDA torch tensors reach NCCL
as the very same device memory (pointers) with no host copy, that results come back in the
caller's type on the backend's GPU, that the caller's stream is used (also from the worker
thread), and that a host backend still stages device arrays through host memory.

With a GPU (``-m gpu``; skipped without cupy and a visible GPU): the same zero-copy checks on a
real one-rank NCCL communicator for cupy and torch, every op and dtype.
"""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

import helpers.fake_cuda as F  # noqa: E402

from hpcring.collectives import nccl as N
from hpcring.collectives import nccl_lib as NL  # noqa: E402
from hpcring.collectives.api import Communicator  # noqa: E402
from hpcring.errors import CollectiveError  # noqa: E402
from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS, Backend  # noqa: E402
from hpcring.errors import UsageError  # noqa: E402

STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64,
           "int32": np.int32, "int64": np.int64, "uint8": np.uint8}
GPU = 1                     # the fake backend's GPU; the calling thread's current device stays 0


fake = F.fake_cuda      # the fixture: fake cupy and torch in sys.modules


def nccl_comm(fake, size: int = 1):
    """A Communicator over the real NcclBackend with a fake NCCL communicator on fake GPU 1."""
    nc = F.FakeNcclComm(fake.cp, size, 0, GPU)
    be = N.NcclBackend(nc, 0, size, GPU, hosts=("gpu0",) * size, cupy=fake.cp,
                       nccl=F.make_nccl_module([nc]), version=22000)
    return Communicator(be, timeout=5.0), nc


def values(tag: str, shape) -> np.ndarray:
    """Distinct small values (bfloat16: distinct bit patterns of ordinary numbers)."""
    n = int(np.prod(shape))
    if tag == "bfloat16":
        return (0x3F80 + np.arange(n)).astype(np.uint16).reshape(shape)
    return (np.arange(n) % 100 + 1).astype(STORAGE[tag]).reshape(shape)


def ops_for(tag: str):
    return [o for o in OPS if o != "avg" or tag in FLOAT_DTYPES]


def last(nc, op: str) -> dict:
    return [c for c in nc.calls if c["op"] == op][-1]


# ---------------------------------------------------------------------------------------------
# cupy arrays on a cuda backend: zero copy
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", DTYPES)
def test_cupy_arrays_reach_nccl_without_copies(fake, tag):
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    x = cp.device_array(values(tag, (3, 4)), device=GPU)
    ref = x._a.copy()
    kw = {"dtype": "bfloat16"} if tag == "bfloat16" else {}
    cp.host_copies_allowed = False          # any .get()/asarray/asnumpy/.set() now raises

    for op in ops_for(tag):
        y = comm.allreduce(x, op, **kw)
        c = last(nc, "allReduce")
        assert isinstance(y, cp.ndarray) and y.shape == (3, 4) and y.dtype == x.dtype and y.device.id == GPU
        assert (c["send"], c["recv"], c["count"]) == (x.data.ptr, y.data.ptr, 12)
        assert c["dtype"] == NL.NCCL_DTYPE[tag] and c["nccl_op"] == NL.NCCL_OP[op]
        np.testing.assert_array_equal(y._a, ref)

    assert comm.allreduce(x, "max", out=x, **kw) is x
    c = last(nc, "allReduce")
    assert c["send"] == c["recv"] == x.data.ptr

    o = cp.device_array(np.zeros(12, STORAGE[tag]), device=GPU)
    assert comm.allreduce(x, out=o, **kw) is o
    assert last(nc, "allReduce")["recv"] == o.data.ptr
    np.testing.assert_array_equal(o._a, ref.reshape(-1))

    g = comm.allgather(x, **kw)
    c = last(nc, "allGather")
    assert isinstance(g, cp.ndarray) and g.shape == (1, 3, 4) and g.dtype == x.dtype
    assert (c["send"], c["recv"]) == (x.data.ptr, g.data.ptr)
    np.testing.assert_array_equal(g._a[0], ref)

    r = comm.reduce_scatter(x, "sum", **kw)
    c = last(nc, "reduceScatter")
    assert r.shape == (3, 4) and (c["send"], c["recv"]) == (x.data.ptr, r.data.ptr)
    np.testing.assert_array_equal(r._a, ref)

    assert comm.broadcast(x, root=0, **kw) is x
    c = last(nc, "broadcast")
    assert c["send"] == c["recv"] == x.data.ptr

    a = comm.alltoall(x, **kw)
    assert a.shape == (3, 4) and last(nc, "send")["send"] == x.data.ptr and last(nc, "recv")["recv"] == a.data.ptr
    np.testing.assert_array_equal(a._a, ref)
    assert comm.alltoall(x, out=x, **kw) is x
    assert last(nc, "recv")["recv"] == x.data.ptr            # (NCCL sends from a device-side copy)
    np.testing.assert_array_equal(x._a, ref)

    assert cp.h2d == cp.d2h == 0
    assert all(c["device"] == GPU for c in nc.calls)
    comm.close()


def test_cupy_shapes_and_placement_with_two_mirror_ranks(fake):
    """World size 2 (the other rank holds the same data): reduce_scatter rows, allgather stacking,
    alltoall blocks; every result is allocated on the backend's GPU, not the current device 0."""
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    x = cp.device_array(np.arange(12, dtype=np.float32).reshape(4, 3), device=GPU)
    cp.host_copies_allowed = False
    assert cp.current_device() == 0
    y = comm.allreduce(x)
    np.testing.assert_array_equal(y._a, 2 * x._a)
    rs = comm.reduce_scatter(x)
    assert rs.shape == (2, 3)
    np.testing.assert_array_equal(rs._a, 2 * x._a[:2])
    odd = cp.device_array(np.arange(7, dtype=np.float32), device=GPU)
    assert comm.reduce_scatter(odd).shape == (4,)                       # 7 = 4 + 3 elements
    g = comm.allgather(x)
    assert g.shape == (2, 4, 3)
    np.testing.assert_array_equal(g._a, np.stack([x._a, x._a]))
    a = comm.alltoall(x)                                                # block 0 from both mirrors
    np.testing.assert_array_equal(a._a.reshape(-1), np.tile(x._a.reshape(-1)[:6], 2))
    assert {dev for dev, *_ in cp.allocations} == {GPU}
    assert all(c["device"] == GPU for c in nc.calls)
    comm.close()


# ---------------------------------------------------------------------------------------------
# torch CUDA tensors on a cuda backend: DLPack, zero copy, torch's stream
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", DTYPES)
def test_torch_cuda_tensors_reach_nccl_through_dlpack(fake, tag):
    cp, torch = fake.cp, fake.torch
    torch.current_streams[GPU] = 0x7000
    comm, nc = nccl_comm(fake)
    dt = getattr(torch, tag)
    x = torch.cuda_tensor(values(tag, (2, 5)), dt, GPU, requires_grad=True)
    ref = x._a.copy()
    cp.host_copies_allowed = False          # Tensor.cpu()/.to() across devices now raise

    y = comm.allreduce(x)
    c = last(nc, "allReduce")
    assert isinstance(y, torch.Tensor) and y.dtype is dt and y.device == torch.device("cuda", GPU)
    assert y.shape == (2, 5) and (c["send"], c["recv"]) == (x.data_ptr(), y.data_ptr())
    assert c["dtype"] == NL.NCCL_DTYPE[tag]
    np.testing.assert_array_equal(y._a, ref)

    assert comm.allreduce(x, "min", out=x) is x
    c = last(nc, "allReduce")
    assert c["send"] == c["recv"] == x.data_ptr()

    g = comm.allgather(x)
    assert isinstance(g, torch.Tensor) and g.shape == (1, 2, 5) and g.dtype is dt
    assert last(nc, "allGather")["recv"] == g.data_ptr()
    r = comm.reduce_scatter(x)
    assert r.shape == (2, 5) and last(nc, "reduceScatter")["recv"] == r.data_ptr()
    assert comm.broadcast(x, root=0) is x and last(nc, "broadcast")["recv"] == x.data_ptr()
    a = comm.alltoall(x)
    assert isinstance(a, torch.Tensor) and last(nc, "recv")["recv"] == a.data_ptr()
    np.testing.assert_array_equal(a._a, ref)

    # NCCL ran on torch's current stream, and DLPack never needed a cross-stream sync
    assert {c["stream"] for c in nc.calls} == {0x7000}
    assert torch.dlpack_exports and not any(synced for _, _, synced in torch.dlpack_exports)
    assert {(dev, stream) for dev, stream, *_ in cp.allocations} == {(GPU, 0x7000)}
    assert cp.h2d == cp.d2h == 0
    comm.close()


def test_generic_cuda_dlpack_object_is_viewed_in_place(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake)

    class Foreign:                          # e.g. a JAX/numba GPU array: only the DLPack protocol
        def __init__(self, t):
            self.t, self.shape = t, t.shape

        def __dlpack__(self, **kw):
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()
    t = torch.cuda_tensor(np.arange(6, dtype=np.float32), torch.float32, GPU)
    f = Foreign(t)
    cp.host_copies_allowed = False
    y = comm.allreduce(f)
    assert isinstance(y, cp.ndarray) and last(nc, "allReduce")["send"] == t.data_ptr()
    assert comm.broadcast(f) is f and last(nc, "broadcast")["recv"] == t.data_ptr()
    comm.close()


# ---------------------------------------------------------------------------------------------
# streams, worker thread, devices
# ---------------------------------------------------------------------------------------------
def test_caller_stream_and_device_are_used_and_async_calls_enqueue_in_the_caller(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    x = cp.device_array(np.ones(8, np.float32), device=GPU)
    s = cp.cuda.Stream(0x5000, GPU)
    with cp.cuda.Device(GPU), s:
        comm.allreduce(x)
        h1 = comm.allreduce_async(x)
        h2 = comm.allgather_async(x)
        comm.broadcast(x)
    assert cp.current_device() == 0 and cp.cuda.get_current_stream(GPU).ptr == 0
    h1.wait(5)
    h2.wait(5)
    assert [c["op"] for c in nc.calls] == ["allReduce", "allReduce", "allGather", "broadcast"]
    assert [c["stream"] for c in nc.calls] == [0x5000] * 4
    assert [c["device"] for c in nc.calls] == [GPU] * 4
    # stream-ordered: enqueued by the calling thread, so the NCCL order is the program order on
    # every rank (a worker thread could reorder against later synchronous calls)
    assert {c["thread"] for c in nc.calls} == {threading.get_ident()}
    assert all(stream == 0x5000 and dev == GPU for dev, stream, *_ in cp.allocations)

    comm.allreduce(x)                       # outside any stream context: CuPy's null stream
    assert nc.calls[-1]["stream"] == 0 and nc.calls[-1]["device"] == GPU
    comm.close()


def test_torch_stream_is_captured_at_submission(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake)
    x = torch.cuda_tensor(np.ones(4, np.float32), torch.float32, GPU)
    torch.current_streams[GPU] = 0x7100
    h = comm.allreduce_async(x)
    torch.current_streams[GPU] = 0x7200     # the caller moved on; the call kept its stream
    h.wait(5)
    assert nc.calls[-1]["stream"] == 0x7100
    comm.allreduce(x)
    assert nc.calls[-1]["stream"] == 0x7200
    comm.close()


# ---------------------------------------------------------------------------------------------
# stream order: return before the GPU finished; completion, deadline and errors from the poller
# ---------------------------------------------------------------------------------------------
def test_device_collectives_return_before_the_gpu_finished(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    x = cp.device_array(np.ones(1024, np.float32), device=GPU)
    cp.gpu_busy = True                       # the GPU has not run anything yet
    y = comm.allreduce(x)                    # the synchronous call returns at once ...
    h = comm.allreduce_async(x, out=x)
    seen = []
    h.add_done_callback(lambda hh: seen.append(hh.exception()))
    assert y is not None and not h.done() and h.cuda_event is not None
    assert [r.state for r in comm.recorder.records()] == ["started", "started"]   # ... in flight
    with pytest.raises(Exception, match="still in flight"):
        comm.synchronize(0.05)
    cp.gpu_busy = False
    h.wait(5)
    comm.synchronize(5)
    assert seen == [None] and [r.state for r in comm.recorder.records()] == ["done", "done"]
    np.testing.assert_array_equal(y.get(), np.full(1024, 2, np.float32))
    comm.close()


def test_the_poller_queries_one_event_per_stream_not_every_op_in_flight(fake):
    """Ops on one stream complete in order: with 60 small ops queued behind a busy GPU, the
    poller asks only the oldest one (a long queue must not make it hog the GIL)."""
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    x = cp.device_array(np.ones(256, np.float32), device=GPU)
    cp.gpu_busy = True
    handles = [comm.allreduce_async(x, out=x) for _ in range(60)]
    cp.event_queries = 0
    time.sleep(0.03)                          # several poll rounds (0.2 ms growing to 2 ms)
    queried = cp.event_queries
    assert 0 < queried < 60, queried          # polling all 60 would take 60 queries a round
    cp.gpu_busy = False
    comm.synchronize(5)
    assert all(h.done() and h.exception() is None for h in handles)
    comm.close()


def test_completed_events_nobody_holds_are_recorded_again(fake):
    """A synchronous op's event goes back to the backend once complete (creating one per call
    is a CUDA call); an async op's event stays its handle's (``cuda_event``) and is never reused."""
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    real = cp.cuda.Event
    made, records = [], {}

    class Counting(real):
        def __init__(self, *a, **k):
            made.append(self)
            super().__init__(*a, **k)

        def record(self, stream=None):
            records[id(self)] = records.get(id(self), 0) + 1
            super().record(stream)
    cp.cuda.Event = Counting
    try:
        x = cp.device_array(np.ones(256, np.float32), device=GPU)
        for _ in range(40):
            comm.allreduce(x, out=x)
            comm.synchronize(5)
        assert 1 <= len(made) <= 2, len(made)           # not one per call
        h = comm.allreduce_async(x, out=x)
        h.wait(5)
        comm.synchronize(5)
        held = h.cuda_event
        before = records[id(held)]
        for _ in range(10):
            comm.allreduce(x, out=x)
            comm.synchronize(5)
        assert records[id(held)] == before and held not in comm.backend._spare_events
        np.testing.assert_array_equal(x.get(), np.full(256, 2.0 ** 51, np.float32))
    finally:
        cp.cuda.Event = real
        comm.close()


def test_an_op_behind_a_running_one_still_keeps_its_own_deadline(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    x = cp.device_array(np.ones(256, np.float32), device=GPU)
    cp.gpu_busy = True
    slow = comm.allreduce_async(x, out=x, timeout=30)
    short = comm.allreduce_async(x, out=x, timeout=0.2)    # queued behind, shorter deadline
    with pytest.raises(CollectiveError, match="allreduce#2"):
        short.wait(10)
    assert slow.done() and isinstance(slow.exception(), CollectiveError)     # aborted with it
    cp.gpu_busy = False
    comm.close()


def test_barrier_on_a_device_backend_blocks_the_host(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    comm.barrier()
    assert nc.calls[-1]["op"] == "allReduce" and comm.recorder.records()[-1].state == "done"
    cp.gpu_busy = True
    with pytest.raises(Exception, match=r"barrier#2 did not complete within the 0.2 s deadline"):
        comm.barrier(timeout=0.2)
    assert nc.aborted
    comm.close()


class _Watchdog:
    """Stands in for hpcring.diagnostics.watchdog.Watchdog (register / on_failure)."""

    def __init__(self):
        self.failures = []

    def register(self, comm):
        pass

    def on_failure(self, comm, rec, error):
        self.failures.append((rec.op, rec.seq, str(error)))
        return type(error)(f"{error} [job-wide report]")


def test_a_device_deadline_aborts_reaches_the_watchdog_and_fails_every_handle(fake):
    cp = fake.cp
    nc = F.FakeNcclComm(cp, 2, 0, GPU)
    be = N.NcclBackend(nc, 0, 2, GPU, hosts=("gpu0", "gpu1"), cupy=cp, nccl=F.make_nccl_module([nc]),
                       version=22000)
    wd = _Watchdog()
    comm = Communicator(be, timeout=0.3, watchdog=wd)
    x = cp.device_array(np.ones(16, np.float32), device=GPU)
    cp.gpu_busy = True                       # rank 1 never joins: the kernel never finishes
    h1 = comm.allreduce_async(x)
    comm.allreduce(x)                        # returns: it is only enqueued
    with pytest.raises(Exception, match=r"(?s)allreduce#1.*0.3 s deadline.*\[job-wide report\]"):
        h1.wait(10)
    assert nc.aborted and wd.failures[0][:2] == ("allreduce", 1)
    assert [r.state for r in comm.recorder.records()] == ["failed", "failed"]
    with pytest.raises(Exception, match="allreduce#1"):          # sticky
        comm.allreduce(x)
    cp.gpu_busy = False
    comm.close()


def test_an_nccl_async_error_fails_the_outstanding_collective(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake, size=2)
    x = cp.device_array(np.ones(16, np.float32), device=GPU)
    cp.gpu_busy = True
    h = comm.allgather_async(x)
    nc.async_error = "NCCL_ERROR_REMOTE_ERROR: peer gpu3 closed the connection"
    with pytest.raises(Exception, match="allgather#1.*NCCL async error: NCCL_ERROR_REMOTE_ERROR"):
        h.wait(10)
    assert nc.aborted
    cp.gpu_busy = False
    comm.close()


def test_array_on_another_gpu_is_a_usage_error(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake)
    with pytest.raises(UsageError, match="allreduce input is on GPU 0 but this communicator uses GPU 1"):
        comm.allreduce(cp.device_array(np.ones(3, np.float32), device=0))
    with pytest.raises(UsageError, match="on GPU 0"):
        comm.broadcast(torch.cuda_tensor(np.ones(3, np.float32), torch.float32, 0))
    good = cp.device_array(np.ones(3, np.float32), device=GPU)
    with pytest.raises(UsageError, match="out is on GPU 0"):
        comm.allreduce(good, out=cp.device_array(np.ones(3, np.float32), device=0))
    assert comm.error is None and not nc.calls
    assert comm.allreduce(good).device.id == GPU        # not poisoned
    comm.close()


def test_non_contiguous_device_arrays(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake)
    cp.host_copies_allowed = False
    base = cp.device_array(np.arange(24, dtype=np.float32).reshape(4, 6), device=GPU)
    v = base[:, ::2]
    with pytest.raises(UsageError, match="C-contiguous to be written in place"):
        comm.allreduce(v, out=v)
    y = comm.allreduce(v)                   # read-only input: copied on the device
    assert y.shape == (4, 3)
    np.testing.assert_array_equal(y._a, base._a[:, ::2])
    t = torch.cuda_tensor(np.arange(12, dtype=np.float32).reshape(3, 4), torch.float32, GPU)[:, ::2]
    with pytest.raises(UsageError, match="contiguous to be written in place"):
        comm.broadcast(t)
    np.testing.assert_array_equal(comm.allreduce(t)._a, t._a)
    assert cp.h2d == cp.d2h == 0
    comm.close()


def test_backend_selects_its_own_gpu_on_any_thread(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    comm.barrier()
    comm.barrier_async().wait(5)
    assert [c["device"] for c in nc.calls] == [GPU, GPU]
    assert [dev for dev, *_ in cp.allocations] == [GPU, GPU]
    comm.close()


# ---------------------------------------------------------------------------------------------
# allreduce_grouped on the device
# ---------------------------------------------------------------------------------------------
def test_grouped_allreduce_fuses_on_the_device(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake, size=2)
    arrs = [cp.device_array(np.arange(6, dtype=np.float32).reshape(2, 3), device=GPU),
            cp.device_array(np.arange(5, dtype=np.int64), device=GPU),
            torch.cuda_tensor(np.full(4, 3, np.float32), torch.float32, GPU),
            cp.device_array(np.zeros(0, np.float32), device=GPU)]
    refs = [a._a.copy() for a in arrs]
    cp.host_copies_allowed = False
    out = comm.allreduce_grouped(arrs)
    assert cp.concatenations == [3, 1]                  # one fused buffer per dtype, float32 first
    calls = [c for c in nc.calls if c["op"] == "allReduce"]
    assert [(c["count"], c["dtype"]) for c in calls] == [(10, NL.NCCL_DTYPE["float32"]), (5, NL.NCCL_DTYPE["int64"])]
    assert [type(o).__name__ for o in out] == ["ndarray", "ndarray", "Tensor", "ndarray"]
    assert [tuple(o.shape) for o in out] == [(2, 3), (5,), (4,), (0,)]
    for o, a, ref in zip(out, arrs, refs):
        assert o is not a
        np.testing.assert_array_equal(o._a, 2 * ref)
    assert out[2].device == torch.device("cuda", GPU) and out[0].device.id == GPU

    res = comm.allreduce_grouped(arrs, inplace=True)
    assert all(r is a for r, a in zip(res, arrs))
    for a, ref in zip(arrs, refs):
        np.testing.assert_array_equal(a._a, 2 * ref)
    assert cp.h2d == cp.d2h == 0
    comm.close()


def test_grouped_allreduce_mixing_host_and_device_members(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    d = cp.device_array(np.ones(3, np.float32), device=GPU)
    h = np.full(2, 5, np.float32)
    out = comm.allreduce_grouped([d, h])
    assert isinstance(out[0], cp.ndarray) and isinstance(out[1], np.ndarray)
    np.testing.assert_array_equal(out[1], h)
    assert cp.concatenations == [2] and cp.h2d == 1 and cp.d2h == 1    # the host member only
    comm.close()


# ---------------------------------------------------------------------------------------------
# host inputs on a cuda backend; device inputs on a host backend
# ---------------------------------------------------------------------------------------------
def test_host_inputs_on_a_cuda_backend_are_staged_by_the_backend(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = comm.allreduce(x)
    assert isinstance(y, np.ndarray) and y.shape == (2, 3)
    np.testing.assert_array_equal(y, x)
    assert comm.allreduce(x, out=x) is x
    t = torch.cpu_tensor(values("bfloat16", (4,)), torch.bfloat16)
    r = comm.allreduce(t)
    assert isinstance(r, torch.Tensor) and r.device.type == "cpu" and r.dtype is torch.bfloat16
    np.testing.assert_array_equal(r._a, t._a)
    assert last(nc, "allReduce")["dtype"] == NL.NCCL_DTYPE["bfloat16"]
    assert cp.h2d >= 3 and cp.d2h >= 3
    assert all(dev == GPU for dev, *_ in cp.allocations)
    comm.close()


class _EchoBackend(Backend):
    """A one-rank host backend that checks it only ever sees numpy buffers."""

    name, device = "echo", "cpu"
    rank, size = 0, 1

    def __init__(self):
        self.seen = []

    def _see(self, *bufs):
        for b in bufs:
            assert type(b) is np.ndarray and b.ndim == 1 and b.flags.c_contiguous
        self.seen.append(bufs)

    def allreduce(self, s, r, dtype, op, timeout):
        self._see(s, r)
        r[...] = s

    def allgather(self, s, r, dtype, timeout):
        self._see(s, r)
        r[...] = np.tile(s, self.size)

    def reduce_scatter(self, s, r, dtype, op, timeout):
        self._see(s, r)
        r[...] = s

    def broadcast(self, b, root, dtype, timeout):
        self._see(b)

    def alltoall(self, s, r, dtype, timeout):
        self._see(s, r)
        r[...] = s.copy()

    def barrier(self, timeout):
        pass

    def close(self):
        pass


def test_host_backend_stages_device_arrays_through_host_memory(fake):
    cp, torch = fake.cp, fake.torch
    comm = Communicator(_EchoBackend(), timeout=5.0)
    x = cp.device_array(np.arange(6, dtype=np.float32).reshape(2, 3), device=GPU)
    y = comm.allreduce(x)
    assert isinstance(y, cp.ndarray) and y.shape == (2, 3) and y.device.id == GPU   # the input's GPU
    np.testing.assert_array_equal(y._a, x._a)
    assert (cp.d2h, cp.h2d) == (1, 1)
    assert comm.allreduce(x, out=x) is x and (cp.d2h, cp.h2d) == (2, 2)
    g = comm.allgather(x)
    assert g.shape == (1, 2, 3) and g.device.id == GPU

    t = torch.cuda_tensor(values("bfloat16", (3,)), torch.bfloat16, GPU)
    r = comm.allreduce(t)
    assert isinstance(r, torch.Tensor) and r.device == torch.device("cuda", GPU) and r.dtype is torch.bfloat16
    np.testing.assert_array_equal(r._a, t._a)
    assert comm.broadcast(t) is t
    res = comm.allreduce_grouped([x, t.view(torch.int16)[:0].view(torch.bfloat16), x], inplace=True)
    assert res[0] is x and res[2] is x
    comm.close()


# ---------------------------------------------------------------------------------------------
# real GPU: one-rank NCCL communicator, every op and dtype, cupy and torch
# ---------------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not NL.gpu_available(), reason="no NVIDIA GPU/cupy")


class _Spy:
    """Records, per backend call, the type and device pointer of every buffer it receives."""

    def __init__(self, backend):
        self.calls: list[tuple[str, list]] = []
        for name in ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "enqueue"):
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name, fn):
        def spy(*args):
            label = args[0] if name == "enqueue" else name    # the short path: enqueue(kind, send, recv, ...)
            bufs = [a for a in args if hasattr(a, "size") and hasattr(a, "dtype")]
            self.calls.append((label, [(type(b).__module__.split(".")[0], int(b.data.ptr) if hasattr(b, "data")
                                       and hasattr(b.data, "ptr") else None) for b in bufs]))
            return fn(*args)
        return spy

    def last(self):
        return self.calls[-1]


@pytest.fixture(scope="module")
def gpu_comm():
    if not NL.gpu_available():
        pytest.skip("no NVIDIA GPU/cupy")
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    secret = b"g" * 32
    topo = types.SimpleNamespace(rank=0, size=1, local_rank=0, host="here", hosts=("here",))
    with StoreServer("127.0.0.1", 0, secret=secret) as srv:
        store = StoreClient("127.0.0.1", srv.port, secret)
        be = N.NcclBackend.create(topo, store, timeout=60.0)
        spy = _Spy(be)
        comm = Communicator(be, timeout=60.0)
        yield comm, spy
        comm.close()


def _gpu_values(cupy, tag: str, shape):
    return cupy.asarray(values(tag, shape))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tag", DTYPES)
def test_gpu_cupy_zero_copy_every_op(gpu_comm, tag):
    import cupy
    comm, spy = gpu_comm
    kw = {"dtype": "bfloat16"} if tag == "bfloat16" else {}
    x = _gpu_values(cupy, tag, (6, 5))
    ref = x.copy()
    p = int(x.data.ptr)

    def check(result, *, send=p, recv=None, shape=(6, 5)):
        name, bufs = spy.last()
        assert all(mod == "cupy" for mod, _ in bufs), f"{name} got host buffers: {bufs}"
        assert bufs[0][1] == send
        if recv is not None:
            assert bufs[-1][1] == recv
        if result is not None:
            assert isinstance(result, cupy.ndarray) and result.shape == shape and result.dtype == x.dtype
            assert result.device.id == 0 and int(result.data.ptr) == bufs[-1][1]

    for op in ops_for(tag):
        y = comm.allreduce(x, op, **kw)
        check(y)
        assert cupy.array_equal(y, ref), (tag, op)       # one rank: every op is the identity
    assert comm.allreduce(x, out=x, **kw) is x
    check(None, recv=p)
    o = cupy.zeros(30, dtype=x.dtype)
    assert comm.allreduce(x, out=o, **kw) is o
    check(None, recv=int(o.data.ptr))
    assert cupy.array_equal(o, ref.reshape(-1))
    g = comm.allgather(x, **kw)
    check(g, shape=(1, 6, 5))
    assert cupy.array_equal(g[0], ref)
    r = comm.reduce_scatter(x, **kw)
    check(r)
    assert cupy.array_equal(r, ref)
    assert comm.broadcast(x, root=0, **kw) is x
    check(None, recv=p)
    a = comm.alltoall(x, **kw)
    check(a)
    assert cupy.array_equal(a, ref)
    assert comm.alltoall(x, out=x, **kw) is x
    assert cupy.array_equal(x, ref)
    if tag != "bfloat16":               # grouped takes no dtype=, so no uint16-as-bfloat16
        outs = comm.allreduce_grouped([x, x[:2].copy()])
        assert all(isinstance(o, cupy.ndarray) for o in outs) and cupy.array_equal(outs[1], ref[:2])
        assert spy.last()[1][0][0] == "cupy"
    # the caller's stream is the one NCCL runs on (async calls: from the worker thread)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        y = comm.allreduce_async(x, **kw).wait(60)
    assert cupy.array_equal(y, ref)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tag", DTYPES)
def test_gpu_torch_zero_copy_every_op(gpu_comm, tag):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    comm, spy = gpu_comm
    dt = getattr(torch, tag)
    if tag == "bfloat16":
        x = torch.arange(30, device="cuda:0", dtype=torch.float32).reshape(6, 5).to(dt)
    else:
        x = (torch.arange(30, device="cuda:0") % 100 + 1).reshape(6, 5).to(dt)
    ref = x.clone()
    p = x.data_ptr()
    orig_cpu = torch.Tensor.cpu

    def no_cpu(self, *a, **k):
        raise AssertionError("host copy of a CUDA tensor")
    torch.Tensor.cpu = no_cpu
    try:
        def check(result, *, send=p, shape=(6, 5)):
            name, bufs = spy.last()
            assert all(mod == "cupy" for mod, _ in bufs), f"{name} got host buffers: {bufs}"
            assert bufs[0][1] == send
            if result is not None:
                assert isinstance(result, torch.Tensor) and result.dtype == dt and tuple(result.shape) == shape
                assert result.device == torch.device("cuda", 0) and result.data_ptr() == bufs[-1][1]

        for op in ops_for(tag):
            y = comm.allreduce(x, op)
            check(y)
            assert torch.equal(y, ref), (tag, op)
        assert comm.allreduce(x, out=x) is x
        assert spy.last()[1][1][1] == p
        g = comm.allgather(x)
        check(g, shape=(1, 6, 5))
        assert torch.equal(g[0], ref)
        r = comm.reduce_scatter(x)
        check(r)
        assert comm.broadcast(x, root=0) is x and spy.last()[1][0][1] == p
        a = comm.alltoall(x)
        check(a)
        assert torch.equal(a, ref)
        outs = comm.allreduce_grouped([x, x[:2].clone()], inplace=False)
        assert all(isinstance(o, torch.Tensor) and o.is_cuda for o in outs) and torch.equal(outs[0], ref)
        # a tensor produced on a side stream: the call runs on that (current) stream, so it is
        # ordered after the producing kernel without a synchronize
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            z = x * 1
            w = comm.allreduce(z)
            w2 = comm.allreduce_async(z).wait(60)
        torch.cuda.synchronize()
        assert torch.equal(w, ref) and torch.equal(w2, ref)
    finally:
        torch.Tensor.cpu = orig_cpu


@pytest.mark.gpu
@needs_gpu
def test_gpu_wrong_device_or_layout_is_refused(gpu_comm):
    import cupy
    comm, _ = gpu_comm
    x = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    with pytest.raises(UsageError, match="C-contiguous"):
        comm.allreduce(x[:, ::2], out=x[:, ::2])
    assert cupy.array_equal(comm.allreduce(x[:, ::2]), x[:, ::2])
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            other = cupy.ones(3, dtype=cupy.float32)
        with pytest.raises(UsageError, match="on GPU 1 but this communicator uses GPU 0"):
            comm.allreduce(other)
    assert comm.error is None


# ---------------------------------------------------------------------------------------------
# the fakes against the real libraries (installed without a GPU in CI)
# ---------------------------------------------------------------------------------------------
def _real_cupy():
    try:
        import cupy
        from cupy.cuda import nccl
        nccl.get_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"real CuPy with NCCL not importable: {e}")
    return cupy, nccl


def _cython_params(method) -> list[str]:
    """Parameter names from a Cython method's embedded signature ('name(self, intptr_t a, ...)')."""
    import re
    first = (method.__doc__ or "").strip().splitlines()[0]
    inside = re.search(r"\((.*)\)", first).group(1)
    return [p.split("=")[0].split()[-1] for p in inside.split(",") if p.strip() and p.strip() != "self"]


def test_fake_nccl_communicator_mirrors_the_real_signatures():
    import inspect
    _, nccl = _real_cupy()
    for name in ("allReduce", "reduceScatter", "allGather", "broadcast", "send", "recv"):
        real = _cython_params(getattr(nccl.NcclCommunicator, name))
        fake = [p for p in inspect.signature(getattr(F.FakeNcclComm, name)).parameters if p != "self"]
        assert len(fake) == len(real), (name, fake, real)
    for name in ("check_async_error", "abort", "destroy"):
        assert hasattr(nccl.NcclCommunicator, name)
    assert type(F.make_nccl_module([]).get_unique_id()) is type(nccl.get_unique_id())
    for name in ("groupStart", "groupEnd", "get_version"):
        assert callable(getattr(nccl, name))


def test_fake_cupy_streams_and_events_mirror_the_real_api():
    cupy, _ = _real_cupy()
    fake = F.make_cupy(1)
    for attr in ("record", "done", "synchronize"):
        assert hasattr(cupy.cuda.Event, attr) and hasattr(fake.cuda.Event, attr)
    for attr in ("from_external", "wait_event", "synchronize"):
        assert hasattr(cupy.cuda.Stream, attr) and hasattr(fake.cuda.Stream, attr), attr
    assert isinstance(cupy.cuda.Stream.null.ptr, int) and isinstance(fake.cuda.get_current_stream().ptr, int)
    import torch
    assert hasattr(torch.cuda.Stream, "__cuda_stream__") and hasattr(F.make_torch(fake).cuda.current_stream(),
                                                                      "__cuda_stream__")
