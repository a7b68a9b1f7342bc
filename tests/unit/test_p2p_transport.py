"""Point-to-point pieces: the ring's mailbox (in one process: ranks in threads over loopback TCP
and a real store), NCCL groups through the fake NCCL, and the torch process group holding NCCL
messages for one group."""
from __future__ import annotations

import socket
import time
import types

import numpy as np
import pytest

import helpers.fake_cuda as F  # noqa: E402
from helpers.ring import SECRET, topology  # noqa: E402

from hpcring.bootstrap.store_client import StoreClient  # noqa: E402
from hpcring.bootstrap.store_server import StoreServer  # noqa: E402
from hpcring.collectives import nccl as N  # noqa: E402
from hpcring.collectives.api import Communicator  # noqa: E402
from hpcring.errors import CollectiveError, UsageError  # noqa: E402


@pytest.fixture(params=["apart", "one host"])
def hosts(request):
    """Where the ranks are: each on its own host (TCP), or all on one (a Unix socket per pair,
    tests/unit/test_p2p_unix.py); rank 0 is on node0 either way."""
    return None if request.param == "apart" else ("node0",) * 4


def test_messages_of_one_pair_and_tag_arrive_in_order_and_tags_match_out_of_order(ranks, hosts):
    a, b = ranks(2, hosts=hosts[:2] if hosts else None)
    sends = [a.isend(np.full(3, i, np.int64), 1, tag=i % 2) for i in range(6)]
    got = {0: [], 1: []}
    for tag in (1, 0, 1, 0, 1, 0):                      # tag 1 first: it still gets 1, 3, 5 in order
        y = np.empty(3, np.int64)
        assert b.recv(y, 0, tag=tag) == 0
        got[tag].append(int(y[0]))
    for h in sends:
        h.wait(5)
    assert got == {0: [0, 2, 4], 1: [1, 3, 5]}


def test_receive_from_any_rank_names_the_source_and_messages_posted_before_the_receive_wait(ranks, hosts):
    comms = ranks(3, hosts=hosts[:3] if hosts else None)
    comms[2].send(np.array([2.0]), 0, tag=4)             # arrives before any receive is posted
    time.sleep(0.2)
    comms[1].send(np.array([1.0]), 0, tag=4)
    seen = {}
    for _ in range(2):
        y = np.empty(1)
        src = comms[0].recv(y, None, tag=4)
        seen[src] = float(y[0])
    assert seen == {1: 1.0, 2: 2.0}


def test_both_ranks_send_big_messages_to_each_other_before_receiving(ranks, hosts):
    a, b = ranks(2, hosts=hosts[:2] if hosts else None)
    big = 8 << 20                                        # far beyond the socket buffers
    xa, xb = np.full(big, 1, np.uint8), np.full(big, 2, np.uint8)
    ha, hb = a.isend(xa, 1), b.isend(xb, 0)
    ya, yb = np.empty(big, np.uint8), np.empty(big, np.uint8)
    ra, rb = a.irecv(ya, 1), b.irecv(yb, 0)
    for h in (ha, hb, ra, rb):
        h.wait(20)
    assert (ya == 2).all() and (yb == 1).all()


def test_a_size_mismatch_fails_the_receive_naming_both_sizes(ranks):
    a, b = ranks(2)
    a.send(np.zeros(8, np.float32), 1, tag=3)
    with pytest.raises(CollectiveError) as e:
        b.recv(np.empty(4, np.float32), 0, tag=3)
    msg = str(e.value)
    assert "rank 1 (node1) waited for recv from rank 0 (node0), tag 3, 16 B" in msg, msg
    assert "sent 32 B (32 bytes) but this receive takes 16 bytes" in msg, msg


def test_a_missing_sender_fails_at_the_deadline_and_the_peer_stays_failed(ranks):
    a, b = ranks(2, timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as e:
        b.recv(np.empty(1 << 20, np.uint8), 0, tag=7)
    assert 0.9 < time.monotonic() - t0 < 5
    msg = str(e.value)
    assert msg.startswith("rank 1 (node1) waited for recv from rank 0 (node0), tag 7, 1 MiB: rank 0 (node0) never "
                          "connected within the 1 s deadline"), msg
    a.send(np.zeros(1, np.uint8), 1, tag=7)              # too late: the pair is failed, not resynchronised
    with pytest.raises(CollectiveError, match="failed earlier|timed out"):
        b.recv(np.empty(1, np.uint8), 0, tag=7, timeout=5)


def test_a_peer_that_closes_fails_the_pending_receive_at_once(ranks, hosts):
    a, b = ranks(2, timeout=30.0, hosts=hosts[:2] if hosts else None)
    a.send(np.zeros(1), 1)                               # the connection a -> b exists
    b.recv(np.empty(1), 0)
    h = b.irecv(np.empty(1), 0, tag=1)
    t0 = time.monotonic()
    a.close()
    with pytest.raises(CollectiveError, match=r"rank 0 \(node0\) closed its connection"):
        h.wait(10)
    assert time.monotonic() - t0 < 5                     # not the 30 s deadline


def test_an_unauthenticated_connection_is_refused_and_the_real_peer_still_gets_through(ranks):
    a, b = ranks(2)
    b.irecv(np.empty(1), 0, tag=9)                       # opens b's listener
    addr = StoreClient("127.0.0.1", ranks.port, SECRET, 5).check("hpcring/ring/1/p2p/addr/1")
    assert addr is not None
    host, _, port = addr.decode().rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.recv(36)                                       # the greeting
        s.sendall(b"\0" * 72)                            # a wrong proof
        s.settimeout(5)
        assert s.recv(100) == b""                        # cut without an answer
    h = b.irecv(y := np.empty(1), 0, tag=10)
    a.send(np.array([5.0]), 1, tag=10)
    assert h.wait(5) == 0 and y[0] == 5.0


@pytest.mark.parametrize("call, match", [
    (lambda c: c.isend(np.zeros(1), 0), "cannot send to or receive from itself"),
    (lambda c: c.isend(np.zeros(1), 2), "outside ranks 0-1"),
    (lambda c: c.isend(np.zeros(1), 1, tag=-1), "tag must be"),
    (lambda c: c.isend(np.zeros(1), 1, tag=2**31), "tag must be"),
    (lambda c: c.isend(np.zeros(1), True), "must be an integer"),
    (lambda c: c.irecv(np.zeros(4)[::2], 1), "contiguous"),
    (lambda c: c.batch_isend_irecv([("put", np.zeros(1), 1)]), "'send' or 'recv'"),
])
def test_bad_arguments_are_refused_before_anything_moves(ranks, call, match):
    a, _ = ranks(2)
    with pytest.raises(UsageError, match=match):
        call(a)
    assert a.p2p_log.records() == []


# ---------------------------------------------------------------------------------------------
# NCCL: one group per batch (fake NCCL, mirror ranks)
# ---------------------------------------------------------------------------------------------
fake = F.fake_cuda      # the fixture: fake cupy and torch in sys.modules


def test_nccl_batch_is_one_group_in_any_order_and_completes_on_the_stream(fake):
    nc = F.FakeNcclComm(fake.cp, 2, 0, 1)
    be = N.NcclBackend(nc, 0, 2, 1, hosts=("gpu0", "gpu1"), cupy=fake.cp, nccl=F.make_nccl_module([nc]),
                       version=22000)
    comm = Communicator(be, timeout=5.0)
    x = fake.cp.device_array(np.arange(6, dtype=np.float32), device=1)
    y = fake.cp.device_array(np.zeros(6, dtype=np.float32), device=1)
    hs = comm.batch_isend_irecv([("recv", y, 1), ("send", x, 1, 3)])
    assert nc.groups == [[("recv", 24, 1), ("send", 24, 1)]]         # one group, as given
    for h in hs:
        h.wait(5)
    assert np.array_equal(y._a, np.arange(6, dtype=np.float32))       # the mirror peer sent x
    assert [r.state for r in comm.p2p_log.records()] == ["done", "done"]
    with pytest.raises(UsageError, match="cannot receive from any rank"):
        comm.irecv(y, None)
    comm.close()


def test_torch_pg_holds_nccl_messages_and_starts_them_as_one_group():
    """The process group's holding logic, on a stand-in stream-ordered communicator."""
    torch = pytest.importorskip("torch")
    from hpcring.distributed import work
    from hpcring.distributed.process_group import ProcessGroupHpcring

    class Comm:
        stream_ordered, device, backend_name = True, "cpu", "nccl"
        calls: list = []

        def batch_isend_irecv(self, ops):
            self.calls.append([(k, p, t) for k, _, p, t in ops])
            hs = []
            for k, buf, p, t in ops:
                if k == "recv":
                    buf.fill_(p + 1) if hasattr(buf, "fill_") else None
                h = work.Future()
                hs.append(_Done(p))
            return hs

        def allreduce_async(self, x, op, out=None, timeout=None):
            self.calls.append("allreduce")
            return _Done(x)

    class _Done:
        cuda_event = None

        def __init__(self, v):
            self.v = v

        def add_done_callback(self, fn):
            fn(self)

        def wait(self, timeout=None):
            return self.v

        def result(self):
            return self.v

        def done(self):
            return True

        def exception(self):
            return None

    comm = Comm()
    session = types.SimpleNamespace(communicator=lambda *a, **k: comm)
    pg = ProcessGroupHpcring(session, 0, 3)
    a, b = torch.zeros(4), torch.zeros(4)
    w1 = pg.recv([a], 1, 5)
    w2 = pg.send([torch.ones(4)], 2, 6)
    w3 = pg.recv([b], 2, 7)
    assert comm.calls == []                              # held
    w2.wait()                                            # the first wait starts all three, as one group
    assert comm.calls == [[("recv", 1, 5), ("send", 2, 6), ("recv", 2, 7)]]
    w1.wait()
    w3.wait()
    assert w1._source_rank() == 1
    pg.send([torch.ones(2)], 1, 0)
    pg.allreduce([torch.ones(2)])                        # another op starts the held one first
    assert comm.calls[1:] == [[("send", 1, 0)], "allreduce"]


# ---------------------------------------------------------------------------------------------
# on a real GPU (scripts/gpu-check.sh tests): a group of one rank; send/recv need 2 GPUs
# ---------------------------------------------------------------------------------------------
def _gpus() -> int:
    from hpcring.collectives import nccl_lib
    return nccl_lib.gpu_count() if nccl_lib.gpu_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="no NVIDIA GPU/cupy")
def test_nccl_group_of_one_rank_on_gpu():
    import cupy

    from hpcring.collectives.groups import create_communicator, next_key
    topo = topology(0, 1)
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        store = StoreClient("127.0.0.1", srv.port, SECRET)
        comm = create_communicator(topo, store, SECRET, (0,), next_key((0,)), backend="nccl", timeout=30.0)
        x = cupy.arange(10, dtype=cupy.float32)
        assert cupy.allclose(cupy.asarray(comm.allreduce(x)), x)
        assert comm.group and comm.members == (0,)
        with pytest.raises(UsageError, match="outside ranks 0-0|itself"):
            comm.isend(x, 0)
        comm.close()


def _nccl_pair(rank, port, q):
    try:
        import cupy
        store = StoreClient("127.0.0.1", port, SECRET)
        comm = Communicator.create(topology(rank, 2), store, SECRET, backend="nccl", timeout=60.0)
        with cupy.cuda.Device(comm.backend.device_id):
            x = cupy.full(1 << 20, rank + 1, dtype=cupy.float32)
            y = cupy.zeros(1 << 20, dtype=cupy.float32)
            hs = comm.batch_isend_irecv([("recv", y, 1 - rank), ("send", x, 1 - rank)])   # receive first
            comm.synchronize(60)
            q.put((rank, float(y[0]), float(y[-1]), [h.done() for h in hs]))
        comm.close()
    except BaseException as e:  # noqa: BLE001
        q.put((rank, repr(e), None, None))


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="NCCL send/recv need 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_send_recv_between_two_gpus():
    import multiprocessing as mp

    from helpers.ring import collect
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        procs = [ctx.Process(target=_nccl_pair, args=(r, srv.port, q)) for r in range(2)]
        for p in procs:
            p.start()
        out = collect(q, procs, 2, 120)
    assert out == {0: (2.0, 2.0, [True, True]), 1: (1.0, 1.0, [True, True])}, out
