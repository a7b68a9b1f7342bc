"""The short path of Communicator.allreduce (one contiguous array, a supported dtype
and op, out=None or out=x, the communicator's deadline, a synchronous call) against the general
path (``short_path = False``): identical results, identical flight records, the same failure
report (watchdog, sticky error), and the short path really taken. Ring (threads over
socketpairs) and NCCL (the fake layer of tests/helpers/fake_cuda.py)."""
from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest

import helpers.fake_cuda as F  # noqa: E402
from helpers.ring import ThreadGroup  # noqa: E402

from hpcring.collectives import api  # noqa: E402
from hpcring.collectives import nccl as N  # noqa: E402
from hpcring.collectives.api import Communicator  # noqa: E402
from hpcring.collectives.backends import FLOAT_DTYPES, OPS  # noqa: E402
from hpcring.errors import CollectiveError, UsageError  # noqa: E402

NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "int32": np.int32,
      "int64": np.int64, "uint8": np.uint8}
SAME = ("op", "dtype", "count", "root", "backend", "timeout", "site", "state", "error")


MODES = ["new", "inplace", "out", "outflat"]


def call(comm, x, op, mode, **kw):
    """One call site for both paths (the record's site is this line). ``mode``: a new result,
    in place, or into a given ``out=`` of x's type and dtype, x's shape or flat (filled with a
    wrong value first). Returns (result, the object it must be or None)."""
    if mode in ("out", "outflat"):          # outflat: another shape with the same element count
        out = x.copy() if mode == "out" else x.reshape(-1).copy()
        out[...] = 99
    else:
        out = x if mode == "inplace" else None
    return comm.allreduce(x, op, out=out, **kw), out


def fields(rec) -> dict:
    d = rec.to_dict()
    return {k: d[k] for k in SAME}


class NoGeneral:
    """Makes the general path's adaptation fail loudly: proves the short path was taken."""

    def __enter__(self):
        self.real = api.adapt

        def boom(*a, **k):
            raise AssertionError("the general path ran")
        api.adapt = boom
        return self

    def __exit__(self, *exc):
        api.adapt = self.real


def values(tag: str, rank: int, shape) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) * 3 + rank) % 7 + 1).astype(NP[tag]).reshape(shape)


# ---------------------------------------------------------------------------------------------
# ring
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def group():
    g = ThreadGroup(2, timeout=20.0)
    yield g
    g.close()


@pytest.mark.parametrize("tag", list(NP))
@pytest.mark.parametrize("shape", [(1024,), (16, 8), (3,)])
@pytest.mark.parametrize("mode", MODES)
def test_ring_short_and_general_paths_agree(group, tag, shape, mode):
    def phase(short):
        def run(comm):
            comm.short_path = short
            x = values(tag, comm.rank, shape)
            results = []
            for op in OPS:
                if op == "avg" and tag not in FLOAT_DTYPES:
                    continue
                y = x.copy()
                r, want = call(comm, y, op, mode)
                assert (r is want if want is not None else r is not y)
                assert r.shape == (want.shape if want is not None else shape) and r.dtype == y.dtype
                results.append((op, r.copy(), fields(comm.recorder.records(1)[0])))
            comm.short_path = True
            return results
        return run
    general = group.run_ok(phase(False))
    with NoGeneral():
        short = group.run_ok(phase(True))
    for g, s in zip(general, short):
        assert len(g) == len(s)
        for (op, a, ra), (op2, b, rb) in zip(g, s):
            assert op == op2
            np.testing.assert_array_equal(a, b)
            assert ra == rb and ra["state"] == "done" and ra["dtype"] == tag


def test_ring_short_path_refuses_what_the_general_path_refuses(group):
    comm = group.comms[0]
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(UsageError, match="read-only"):
        comm.allreduce(ro, out=ro)
    with pytest.raises(UsageError, match="unsupported op"):
        comm.allreduce(np.ones(4, np.float32), "xor")
    with pytest.raises(UsageError, match="avg"):
        comm.allreduce(np.ones(4, np.int32), "avg")
    with pytest.raises(UsageError, match="unsupported dtype"):
        comm.allreduce(np.ones(4, np.complex64))
    seq = comm.recorder.seq
    for bad in (0, -1.0, float("nan"), "soon", [1]):
        with pytest.raises(UsageError, match="timeout"):
            comm.allreduce(np.ones(4, np.float32), timeout=bad)
    assert comm.recorder.seq == seq               # refused calls use no sequence number


def test_ring_short_path_with_timeout_keeps_that_deadline(group):
    def phase(short):
        def run(comm):
            comm.short_path = short
            x = np.full(8, comm.rank + 1, np.float32)
            r, _ = call(comm, x, "sum", "inplace", timeout=7.5)
            comm.short_path = True
            return r.copy(), fields(comm.recorder.records(1)[0])
        return run
    general = group.run_ok(phase(False))
    with NoGeneral():
        short = group.run_ok(phase(True))
    for (a, ra), (b, rb) in zip(general, short):
        np.testing.assert_array_equal(a, b)
        assert ra == rb and ra["timeout"] == 7.5


def _hang(short: bool, invoke, timeout: float, sticky: bool):
    """Rank 0 calls ``invoke(comm, x)``, rank 1 never does: the error, the record, what the
    watchdog saw and (``sticky``) the error of the next allreduce, else None."""
    g = ThreadGroup(2, timeout=timeout)
    seen = []
    wd = types.SimpleNamespace(on_failure=lambda comm, rec, e: seen.append((rec.to_dict(), str(e))) or e)
    comm = g.comms[0]
    comm.watchdog, comm.short_path = wd, short
    after = None
    try:
        x = np.ones(1000, np.float32)
        with pytest.raises(CollectiveError) as ei:
            if short:
                with NoGeneral():
                    invoke(comm, x)
            else:
                invoke(comm, x)
        if sticky:
            with pytest.raises(CollectiveError) as after:
                comm.allreduce(x)                 # the communicator stays failed
        rec = fields(comm.recorder.records()[0])
    finally:
        g.close()
    mask = lambda s: re.sub(r"\d+\.\d+", "N", s)      # noqa: E731 - waited times differ
    return (mask(str(ei.value)), rec, [(d["op"], d["seq"], d["state"]) for d, _ in seen],
            mask(str(after.value)) if after is not None else None)


def hang(short: bool, timeout: float = 0.6):
    """An allreduce that rank 1 never joins (:func:`_hang`), then the sticky error."""
    return _hang(short, lambda comm, x: call(comm, x, "sum", "inplace"), timeout, True)


def test_ring_hang_on_the_short_path_is_reported_as_on_the_general_path():
    short = hang(True)
    general = hang(False)
    assert "allreduce#1" in short[0] and "deadline" in short[0]
    assert short[1]["state"] == "failed" and short[1]["error"]
    assert short[2][0] == ("allreduce", 1, "failed")     # the watchdog got the failed record
    assert short[:3] == general[:3]
    assert "allreduce#1" in short[3]


def host_call(comm, kind: str, x, mode: str, **kw):
    """allgather, reduce_scatter, broadcast, alltoall or barrier from one call site for both
    paths; ``mode`` as :func:`call` (``inplace`` only for alltoall; broadcast is in place).
    Returns (result, the object it must be or None)."""
    size = comm.size
    if kind == "barrier":
        return comm.barrier(**kw), None
    if kind == "broadcast":
        return comm.broadcast(x, root=size - 1, **kw), x
    n_out = {"allgather": x.size * size, "reduce_scatter": x.size // size, "alltoall": x.size}[kind]
    if mode in ("out", "outflat"):
        out = np.full(n_out if mode == "outflat" else (n_out // x.shape[-1], x.shape[-1]) if x.ndim > 1
                      and n_out % x.shape[-1] == 0 else n_out, 99, x.dtype)
    else:
        out = x if mode == "inplace" else None
    fn = getattr(comm, kind)
    return (fn(x, out=out, **kw) if kind != "reduce_scatter" else fn(x, "sum", out=out, **kw)), out


# (kind, mode): in place only for alltoall; broadcast (always in place) and barrier take no out=
HOST_CALLS = [(k, m) for k in ("allgather", "reduce_scatter", "alltoall") for m in MODES
              if m != "inplace" or k == "alltoall"] + [("broadcast", "new"), ("barrier", "new")]


@pytest.mark.parametrize("kind,mode", HOST_CALLS)
@pytest.mark.parametrize("tag", ["float32", "float64", "int32", "uint8", "float16"])
@pytest.mark.parametrize("shape", [(1024,), (16, 8), (4,)])
def test_ring_other_collectives_short_and_general_paths_agree(group, kind, tag, shape, mode):
    """The host short path of the other collectives: the same results (shape, dtype, object),
    the same flight records as the general path, and the general path never runs."""

    def phase(short):
        def run(comm):
            comm.short_path = short
            x = values(tag, comm.rank, shape)
            r, want = host_call(comm, kind, x, mode)
            if kind == "barrier":
                assert r is None
            else:
                assert (r is want) if want is not None else (r is not x)
                assert r.dtype == x.dtype
            rec = fields(comm.recorder.records(1)[0])
            comm.short_path = True
            return (None if r is None else (r.shape, r.copy())), rec
        return run
    general = group.run_ok(phase(False))
    with NoGeneral():
        short = group.run_ok(phase(True))
    for (a, ra), (b, rb) in zip(general, short):
        if a is None:
            assert b is None
        else:
            assert a[0] == b[0]
            np.testing.assert_array_equal(a[1], b[1])
        assert ra == rb and ra["state"] == "done" and ra["op"] == kind
    if kind == "allgather":       # and the values are every rank's, in rank order
        want = np.stack([values(tag, r, shape) for r in range(2)])
        np.testing.assert_array_equal(short[0][0][1].reshape(want.shape), want)


def test_ring_other_short_paths_refuse_what_the_general_path_refuses(group):
    comm = group.comms[0]
    seq = comm.recorder.seq
    with pytest.raises(UsageError, match="cannot be split"):
        comm.alltoall(np.ones(3, np.float32))                 # 3 elements over 2 ranks
    with pytest.raises(UsageError, match="root 2 out of range"):
        comm.broadcast(np.ones(4, np.float32), root=2)
    with pytest.raises(UsageError, match="elements"):
        comm.allgather(np.ones(4, np.float32), out=np.empty(7, np.float32))
    with pytest.raises(UsageError, match="unsupported op"):
        comm.reduce_scatter(np.ones(4, np.float32), "xor")
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(UsageError, match="read-only"):
        comm.broadcast(ro, root=0)
    with pytest.raises(UsageError, match="timeout"):
        comm.barrier(timeout=-1.0)
    assert comm.recorder.seq == seq               # refused calls use no sequence number


def hang_other(kind: str, short: bool, timeout: float = 0.6):
    """Rank 0 calls ``kind``, rank 1 never does (:func:`_hang`): the error, the record, what the watchdog saw."""
    return _hang(short, lambda comm, x: host_call(comm, kind, x, "new"), timeout, False)[:3]


@pytest.mark.parametrize("kind", ["allgather", "barrier"])
def test_ring_hang_on_the_other_short_paths_is_reported_as_on_the_general_path(kind):
    short = hang_other(kind, True)
    general = hang_other(kind, False)
    assert f"{kind}#1" in short[0] and "deadline" in short[0]
    assert short[1]["state"] == "failed" and short[1]["error"]
    assert short[2][0] == (kind, 1, "failed")
    assert short == general


# ---------------------------------------------------------------------------------------------
# nccl (fake layer)
# ---------------------------------------------------------------------------------------------
GPU = 1


fake = F.fake_cuda      # the fixture: fake cupy and torch in sys.modules


def nccl_comm(fake, size: int = 2, timeout: float = 5.0):
    fake.cp.cuda.Device(GPU).use()              # as NcclBackend.create leaves the rank's thread
    nc = F.FakeNcclComm(fake.cp, size, 0, GPU)
    be = N.NcclBackend(nc, 0, size, GPU, hosts=("gpu0",) * size, cupy=fake.cp,
                       nccl=F.make_nccl_module([nc]), version=22000)
    return Communicator(be, timeout=timeout), nc


@pytest.mark.parametrize("tag", ["float32", "float64", "int32", "uint8", "float16"])
@pytest.mark.parametrize("shape", [(256,), (8, 4)])
@pytest.mark.parametrize("mode", MODES)
def test_nccl_short_and_general_paths_agree(fake, tag, shape, mode):
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    out = {}
    for short in (False, True):
        comm.short_path = short
        res = []
        for op in OPS:
            if op == "avg" and tag not in FLOAT_DTYPES:
                continue
            x = cp.device_array(values(tag, 0, shape), device=GPU)
            stream = cp.cuda.get_current_stream(GPU)
            ncalls = len(nc.calls)
            if short:
                with NoGeneral():
                    r, want = call(comm, x, op, mode)
            else:
                r, want = call(comm, x, op, mode)
            comm.synchronize(5)
            assert (r is want if want is not None else r is not x)
            assert r.shape == (want.shape if want is not None else shape) and r.device.id == GPU
            new = nc.calls[ncalls:]
            assert [c["op"] for c in new] == ["allReduce"] and new[0]["stream"] == stream.ptr
            assert new[0]["device"] == GPU
            res.append((op, r.get(), fields(comm.recorder.records(1)[0]),
                        {k: new[0][k] for k in ("count", "dtype", "nccl_op")}))
        out[short] = res
    for (op, a, ra, ca), (op2, b, rb, cb) in zip(out[False], out[True]):
        assert op == op2 and ca == cb and ra == rb and ra["state"] == "done"
        np.testing.assert_array_equal(a, b)
    comm.close()


def other_call(comm, kind, x, op, mode):
    """allgather / broadcast / reduce_scatter through their public synchronous methods; mode
    "out" passes an out= of the result's shape filled with a wrong value first."""
    if kind == "broadcast":
        return comm.broadcast(x, 1), x
    shape = (comm.size, *x.shape) if kind == "allgather" else (x.shape[0] // comm.size, *x.shape[1:])
    out = None
    if mode == "out":
        out = fake_empty(x, shape)
        out[...] = 99
    if kind == "allgather":
        return comm.allgather(x, out=out), out
    return comm.reduce_scatter(x, op, out=out), out


def fake_empty(x, shape):
    cp = sys.modules["cupy"]
    with cp.cuda.Device(x.device.id):
        return cp.empty(shape, dtype=x.dtype)


@pytest.mark.parametrize("kind", ["allgather", "broadcast", "reduce_scatter"])
@pytest.mark.parametrize("tag", ["float32", "int64", "uint8", "float16"])
@pytest.mark.parametrize("mode", ["new", "out"])
def test_nccl_other_collectives_short_and_general_paths_agree(fake, kind, tag, mode):
    """The short path of allgather, broadcast and reduce_scatter: same results, flight records
    and NCCL calls (count, dtype, op, root, the caller's stream) as the general path."""
    if kind == "broadcast" and mode == "out":
        pytest.skip("broadcast is in place")
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    got = {}
    for short in (False, True):
        comm.short_path = short
        res = []
        for op in (OPS if kind == "reduce_scatter" else [None]):
            if op == "avg" and tag not in FLOAT_DTYPES:
                continue
            x = cp.device_array(values(tag, 0, (8, 3)), device=GPU)
            stream = cp.cuda.get_current_stream(GPU)
            ncalls = len(nc.calls)
            if short:
                with NoGeneral():
                    r, want = other_call(comm, kind, x, op, mode)
            else:
                r, want = other_call(comm, kind, x, op, mode)
            comm.synchronize(5)
            assert r is want if want is not None else (r is not x or kind == "broadcast")
            new = nc.calls[ncalls:]
            assert len(new) == 1 and new[0]["stream"] == stream.ptr and new[0]["device"] == GPU
            res.append((op, r.shape, r.get(), fields(comm.recorder.records(1)[0]),
                        {k: v for k, v in new[0].items() if k in ("op", "count", "dtype", "nccl_op", "root")}))
        got[short] = res
    assert len(got[False]) == len(got[True]) > 0
    for a, b in zip(got[False], got[True]):
        assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3] and a[4] == b[4] and a[3]["state"] == "done"
        np.testing.assert_array_equal(a[2], b[2])
    comm.close()


def test_nccl_other_collectives_leave_odd_calls_to_the_general_path(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    odd = cp.device_array(values("float32", 0, (7,)), device=GPU)      # 7 rows over 2 ranks
    with pytest.raises(AssertionError, match="general path ran"), NoGeneral():
        comm.reduce_scatter(odd)
    r = comm.reduce_scatter(odd)                                       # uneven chunks: general
    comm.synchronize(5)
    assert r.shape == (4,)
    x = cp.device_array(values("float32", 0, (4,)), device=GPU)
    with pytest.raises(UsageError, match="root 5"):
        comm.broadcast(x, 5)
    with NoGeneral():
        r = comm.allgather(x, out=fake_empty(x, (8,)))                 # another shape, same count: short
    comm.synchronize(5)
    assert r.shape == (8,)
    np.testing.assert_array_equal(r.get(), np.tile(values("float32", 0, (4,)), 2))
    with pytest.raises(AssertionError, match="general path ran"), NoGeneral():
        comm.allgather(x, out=fake_empty(x, (6,)))                     # a wrong count: the general path ...
    with pytest.raises(UsageError, match="6 elements"):
        comm.allgather(x, out=fake_empty(x, (6,)))                     # ... explains it
    seq = comm.recorder.seq
    for kind in ("allreduce", "reduce_scatter"):                       # no op: the general path's error
        with pytest.raises(UsageError, match="unsupported op None"):
            getattr(comm, kind)(x, None)
    assert comm.recorder.seq == seq
    comm.close()


def test_nccl_short_path_returns_before_the_gpu_finished_and_keeps_the_deadline(fake):
    cp = fake.cp
    comm, nc = nccl_comm(fake, timeout=0.3)
    seen = []
    comm.watchdog = types.SimpleNamespace(on_failure=lambda c, rec, e: seen.append(rec.to_dict()) or e)
    x = cp.device_array(np.ones(64, np.float32), device=GPU)
    cp.gpu_busy = True                             # the GPU never finishes: a hang
    with NoGeneral():
        y = comm.allreduce(x, out=x)               # returns at once, in flight
    assert y is x and comm.recorder.records()[-1].state == "started"
    with pytest.raises(CollectiveError, match="allreduce#1.*deadline"):
        comm.synchronize(10)
    assert [(d["op"], d["seq"], d["state"]) for d in seen] == [("allreduce", 1, "failed")]
    with pytest.raises(CollectiveError, match="allreduce#1"):
        comm.allreduce(x, out=x)                   # sticky
    cp.gpu_busy = False
    comm.close()


def test_nccl_short_path_is_not_taken_with_another_gpu_current(fake):
    """The short path does not switch GPUs: with another device current (a thread that uses
    several), the general path runs the call on the backend's GPU and gives the same result."""
    cp = fake.cp
    comm, nc = nccl_comm(fake)
    x = cp.device_array(values("float32", 0, (64,)), device=GPU)
    cp.cuda.Device(0).use()
    with pytest.raises(AssertionError, match="general path ran"), NoGeneral():
        comm.allreduce(x, out=x)
    r = comm.allreduce(x)
    comm.synchronize(5)
    assert nc.calls[-1]["device"] == GPU and cp.cuda.runtime.getDevice() == 0
    np.testing.assert_array_equal(r.get(), values("float32", 0, (64,)) * 2)
    comm.close()


def test_nccl_short_path_leaves_other_calls_to_the_general_path(fake):
    cp, torch = fake.cp, fake.torch
    comm, nc = nccl_comm(fake)
    other = cp.device_array(np.ones(8, np.float32), device=0)      # wrong GPU: explained
    with pytest.raises(UsageError, match="GPU 0"):
        comm.allreduce(other)
    t = torch.cuda_tensor(np.ones(8, np.float32), torch.float32, device_index=GPU)
    r = comm.allreduce(t)                                         # torch: general path
    comm.synchronize(5)
    assert type(r) is type(t)
    comm.close()


# ---------------------------------------------------------------------------------------------
# torch CPU tensors on the ring (the numpy view cached per tensor)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", ["float32", "float64", "int64", "uint8"])
@pytest.mark.parametrize("inplace", [False, True])
def test_ring_torch_cpu_tensors_short_and_general_agree(group, tag, inplace):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "from_numpy") or getattr(torch, "__file__", None) is None:
        pytest.skip("needs the real torch")

    def phase(short):
        def run(comm):
            comm.short_path = short
            out = []
            t = torch.from_numpy(values(tag, comm.rank, (4, 6)))
            for _ in range(2):                       # the second call hits the cached view
                y = t.clone()
                r, _ = call(comm, y, "sum", "inplace" if inplace else "new")
                assert (r is y) == inplace and type(r) is torch.Tensor and r.shape == (4, 6)
                out.append((r.numpy().copy(), fields(comm.recorder.records(1)[0])))
                r2, _ = call(comm, t, "max", "new")     # t itself, twice: cached
                out.append((r2.numpy().copy(), fields(comm.recorder.records(1)[0])))
            t.resize_(3)                             # a changed tensor: its view is made again
            t.copy_(torch.from_numpy(values(tag, comm.rank, (3,))))
            r3, _ = call(comm, t, "sum", "inplace")
            out.append((r3.numpy().copy(), fields(comm.recorder.records(1)[0])))
            comm.short_path = True
            return out
        return run
    general = group.run_ok(phase(False))
    with NoGeneral():
        short = group.run_ok(phase(True))
    for g, s in zip(general, short):
        for (a, ra), (b, rb) in zip(g, s):
            np.testing.assert_array_equal(a, b)
            assert ra == rb and ra["dtype"] == tag
    expect = values(tag, 0, (3,)) + values(tag, 1, (3,))
    np.testing.assert_array_equal(short[0][-1][0], expect)


def test_torch_view_cache_lets_tensors_go(group):
    torch = pytest.importorskip("torch")
    comm = group.comms[0]
    views = comm.__dict__.setdefault("_views", {})

    seen = []

    def run(c):
        t = torch.ones(16)
        c.allreduce(t, out=t)
        if c is comm:
            seen.append(len(views))
        return float(t[0])
    assert group.run_ok(run) == [2.0, 2.0] and seen == [1]
    import gc
    gc.collect()
    assert not views                                 # the tensor died: its entry went with it
