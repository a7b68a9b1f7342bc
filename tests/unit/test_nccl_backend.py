"""NCCL backend: the pure-Python parts always (unique id bytes, op/dtype mapping, deadline logic
with a fake communicator); the GPU parts only with cupy and an NVIDIA GPU."""
from __future__ import annotations

import contextlib
import types

import pytest

from hpcring.collectives import nccl as N
from hpcring.collectives.backends import DTYPES, OPS
from hpcring.errors import CollectiveError, UsageError


def test_unique_id_round_trips_as_raw_bytes():
    uid = tuple((i * 37) % 256 - 128 for i in range(128))
    data = N.uid_to_bytes(uid)
    assert isinstance(data, bytes) and len(data) == 128
    assert N.uid_from_bytes(data) == uid
    assert all(-128 <= c <= 127 for c in N.uid_from_bytes(bytes(range(128))))
    with pytest.raises(CollectiveError, match="expected 128"):
        N.uid_from_bytes(b"\x00" * 10)


def test_dtype_and_op_mapping():
    new, old = 22000, 20800
    assert [N.nccl_dtype(d, new) for d in DTYPES] == [6, 9, 7, 8, 2, 4, 1]
    with pytest.raises(CollectiveError, match="bfloat16 needs NCCL >= 2.10.3, this is NCCL 2.8.0"):
        N.nccl_dtype("bfloat16", old)
    assert N.nccl_op("avg", "float32", new) == (4, False)          # ncclAvg
    assert N.nccl_op("avg", "float16", old) == (0, True)           # sum + divide
    assert [N.nccl_op(o, "int32", new)[0] for o in OPS if o != "avg"] == [0, 1, 3, 2]
    with pytest.raises(UsageError, match="avg"):
        N.nccl_op("avg", "int64", new)
    # names exported by cupy win over the built-in numbers
    fake = types.SimpleNamespace(NCCL_FLOAT32=70, NCCL_AVG=40)
    assert N.nccl_dtype("float32", new, fake) == 70 and N.nccl_op("avg", "float64", new, fake) == (40, False)
    assert N.format_version(21805) == "2.18.5" and N.format_version(2708) == "2.7.8"


def test_wait_for_polls_with_growing_sleeps_until_the_deadline():
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s
    expired = N.wait_for(lambda: False, lambda: None, timeout=0.01, t0=0.0, clock=lambda: now[0], sleep=sleep)
    assert expired is not None and expired >= 0.01
    assert sleeps[0] == pytest.approx(50e-6) and max(sleeps) <= 1e-3 and sleeps[1] == pytest.approx(100e-6)
    assert N.wait_for(lambda: True, lambda: None, timeout=1.0, t0=0.0) is None


class _FakeComm:
    def __init__(self, async_error=None):
        self.aborted = False
        self.async_error = async_error
        self.calls = []

    def allReduce(self, *a):
        self.calls.append(("allReduce", a))

    def check_async_error(self):
        if self.async_error:
            raise RuntimeError(self.async_error)

    def abort(self):
        self.aborted = True

    def destroy(self):
        pass


def _buf():
    return types.SimpleNamespace(size=1000)


def _fake_backend(comm, done=False):
    class Event:
        def __init__(self, **kw):
            pass

        def record(self, stream):
            pass

        @property
        def done(self):
            return done
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, get_current_stream=lambda: stream,
                                                            Device=lambda i: contextlib.nullcontext()),
                                 ndarray=type(None))
    b = N.NcclBackend(comm, 0, 2, 0, hosts=("gpu1", "gpu2"), cupy=cupy, nccl=types.SimpleNamespace(), version=22000)
    dev = types.SimpleNamespace(size=1000, data=types.SimpleNamespace(ptr=4096))
    b._device = lambda buf, dtype: (dev, None)
    return b


def test_deadline_aborts_the_communicator_and_names_the_op():
    comm = _FakeComm()
    b = _fake_backend(comm)
    with pytest.raises(CollectiveError) as ei:
        b.allreduce(_buf(), _buf(), "float32", "sum", 0.05)
    msg = str(ei.value)
    assert "allreduce#1(count=1000, dtype=float32, 4000 bytes, op=sum)" in msg
    assert "0.05 s deadline" in msg and "rank 0 (gpu1, GPU 0)" in msg and "aborted" in msg
    assert comm.aborted and comm.calls and b.error
    with pytest.raises(CollectiveError, match="allreduce#1"):     # sticky
        b.barrier(1.0)


def test_async_error_aborts_at_once():
    comm = _FakeComm(async_error="NCCL_ERROR_SYSTEM_ERROR: remote peer closed")
    b = _fake_backend(comm)
    with pytest.raises(CollectiveError, match="allreduce#1.*NCCL async error: NCCL_ERROR_SYSTEM_ERROR"):
        b.allreduce(_buf(), _buf(), "float32", "max", 30.0)
    assert comm.aborted


def test_completed_op_returns():
    comm = _FakeComm()
    b = _fake_backend(comm, done=True)
    b.allreduce(_buf(), _buf(), "bfloat16", "sum", 1.0)
    assert comm.calls[0][1][2:5] == (1000, 9, 0) and not comm.aborted and b.error is None


def test_create_without_cupy_or_gpu_says_why():
    topo = types.SimpleNamespace(rank=0, size=1, local_rank=0, host="here", hosts=("here",))
    if N.gpu_available():
        pytest.skip("a GPU is visible: the refusal path is not reachable")
    with pytest.raises(CollectiveError, match="CuPy|GPU"):
        N.NcclBackend.create(topo, store=None)


needs_gpu = pytest.mark.skipif(not N.gpu_available(), reason="no NVIDIA GPU/cupy")


@pytest.mark.gpu
@needs_gpu
def test_single_rank_allreduce_on_gpu():
    import cupy

    from hpcring.bootstrap.store import StoreClient, StoreServer
    from hpcring.collectives.api import Communicator
    secret = b"s" * 32
    topo = types.SimpleNamespace(rank=0, size=1, local_rank=0, host="here", hosts=("here",))
    with StoreServer("127.0.0.1", 0, secret=secret) as srv:
        store = StoreClient("127.0.0.1", srv.port, secret)
        comm = Communicator(N.NcclBackend.create(topo, store, timeout=30.0), timeout=30.0)
        x = cupy.arange(10, dtype=cupy.float32)
        y = comm.allreduce(x)
        assert cupy.allclose(cupy.asarray(y), x)
        comm.barrier()
        comm.close()
