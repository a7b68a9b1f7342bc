"""ncclCommShrink for elastic rounds (nccl_raw.py, NcclBackend.shrink, elastic/nccl_round.py).

No GPU here (and the lent machine has one GPU: NCCL refuses two ranks on one GPU), so the data
path runs on a fake libnccl made of C function pointers with nccl.h's prototypes (ctypes.CFUNCTYPE:
the same argument conversion as the real library). The prototypes themselves are checked against
the installed nvidia-nccl-cu12 header, and the symbols and version against its libnccl.so.2.
"""
from __future__ import annotations

import ctypes
import random
import re
import threading
import time
import types

import pytest

from hpcring.collectives import nccl_raw as R
from hpcring.errors import CollectiveError

# the fake's error strings come back through a ctypes callback returning char*, which ctypes
# cannot free: it warns once per call
pytestmark = pytest.mark.filterwarnings("ignore:memory leak in callback function:RuntimeWarning")


# ---------------------------------------------------------------------------------------------
# the installed library and header
# ---------------------------------------------------------------------------------------------
def _header() -> str:
    path = R.library_path()
    if path is None:
        pytest.skip("nvidia-nccl-cu12 is not installed")
    import os
    h = os.path.join(os.path.dirname(os.path.dirname(path)), "include", "nccl.h")
    if not os.path.exists(h):
        pytest.skip("the wheel has no nccl.h")
    return open(h).read()


_C_TO_CTYPES = {"ncclComm_t": ctypes.c_void_p, "const ncclComm_t": ctypes.c_void_p, "void*": ctypes.c_void_p,
                "const void*": ctypes.c_void_p, "size_t": ctypes.c_size_t, "int": ctypes.c_int,
                "ncclDataType_t": ctypes.c_int, "ncclRedOp_t": ctypes.c_int, "cudaStream_t": ctypes.c_void_p,
                "int*": ctypes.POINTER(ctypes.c_int), "ncclResult_t*": ctypes.POINTER(ctypes.c_int),
                "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p), "ncclConfig_t*": ctypes.c_void_p}


def _c_type(param: str):
    param = re.sub(r"\s+", " ", param.strip())
    words = re.sub(r"\s*\*\s*", "* ", param).split()
    if words[-1] not in ("*",) and not words[-1].endswith("*") and len(words) > 1:
        words = words[:-1]          # drop the parameter's name
    return _C_TO_CTYPES[" ".join(words).replace("* ", "*").replace(" *", "*").strip()]


def test_prototypes_match_the_installed_nccl_header():
    text = _header()
    for fn, args in R.PROTOTYPES.items():
        m = re.search(r"ncclResult_t\s+" + fn + r"\s*\(([^)]*)\)\s*;", text)
        assert m, f"{fn} is not in nccl.h"
        params = [p for p in m.group(1).split(",") if p.strip() and p.strip() != "void"]
        assert [_c_type(p) for p in params] == list(args), f"{fn}: nccl.h says ({m.group(1)})"


def test_shrink_flags_match_the_header():
    text = _header()
    assert int(re.search(r"#define NCCL_SHRINK_ABORT (0x[0-9a-f]+)", text).group(1), 16) == R.SHRINK_ABORT
    assert int(re.search(r"#define NCCL_SHRINK_DEFAULT (0x[0-9a-f]+)", text).group(1), 16) == R.SHRINK_DEFAULT
    assert re.search(r"ncclInProgress\s*=\s*(\d+)", text).group(1) == str(R.IN_PROGRESS)


def test_the_installed_libnccl_has_shrink_and_revoke_and_says_its_version():
    path = R.library_path()
    if path is None:
        pytest.skip("nvidia-nccl-cu12 is not installed")
    lib = R.load(path)
    v = R.version(lib)
    assert v >= 20000
    assert R.has_shrink(lib) == (v >= R.SHRINK_MIN_VERSION)
    assert R.has_shrink(lib), f"the CI wheel is NCCL {v}: expected >= 2.27"
    assert R.has_revoke(lib)
    assert lib.ncclCommShrink.argtypes == R.PROTOTYPES["ncclCommShrink"]


# ---------------------------------------------------------------------------------------------
# a fake libnccl with the real prototypes
# ---------------------------------------------------------------------------------------------
class FakeLib:
    """Attributes are C function pointers (CFUNCTYPE) over Python bodies, so calls go through the
    same ctypes conversions as the real library's. ``calls``: (name, args) as the C side saw them."""

    ERRORS = {0: b"no error", 2: b"unhandled system error", 3: b"internal error", 5: b"invalid usage"}

    def __init__(self, *, shrink_status=0, new_comm=0xBEEF, rank=0, size=2, block: threading.Event | None = None,
                 async_status=0, data_status=0, without=()):
        self.calls: list[tuple] = []
        self.aborted: list[int] = []
        self._keep = []
        st = self

        def body(name):
            def shrink(comm, excl, n, out, config, flags):
                st.calls.append((name, comm, [excl[i] for i in range(n)], n, config, flags))
                if block is not None:
                    block.wait(30)
                    return 5
                if shrink_status == 0:
                    out[0] = new_comm
                return shrink_status

            def one_int(value):
                def f(comm, p):
                    st.calls.append((name, comm))
                    p[0] = value
                    return 0
                return f

            def abort(comm):
                st.calls.append((name, comm))
                st.aborted.append(comm)
                if block is not None:
                    block.set()
                return 0

            def generic(*a):
                st.calls.append((name, *a))
                return data_status
            special = {"ncclCommShrink": shrink, "ncclCommAbort": abort, "ncclCommCount": one_int(size),
                       "ncclCommUserRank": one_int(rank), "ncclCommGetAsyncError": one_int(async_status),
                       "ncclGetVersion": lambda p: (p.__setitem__(0, 23203), 0)[1]}
            return special.get(name, generic)

        for name, args in R.PROTOTYPES.items():
            if name in without:
                continue
            f = ctypes.CFUNCTYPE(ctypes.c_int, *args)(body(name))
            self._keep.append(f)
            setattr(self, name, f)
        err = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_int)(lambda s: st.ERRORS.get(s, b"unknown"))
        last = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(lambda c: b"peer 1 vanished")
        self._keep += [err, last]
        self.ncclGetErrorString, self.ncclGetLastError = err, last


class Parent:
    """What shrink() needs of CuPy's NcclCommunicator: ``comm`` and ``abort()``."""

    def __init__(self, ptr=0x1234, lib=None):
        self.comm, self.lib, self.aborted = ptr, lib, False

    def abort(self):
        self.aborted = True
        if self.lib is not None:
            self.lib.ncclCommAbort(self.comm)


@pytest.mark.parametrize("seed", range(20))
def test_shrink_passes_the_excluded_ranks_sorted_once_with_the_abort_flag(seed):
    rng = random.Random(seed)
    exclude = [rng.randrange(64) for _ in range(rng.randrange(1, 6))]
    lib = FakeLib(new_comm=0xC0FFEE)
    raw = R.shrink(lib, Parent(0x1234), exclude, timeout=5)
    name, comm, excl, n, config, flags = lib.calls[0]
    assert (name, comm, config, flags) == ("ncclCommShrink", 0x1234, None, R.SHRINK_ABORT)
    assert excl == sorted(set(exclude)) and n == len(excl)
    assert raw.comm == 0xC0FFEE


def test_shrink_error_names_nccls_words():
    lib = FakeLib(shrink_status=3)
    with pytest.raises(CollectiveError, match=r"ncclCommShrink \(excluding ranks \[2\]\) failed: .*internal error"
                                              r".*peer 1 vanished.*ncclResult_t 3"):
        R.shrink(lib, Parent(), [2], timeout=5)


def test_shrink_that_hangs_aborts_the_parent_and_fails_within_its_deadline():
    gate = threading.Event()
    lib = FakeLib(block=gate)
    parent = Parent(0x77, lib)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"did not return within 0.3 s.*parent communicator was aborted"):
        R.shrink(lib, parent, [1], timeout=0.3)
    assert time.monotonic() - t0 < 5
    assert parent.aborted and lib.aborted == [0x77]


def test_a_library_without_shrink_is_refused_before_any_call():
    lib = FakeLib(without=("ncclCommShrink",))
    assert not R.has_shrink(lib)
    with pytest.raises(CollectiveError, match="needs NCCL >= 2.27"):
        R.shrink(lib, Parent(), [1], timeout=1)
    assert lib.calls == []


def test_raw_comm_calls_take_cupys_arguments_and_raise_nccl_errors():
    lib = FakeLib(rank=1, size=3)
    c = R.RawComm(lib, 0xAB)
    assert (c.rank_id(), c.size(), c.comm) == (1, 3, 0xAB)
    c.allReduce(0x10, 0x20, 5, 7, 0, 0x99)
    c.reduceScatter(0x10, 0x20, 5, 7, 2, 0x99)
    c.allGather(0x10, 0x20, 5, 1, 0x99)
    c.broadcast(0x10, 0x10, 5, 1, 2, 0x99)
    c.send(0x10, 4, 1, 2, 0x99)
    c.recv(0x20, 4, 1, 0, 0x99)
    got = [x for x in lib.calls if x[0].startswith("nccl") and x[0] not in ("ncclCommCount", "ncclCommUserRank")]
    assert got == [("ncclAllReduce", 0x10, 0x20, 5, 7, 0, 0xAB, 0x99),
                   ("ncclReduceScatter", 0x10, 0x20, 5, 7, 2, 0xAB, 0x99),
                   ("ncclAllGather", 0x10, 0x20, 5, 1, 0xAB, 0x99),
                   ("ncclBroadcast", 0x10, 0x10, 5, 1, 2, 0xAB, 0x99),
                   ("ncclSend", 0x10, 4, 1, 2, 0xAB, 0x99),
                   ("ncclRecv", 0x20, 4, 1, 0, 0xAB, 0x99)]
    bad = R.RawComm(FakeLib(data_status=2), 0xAB)
    with pytest.raises(R.NcclRawError, match="ncclAllReduce: unhandled system error: peer 1 vanished"):
        bad.allReduce(0x10, 0x20, 5, 7, 0, 0)


def test_raw_comm_async_error_in_progress_is_not_an_error():
    R.RawComm(FakeLib(async_status=R.IN_PROGRESS), 1).check_async_error()
    with pytest.raises(R.NcclRawError, match="internal error"):
        R.RawComm(FakeLib(async_status=3), 1).check_async_error()


def test_raw_comm_abort_and_destroy_free_once():
    lib = FakeLib()
    c = R.RawComm(lib, 0x5)
    c.abort()
    c.abort()
    c.destroy()
    assert lib.aborted == [0x5]
    with pytest.raises(CollectiveError, match="NULL communicator"):
        R.RawComm(lib, 0)


# ---------------------------------------------------------------------------------------------
# NcclBackend: revoke instead of abort when kept for a shrink; shrink into a RawComm
# ---------------------------------------------------------------------------------------------
def _backend(lib, monkeypatch, *, rank=0, size=3, revoke=True):
    from hpcring.collectives import nccl as N
    monkeypatch.setattr(R, "_lib", lib)
    if not revoke:
        monkeypatch.delattr(lib, "ncclCommRevoke")
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda i: types.SimpleNamespace(use=lambda: None)))
    parent = Parent(0x1234, lib)
    be = N.NcclBackend(parent, rank, size, 0, hosts=("a", "b", "c")[:size], cupy=cp, nccl=None, version=23203)
    return be, parent


def test_a_kept_communicator_is_revoked_not_aborted_on_failure(monkeypatch):
    lib = FakeLib()
    be, parent = _backend(lib, monkeypatch)
    be.keep_for_shrink = True
    be.abort("round 3 lost")
    assert [c for c in lib.calls if c[0] == "ncclCommRevoke"] == [("ncclCommRevoke", 0x1234, 0)]
    assert not parent.aborted and not be._freed
    with pytest.raises(CollectiveError, match="round 3 lost"):
        be.poll(types.SimpleNamespace())
    be.close()                         # revoked and never shrunk: close frees it
    assert parent.aborted and be._freed


def test_without_revoke_or_keep_a_failure_aborts_and_frees(monkeypatch):
    for keep, revoke in ((True, False), (False, True)):
        lib = FakeLib()
        be, parent = _backend(lib, monkeypatch, revoke=revoke)
        be.keep_for_shrink = keep
        be.abort("lost")
        assert parent.aborted and be._freed
        assert not [c for c in lib.calls if c[0] == "ncclCommRevoke"]


def test_backend_shrink_makes_a_raw_comm_with_the_rounds_rank_and_aborts_the_parent(monkeypatch):
    from hpcring.collectives import nccl as N
    lib = FakeLib(new_comm=0xD00D, rank=1, size=2)
    be, parent = _backend(lib, monkeypatch)
    topo = types.SimpleNamespace(rank=1, size=2, hosts=("a", "c"))
    new = N.NcclBackend.shrink(be, [1], topo, timeout=5)
    assert isinstance(new._comm, R.RawComm) and new._comm.comm == 0xD00D
    assert (new.rank, new.size, new.device_id, new.version) == (1, 2, 0, 23203)
    assert parent.aborted and be._closed and be._freed
    shr = [c for c in lib.calls if c[0] == "ncclCommShrink"][0]
    assert shr[1:3] == (0x1234, [1])


def test_backend_shrink_refuses_a_rank_order_other_than_the_rounds(monkeypatch):
    from hpcring.collectives import nccl as N
    lib = FakeLib(new_comm=0xD00D, rank=0, size=2)
    be, _ = _backend(lib, monkeypatch)
    with pytest.raises(CollectiveError, match="made this rank 0 of 2, the elastic round says 1 of 2"):
        N.NcclBackend.shrink(be, [0], types.SimpleNamespace(rank=1, size=2, hosts=None), timeout=5)
    assert 0xD00D in lib.aborted


def test_backend_shrink_that_hangs_frees_the_parent_once(monkeypatch):
    from hpcring.collectives import nccl as N
    gate = threading.Event()
    lib = FakeLib(block=gate)
    be, parent = _backend(lib, monkeypatch)
    be.keep_for_shrink = True
    be.abort("round lost")                          # revoked, kept
    with pytest.raises(CollectiveError, match="did not return within 0.3 s"):
        N.NcclBackend.shrink(be, [2], types.SimpleNamespace(rank=0, size=2, hosts=None), timeout=0.3)
    assert be._freed and lib.aborted == [0x1234]
    be.close()                                      # already freed: no second ncclCommAbort
    assert lib.aborted == [0x1234]


def test_a_round_whose_shrink_fails_frees_the_old_communicator_once(monkeypatch):
    from hpcring.collectives import nccl as N
    from hpcring.elastic import nccl_round as NR
    monkeypatch.setattr(R, "_lib", FakeLib())
    freed = []
    old = types.SimpleNamespace(_freed=False, close=lambda: freed.append("old"))

    def failing(cls, parent, exclude, topology, timeout=None):
        raise CollectiveError("ncclCommShrink failed (test)")
    monkeypatch.setattr(N.NcclBackend, "shrink", classmethod(failing))
    store = types.SimpleNamespace(add=lambda *a: 1, barrier=lambda *a, **k: None, check=lambda k: None)
    NR.keep(("a", "b", "c"), old)
    with pytest.raises(CollectiveError, match="test"):
        NR.build(types.SimpleNamespace(rank=0, size=2, hosts=None), store, b"s", ("a", "c"), "elastic/2", 5.0)
    assert freed == ["old"] and NR._previous is None


def test_backend_shrink_refuses_a_freed_parent(monkeypatch):
    from hpcring.collectives import nccl as N
    be, _ = _backend(FakeLib(), monkeypatch, revoke=False)
    be.abort("gone")
    with pytest.raises(CollectiveError, match="aborted \\(freed\\): nothing to shrink"):
        N.NcclBackend.shrink(be, [1], types.SimpleNamespace(rank=0, size=2, hosts=None), timeout=5)


# ---------------------------------------------------------------------------------------------
# elastic rounds: when to shrink, and every rank agreeing on it
# ---------------------------------------------------------------------------------------------
def _plan_reference(prev, members):
    if not prev or len(set(members) - set(prev)) or len(members) >= len(prev):
        return None
    order = [m for m in prev if m in members]
    return [i for i, m in enumerate(prev) if m not in members] if order == list(members) else None


@pytest.mark.parametrize("seed", range(200))
def test_plan_shrinks_exactly_for_survivors_in_their_old_order(seed):
    from hpcring.elastic.nccl_round import plan
    rng = random.Random(seed)
    prev = [f"w{i}" for i in rng.sample(range(40), rng.randrange(1, 9))]
    kind = rng.choice(["lose", "lose", "reorder", "newcomer", "same", "first"])
    members = [m for m in prev if rng.random() < 0.6]
    if kind == "reorder":
        rng.shuffle(members)
    elif kind == "newcomer":
        members.insert(rng.randrange(len(members) + 1), "new")
    elif kind == "same":
        members = list(prev)
    got = plan(None if kind == "first" else prev, members)
    assert got == _plan_reference(None if kind == "first" else prev, members)
    if got is not None:
        assert [m for i, m in enumerate(prev) if i not in got] == members


@pytest.mark.parametrize("seed", range(30))
def test_rounds_formed_after_losses_are_what_a_shrink_gives(seed):
    """membership.decide forms survivors in their old order: every loss-only round can shrink."""
    from hpcring.elastic.membership import ALIVE, DEAD, Worker, decide
    from hpcring.elastic.nccl_round import plan
    rng = random.Random(seed)
    n = rng.randrange(3, 10)
    members = [f"w{i}" for i in range(n)]
    workers = {m: Worker(m, i, f"h{i}") for i, m in enumerate(members)}
    lost = set(rng.sample(members, rng.randrange(1, n - 1)))
    for m in members:
        if m in lost:
            workers[m].status = DEAD
        else:
            workers[m].status, workers[m].waiting, workers[m].reason = ALIVE, True, "error"
    d = decide(workers, 4, members, start_np=n, min_np=1, max_np=n, resets=0, reset_limit=None,
               waited_s=0, timeout_s=60)
    assert d.action == "form"
    assert plan(members, d.members) == sorted(members.index(m) for m in lost)


def _store():
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    secret = b"s" * 32
    srv = StoreServer("127.0.0.1", 0, secret=secret)
    return srv, lambda: StoreClient("127.0.0.1", srv.port, secret, timeout=20)


@pytest.mark.parametrize("unable", [None, 0, 2])
def test_every_rank_of_a_round_takes_the_same_path(monkeypatch, unable):
    """Three survivors of four; one that cannot shrink (its communicator was freed) makes all
    three build a new one, else all three shrink."""
    from hpcring.collectives import nccl as N
    from hpcring.elastic import nccl_round as NR
    monkeypatch.setattr(R, "_lib", FakeLib())
    made: dict[int, str] = {}

    def fake_shrink(cls, parent, exclude, topology, timeout=None):
        made[topology.rank] = f"shrink{exclude}"
        return types.SimpleNamespace(keep_for_shrink=False, rank=topology.rank, size=topology.size)

    def fake_create(cls, topology, store, secret=None, timeout=None, *, prefix="nccl"):
        made[topology.rank] = f"new:{prefix}"
        return types.SimpleNamespace(keep_for_shrink=False, rank=topology.rank, size=topology.size)

    monkeypatch.setattr(N.NcclBackend, "shrink", classmethod(fake_shrink))
    monkeypatch.setattr(N.NcclBackend, "create", classmethod(fake_create))
    monkeypatch.setattr(NR, "Communicator", lambda be, timeout: be)
    prev_members = ("a", "b", "c", "d")
    members = ("a", "c", "d")
    srv, client = _store()
    errors = []
    # the held "previous" communicator is per process; each thread plays one process
    local = threading.local()
    monkeypatch.setattr(NR, "_take", lambda: local.prev)

    def rank(r):
        try:
            local.prev = (prev_members, types.SimpleNamespace(_freed=(r == unable), close=lambda: None))
            topo = types.SimpleNamespace(rank=r, size=3, hosts=None)
            be, how = NR.build(topo, client(), b"s" * 32, members, "elastic/5", 10.0)
            assert be.keep_for_shrink
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with srv:
        ts = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
    assert not errors, errors
    want = "shrink[1]" if unable is None else "new:nccl/elastic/5"
    assert made == {0: want, 1: want, 2: want}


def test_elastic_join_refuses_mpi_before_joining(monkeypatch):
    from hpcring.elastic import session as S
    from hpcring.errors import UsageError
    monkeypatch.setenv("HPCRING_BACKEND", "mpi")
    monkeypatch.setattr(S, "current", lambda: pytest.fail("joined a round"))
    with pytest.raises(UsageError, match="HPCRING_BACKEND=mpi cannot do that") as e:
        S.join()
    assert "ULFM" in e.value.hint


def test_leaving_a_round_holds_its_nccl_backend_open_for_the_next_shrink(monkeypatch):
    from hpcring.collectives.api import Communicator
    from hpcring.elastic import nccl_round as NR
    from hpcring.elastic import session as S
    closed = []

    class Be:
        name, rank, size = "fake", 0, 2

        def __init__(self, tag):
            self.tag = tag

        def close(self):
            closed.append(self.tag)

    monkeypatch.setattr(S, "current", lambda: types.SimpleNamespace(on_abort=lambda *a: None))
    ring, gpu = Communicator(Be("ring"), timeout=5), Communicator(Be("nccl"), timeout=5)
    old = Be("older")
    NR.keep(("x",), old)
    sess = types.SimpleNamespace(_comms={"ring": ring, "nccl": gpu}, store=types.SimpleNamespace(close=lambda: None),
                                 elastic_round=types.SimpleNamespace(members=("a", "b")))
    S.leave_round(sess)
    assert closed == ["ring", "older"]            # the ring closes; an older held one is freed
    assert NR._previous == (("a", "b"), gpu.backend)
    NR.release()
    assert closed == ["ring", "older", "nccl"] and NR._previous is None


@pytest.mark.gpu
def test_gpu_a_shrunk_communicator_runs_collectives():
    """On a real GPU (one is lent at most, and NCCL wants a GPU per rank): a one-rank
    communicator, revoked as a failed elastic round leaves it, shrunk excluding nobody, runs an
    allreduce through RawComm."""
    from hpcring.collectives import nccl_lib as NL
    if not NL.gpu_available():
        pytest.skip("no NVIDIA GPU/cupy")
    import cupy
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    from hpcring.collectives import nccl as N
    from hpcring.collectives.api import Communicator
    lib = R.load()
    if not R.has_shrink(lib):
        pytest.skip(f"NCCL {R.version(lib)} has no ncclCommShrink")
    topo = types.SimpleNamespace(rank=0, size=1, local_rank=0, host="here", hosts=("here",))
    with StoreServer("127.0.0.1", 0, secret=b"g" * 32) as srv:
        be = N.NcclBackend.create(topo, StoreClient("127.0.0.1", srv.port, b"g" * 32), timeout=60.0)
        be.keep_for_shrink = True
        be.abort("round lost (test)")
        assert not be._freed
        new = N.NcclBackend.shrink(be, [], topo, timeout=60.0)
        comm = Communicator(new, timeout=60.0)
        x = cupy.arange(1000, dtype=cupy.float32)
        out = comm.allreduce(x)
        cupy.cuda.get_current_stream().synchronize()
        assert bool((cupy.asarray(out) == x).all())
        comm.close()
