"""NCCL backend: the pure-Python parts always (unique id bytes, op/dtype mapping, deadline logic
with a fake communicator); the GPU parts only with cupy and an NVIDIA GPU."""
from __future__ import annotations

import contextlib
import types

import pytest

from hpcring.collectives import nccl as N
from hpcring.collectives import nccl_lib as NL
from hpcring.collectives.backends import DTYPES, OPS
from hpcring.errors import CollectiveError, UsageError


def test_unique_id_round_trips_as_raw_bytes_for_old_and_new_cupy():
    old = tuple((i * 37) % 256 - 128 for i in range(128))        # CuPy <= 13: signed chars
    data = NL.uid_to_bytes(old)
    assert isinstance(data, bytes) and len(data) == 128
    assert NL.uid_from_bytes(data) == old
    assert NL.uid_from_bytes(data, as_bytes=True) == data           # CuPy >= 14: bytes
    assert NL.uid_to_bytes(data) == data
    assert all(-128 <= c <= 127 for c in NL.uid_from_bytes(bytes(range(128))))
    with pytest.raises(CollectiveError, match="expected 128"):
        NL.uid_from_bytes(b"\x00" * 10)
    assert NL.uid_takes_bytes(types.SimpleNamespace(__version__="14.2.0"))
    assert not NL.uid_takes_bytes(types.SimpleNamespace(__version__="13.6.0"))


def _real_nccl():
    """The installed CuPy's NCCL module (CI installs cupy-cuda12x and nvidia-nccl-cu12: both import
    and hand out unique ids without a GPU)."""
    try:
        import cupy
        from cupy.cuda import nccl
        nccl.get_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"CuPy with NCCL is not importable here: {e}")
    return cupy, nccl


def test_real_cupy_unique_id_reaches_ncclcomminitrank_in_the_type_it_takes():
    """The glue against the real library: the id from get_unique_id goes through the store's bytes
    and comes back in the type this CuPy's NcclCommunicator accepts. Without a GPU the call then
    fails inside CUDA/NCCL -- never with the argument TypeError that broke every GPU run."""
    cupy, nccl = _real_nccl()
    raw = NL.uid_to_bytes(nccl.get_unique_id())
    assert len(raw) == 128
    uid = NL.uid_from_bytes(raw, as_bytes=NL.uid_takes_bytes(cupy))
    try:
        comm = nccl.NcclCommunicator(1, uid, 0)
    except TypeError as e:
        pytest.fail(f"NcclCommunicator refused the unique id's type: {e}")
    except Exception as e:  # noqa: BLE001 - NcclError / CUDA error without a GPU
        assert "commId" not in str(e)
    else:                                # a GPU is visible: a real one-rank communicator
        comm.destroy()
    topo = types.SimpleNamespace(rank=0, size=1, host="here")
    if NL.gpu_count() == 0:               # the whole creation path: an NcclError, named
        with pytest.raises(CollectiveError, match=r"ncclCommInitRank failed on rank 0 \(here, GPU 0\)"):
            N._init_rank(nccl, topo, raw, NL.uid_takes_bytes(cupy), 0)
    # the other form is what the other CuPy generation takes: this one refuses it by type
    with pytest.raises(TypeError, match="commId"):
        nccl.NcclCommunicator(1, NL.uid_from_bytes(raw, as_bytes=not NL.uid_takes_bytes(cupy)), 0)


def test_init_rank_retries_with_the_other_id_type_when_cupy_refuses_it():
    calls = []

    class Comm:
        def __init__(self, n, uid, rank):
            calls.append(type(uid).__name__)
            if not isinstance(uid, bytes):
                raise TypeError("Argument 'commId' has incorrect type (expected bytes, got tuple)")
    nccl = types.SimpleNamespace(NcclCommunicator=Comm)
    topo = types.SimpleNamespace(rank=1, size=2, host="gpu7")
    assert isinstance(N._init_rank(nccl, topo, bytes(128), False, 0), Comm)
    assert calls == ["tuple", "bytes"]


def test_two_ranks_on_one_gpu_are_refused_naming_them():
    NL.check_gpu_sharing(0, {0: "0000:1b:00.0", 1: "0000:1c:00.0"}, "gpu1")       # distinct: fine
    with pytest.raises(CollectiveError) as ei:
        NL.check_gpu_sharing(3, {2: "0000:1b:00.0", 3: "0000:1b:00.0", 4: "0000:1c:00.0"}, "gpu1")
    msg = f"{ei.value} {ei.value.hint}"
    assert "ranks 2, 3 on gpu1 would share one GPU (PCI 0000:1b:00.0)" in msg
    assert "--gpus-per-node" in msg and "CUDA_VISIBLE_DEVICES" in msg


def test_gpu_sharing_check_reads_only_the_ranks_of_this_host():
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    secret = b"k" * 32
    hosts = ("a", "a", "b")
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        deviceGetPCIBusId=lambda d: f"0000:0{d}:00.0")))
    with StoreServer("127.0.0.1", 0, secret=secret) as srv:
        store = StoreClient("127.0.0.1", srv.port, secret)
        store.set("nccl/1/gpu/1", b"0000:00:00.0")      # rank 1 on host a: GPU 0, like rank 0
        topo = types.SimpleNamespace(rank=0, size=3, host="a", hosts=hosts)
        with pytest.raises(CollectiveError, match="ranks 0, 1 on a would share"):
            N._check_one_gpu_per_rank(topo, store, 1, cupy, 0, 5.0)
        topo2 = types.SimpleNamespace(rank=2, size=3, host="b", hosts=hosts)
        N._check_one_gpu_per_rank(topo2, store, 1, cupy, 0, 5.0)   # alone on b: rank 0/1 never read


def test_dtype_and_op_mapping():
    new, old = 22000, 20800
    assert [NL.nccl_dtype(d, new) for d in DTYPES] == [6, 9, 7, 8, 2, 4, 1]
    with pytest.raises(CollectiveError, match="bfloat16 needs NCCL >= 2.10.3, this is NCCL 2.8.0"):
        NL.nccl_dtype("bfloat16", old)
    assert NL.nccl_op("avg", "float32", new) == (4, False)          # ncclAvg
    assert NL.nccl_op("avg", "float16", old) == (0, True)           # sum + divide
    assert [NL.nccl_op(o, "int32", new)[0] for o in OPS if o != "avg"] == [0, 1, 3, 2]
    with pytest.raises(UsageError, match="avg"):
        NL.nccl_op("avg", "int64", new)
    # names exported by cupy win over the built-in numbers
    fake = types.SimpleNamespace(NCCL_FLOAT32=70, NCCL_AVG=40)
    assert NL.nccl_dtype("float32", new, fake) == 70 and NL.nccl_op("avg", "float64", new, fake) == (40, False)
    assert NL.format_version(21805) == "2.18.5" and NL.format_version(2708) == "2.7.8"


def test_wait_for_polls_with_growing_sleeps_until_the_deadline():
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s
    expired = NL.wait_for(lambda: False, lambda: None, timeout=0.01, t0=0.0, clock=lambda: now[0], sleep=sleep)
    assert expired is not None and expired >= 0.01
    assert sleeps[0] == pytest.approx(50e-6) and max(sleeps) <= 1e-3 and sleeps[1] == pytest.approx(100e-6)
    assert NL.wait_for(lambda: True, lambda: None, timeout=1.0, t0=0.0) is None


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
    """The real NcclBackend over a fake communicator; ``gpu.done`` says whether the GPU has
    finished the enqueued work (every event's ``done``)."""
    gpu = types.SimpleNamespace(done=done, events=0)

    class Event:
        def __init__(self, **kw):
            gpu.events += 1

        def record(self, stream=None):
            pass

        @property
        def done(self):
            return gpu.done
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, get_current_stream=lambda: stream,
                                                            Device=lambda i: contextlib.nullcontext()),
                                 ndarray=type(None))
    b = N.NcclBackend(comm, 0, 2, 0, hosts=("gpu1", "gpu2"), cupy=cupy, nccl=types.SimpleNamespace(), version=22000)
    dev = types.SimpleNamespace(size=1000, data=types.SimpleNamespace(ptr=4096))
    b._device = lambda buf, dtype: (dev, None)
    b.gpu = gpu
    return b


def test_device_op_returns_before_the_gpu_finished_and_polls_to_completion():
    comm = _FakeComm()
    b = _fake_backend(comm)
    p = b.allreduce(_buf(), _buf(), "bfloat16", "sum", 30.0)      # enqueued, GPU still busy
    assert isinstance(p, N.Pending) and b.take_pending() is p and b.take_pending() is None
    assert comm.calls[0][1][2:5] == (1000, 9, 0) and not comm.aborted
    assert b.poll(p) is False
    b.gpu.done = True
    assert b.poll(p) is True and b.error is None


def test_deadline_aborts_the_communicator_and_names_the_op():
    comm = _FakeComm()
    b = _fake_backend(comm)
    p = b.allreduce(_buf(), _buf(), "float32", "sum", 0.05)
    with pytest.raises(CollectiveError) as ei:
        b.wait(p)
    msg = str(ei.value)
    assert "allreduce#1(count=1000, dtype=float32, 4000 bytes, op=sum)" in msg
    assert "0.05 s deadline" in msg and "rank 0 (gpu1, GPU 0)" in msg and "aborted" in msg
    assert comm.aborted and comm.calls and b.error
    with pytest.raises(CollectiveError, match="allreduce#1"):     # sticky
        b.barrier(1.0)
    with pytest.raises(CollectiveError, match="allreduce#1"):
        b.poll(p)


def test_async_error_aborts_at_once():
    comm = _FakeComm(async_error="NCCL_ERROR_SYSTEM_ERROR: remote peer closed")
    b = _fake_backend(comm)
    p = b.allreduce(_buf(), _buf(), "float32", "max", 30.0)
    with pytest.raises(CollectiveError, match="allreduce#1.*NCCL async error: NCCL_ERROR_SYSTEM_ERROR"):
        b.poll(p)
    assert comm.aborted


def test_create_without_cupy_or_gpu_says_why():
    topo = types.SimpleNamespace(rank=0, size=1, local_rank=0, host="here", hosts=("here",))
    if NL.gpu_available():
        pytest.skip("a GPU is visible: the refusal path is not reachable")
    with pytest.raises(CollectiveError, match="CuPy|GPU"):
        N.NcclBackend.create(topo, store=None)


needs_gpu = pytest.mark.skipif(not NL.gpu_available(), reason="no NVIDIA GPU/cupy")


@pytest.mark.gpu
@needs_gpu
def test_single_rank_allreduce_on_gpu():
    import cupy

    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
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


@pytest.mark.gpu
@needs_gpu
def test_torch_process_group_on_nccl_is_stream_ordered():
    """CUDA tensors on the hpcring process group over NCCL: the Work is complete at once (its
    future CUDA-aware, as torch's NCCL works), the GPU still busy, and the results right."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    from hpcring.collectives.api import Communicator
    from hpcring.distributed.hooks import allreduce_hook
    from hpcring.distributed.process_group import ProcessGroupHpcring
    secret = b"s" * 32
    topo = types.SimpleNamespace(rank=0, size=1, local_rank=0, host="here", hosts=("here",))
    with StoreServer("127.0.0.1", 0, secret=secret) as srv:
        store = StoreClient("127.0.0.1", srv.port, secret)
        comm = Communicator(N.NcclBackend.create(topo, store, timeout=30.0), timeout=30.0)
        pg = ProcessGroupHpcring(types.SimpleNamespace(communicator=lambda *a, **k: comm), 0, 1)
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        want = x.clone()
        torch.cuda._sleep(200_000_000)             # keep the stream busy for a while
        w = pg.allreduce([x])
        assert w.get_future().done() and not w.is_completed()
        outs = [torch.empty_like(x)]
        g = pg.allgather([outs], [x])              # copy-outs enqueued behind the collective
        g.wait()                                   # orders the current stream; no host wait
        bucket = types.SimpleNamespace(buffer=lambda: x)
        assert allreduce_hook(comm, bucket).done()
        torch.cuda.synchronize()
        comm.synchronize()
        assert w.is_completed() and g.is_completed() and w.exception() is None
        assert torch.equal(x, want) and torch.equal(outs[0], want)
        comm.close()
