"""Sub-communicators (hpcring.collectives.groups): any subset of ranks, on the ring over loopback
with the real store; 4 spawned ranks on 2 "hosts" (so groups within a host use shared memory
among their members, groups across hosts TCP)."""
from __future__ import annotations

import os
import traceback

import numpy as np
import pytest

from hpcring.collectives.groups import check_members, subtopology
from hpcring.ranks import globalize
from hpcring.errors import UsageError
from helpers.ring import SECRET, collect, topology


HOSTS4 = ("node0", "node0", "node1", "node1")


def _child(rank, size, port, hosts, target, args, q):
    try:
        from hpcring.bootstrap.store_client import StoreClient
        from hpcring.session import Session
        store = StoreClient("127.0.0.1", port, SECRET, 60.0)
        s = Session(topology(rank, size, hosts), store, SECRET)
        q.put((rank, "ok", target(s, *args)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "crash", traceback.format_exc()))


def spawn_sessions(size, target, *args, hosts=None, wait=240.0):
    """target(session, *args) in ``size`` spawned ranks (a Session over the real store, ring over
    loopback); returns {rank: (status, value)}."""
    import multiprocessing as mp
    from hpcring.bootstrap.store_server import StoreServer
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with StoreServer("127.0.0.1", 0, secret=SECRET) as server:
        procs = [ctx.Process(target=_child, args=(r, size, server.port, hosts, target, args, q)) for r in range(size)]
        for p in procs:
            p.start()
        return collect(q, procs, size, wait)


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _exercise(comm, members, me):
    """Every collective in the group; returns what differs from the exact result (empty: all good)."""
    bad = []
    k = len(members)
    x = (me + 1) * np.arange(1, 1001, dtype=np.int64)
    want = sum(m + 1 for m in members) * np.arange(1, 1001, dtype=np.int64)
    if not np.array_equal(comm.allreduce(x), want):
        bad.append("allreduce")
    f = np.full(300_000, me + 0.5, np.float32)          # big enough for the ring / shared-memory paths
    if not np.array_equal(comm.allreduce(f, op="max"), np.full(300_000, max(members) + 0.5, np.float32)):
        bad.append("allreduce max")
    g = comm.allgather(np.array([me, 7 * me], np.int32))
    if g.tolist() != [[m, 7 * m] for m in members]:
        bad.append(f"allgather {g.tolist()}")
    b = np.full(5, me, np.float64)
    comm.broadcast(b, root=k - 1)
    if b.tolist() != [float(members[-1])] * 5:
        bad.append(f"broadcast {b.tolist()}")
    rs = comm.reduce_scatter(np.arange(4 * k, dtype=np.float32) * (me + 1))
    full = np.arange(4 * k, dtype=np.float32) * sum(m + 1 for m in members)
    r = members.index(me)
    if not np.array_equal(rs, full[4 * r:4 * r + 4]):
        bad.append(f"reduce_scatter {rs.tolist()}")
    comm.barrier()
    return bad


def target_groups(s):
    """torch's order: every rank creates every group (non-members get None), in the same order."""
    world = s.communicator("ring", timeout=60.0)
    me, n = world.rank, world.size
    out = {"bad": []}
    try:
        world.allreduce(np.ones(1))                      # the world's mesh first
        specs = [("row", [0, 1]), ("row", [2, 3]), ("col", [0, 2]), ("col", [1, 3]),
                 *[("one", [r]) for r in range(n)], ("all", list(range(n))), ("row again", [0, 1])]
        mine = []
        for name, members in specs:
            before = _sockets()
            g = s.group(members)
            if me not in members:
                if g is not None:
                    out["bad"].append(f"non-member got {g}")
                continue
            comm = g.communicator("ring", timeout=60.0)
            bad = _exercise(comm, members, me)
            out["bad"] += [f"{name} {members}: {b}" for b in bad]
            hosts = s.topology.hosts
            unix = any(hosts[m] == hosts[me] for m in members if m != me)   # p2p's Unix listener too
            out.setdefault("new_sockets", []).append((name, len(members), _sockets() - before, unix))
            mine.append((name, comm))
        # interleave: a world collective between group ones; every communicator counts its own
        world.allreduce(np.ones(3))
        for name, comm in mine:
            comm.allreduce(np.ones(2))
        out["seqs"] = [(name, comm.recorder.seq, comm.group, comm.recorder.records(1)[0].to_dict().get("members"))
                       for name, comm in mine]
        out["world_seq"] = world.recorder.seq
        out["shm"] = [(name, comm.backend._comm.shm is not None) for name, comm in mine]
    except Exception:  # noqa: BLE001
        out["bad"].append(traceback.format_exc())
    return out


def test_groups_rows_columns_one_all_and_twice_on_4_ranks():
    res = spawn_sessions(4, target_groups, hosts=HOSTS4)
    assert sorted(res) == [0, 1, 2, 3], res
    for r, (status, out) in res.items():
        assert status == "ok", (r, out)
        assert out["bad"] == [], (r, out["bad"])
        # row, col, one, all (row again: ranks 0, 1): each with 6 collectives + 1 afterwards
        names = [s[0] for s in out["seqs"]]
        assert names == ["row", "col", "one", "all"] + (["row again"] if r < 2 else []), names
        assert [s[1] for s in out["seqs"]] == [7] * len(names)
        assert out["world_seq"] == 2
        assert len({s[2] for s in out["seqs"]}) == len(names)      # distinct group names
        assert out["seqs"][0][3] == ([0, 1] if r < 2 else [2, 3])     # records carry global members
        # connections: (members - 1) per group on this rank (groups of <= 4: every peer is one
        # its algorithms use), nothing more (one stream per peer), the ring's listener (kept
        # for alltoall's connections on demand) and the point-to-point listener (no connection
        # until a message goes to a peer; a second one, a Unix socket, where a member shares
        # this rank's host)
        for name, k, new, unix in out["new_sockets"]:
            assert new == k - 1 + 2 * (k > 1) + unix, (r, name, k, new, unix)
        shm = dict(out["shm"])
        assert shm["row"] and shm.get("row again", True) and shm["all"]      # members sharing a host
        assert not shm["col"] and not shm["one"]                   # members on different hosts / alone


def target_group_hang(s, victim):
    """Group {1, 2} of 4 ranks; the victim (a member) never calls the group's allreduce."""
    import time
    g = s.group([1, 2])
    if g is None:
        return "not in it"
    comm = g.communicator("ring", timeout=2.0)
    comm.allreduce(np.ones(4))         # joins the mesh
    if s.topology.rank == victim:
        time.sleep(5.0)                # alive (no EOF) but elsewhere
        return "skipped"
    try:
        comm.allreduce(np.ones(4))     # the victim's peer waits here
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "completed"


def test_a_group_collective_missing_a_rank_names_its_global_rank_and_host():
    res = spawn_sessions(4, target_group_hang, 2, wait=120.0)
    status, msg = res[1]
    assert status == "ok", res
    # the group's rank 1 is global rank 2 on node2 (not "rank 1 (node2)")
    assert "rank 2 (node2)" in msg and "rank 1 (" not in msg.split("\n")[0], msg
    assert msg.startswith("CollectiveError: allreduce#") or msg.startswith("CollectiveError: setup#"), msg


def test_members_and_subtopology_and_globalize():
    assert check_members([3, 1, 1], 4) == (1, 3)
    for bad in ([], [4], [-1], ["x"]):
        with pytest.raises(UsageError):
            check_members(bad, 4)
    t = subtopology(topology(2, 4, HOSTS4), (0, 2, 3))
    assert (t.rank, t.size, t.hosts, t.num_nodes, t.node_rank) == (1, 3, ("node0", "node1", "node1"), 2, 1)
    m = (4, 9, 12)
    assert globalize("allreduce#3 recv from rank 1 (n9) timed out, 0/8 bytes done", m) == \
        "allreduce#3 recv from rank 9 (n9) timed out, 0/8 bytes done"
    assert globalize("allreduce#1 never joined by ranks 1, 2 (a, b): x (rank 0 waited)", m) == \
        "allreduce#1 never joined by ranks 9, 12 (a, b): x (rank 0 waited)"
    assert globalize("mismatched collective: rank 2 (h) called x but this rank (0) called y", m) == \
        "mismatched collective: rank 12 (h) called x but this rank (4) called y"
    assert globalize("rank(s) 1 (h) within", m) == "rank(s) 9 (h) within"
    assert globalize("MPI setup: ranks 0-1 (a, b) never reached it", m) == "MPI setup: ranks 4,9 (a, b) never reached it"
    assert globalize("anything", None) == "anything"


def test_report_diagnoses_a_group_collective_among_its_members():
    from hpcring.diagnostics.report import diagnose
    grp = {"group": "group 1 of ranks 1-2", "members": [1, 2]}

    def rec(seq, state, **kw):
        return {"seq": seq, "op": "allreduce", "dtype": "float32", "count": 4, "root": None, "backend": "ring",
                "timeout": 2.0, "site": "x.py:1 in f", "state": state, **kw}
    # world records up to #5 everywhere; group {1, 2}: rank 1 in #2, rank 2 only did #1
    world = [rec(s, "done") for s in range(1, 6)]
    snaps = {0: {"records": world, "last_done": 5, "where": "in sleep at a.py:1"},
             1: {"records": world + [rec(1, "done", **grp), rec(2, "failed", **grp)], "last_done": 5,
                 "last_done_groups": {grp["group"]: 1}, "error": "allreduce#2 recv from rank 2 (h2) timed out, 0/16 bytes done"},
             2: {"records": world + [rec(1, "done", **grp)], "last_done": 5,
                 "last_done_groups": {grp["group"]: 1}, "where": "in load at b.py:9"},
             3: {"records": world, "last_done": 5}}
    trig = {"rank": 1, "host": "h1", "error": "x", "op": rec(2, "started", **grp)}
    rep = diagnose(4, ["h0", "h1", "h2", "h3"], snaps, {}, trig)
    assert rep.headline == "allreduce#2 (group 1 of ranks 1-2): rank 2 (h2) never joined", rep.headline
    assert rep.categories["missing"] == [2] and rep.categories["joined"] == [1]
    assert "last completed #1" in rep.details[2] and "in load at b.py:9" in rep.details[2]
    assert "in group 1 of ranks 1-2" in rep.text()


def test_nccl_group_gets_its_own_unique_id_through_the_store(monkeypatch):
    """Code path only (fake CuPy/NCCL, no GPU): the members of a group meet under the group's
    keys, its rank 0 makes the unique id, each member inits NCCL with the group's rank and size
    on its own GPU (the process's local rank), and a second group over the same ranks gets a new id."""
    import threading
    import types
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    from hpcring.collectives import nccl as N
    from hpcring.collectives.groups import create_communicator, next_key
    from helpers.fake_cuda import make_cupy
    inits = []
    ids = iter(bytes([i]) * 128 for i in range(1, 100))

    class Comm:
        def __init__(self, size, uid, rank):
            inits.append((size, bytes(uid), rank))
    nccl = types.SimpleNamespace(NcclCommunicator=Comm, get_unique_id=lambda: next(ids), get_version=lambda: 22000)
    cp = make_cupy(4)
    cp.cuda.runtime.deviceGetPCIBusId = lambda d: f"0000:{d:02x}:00.0"
    monkeypatch.setattr(N, "_import_cupy", lambda: (cp, nccl))
    monkeypatch.setattr(N, "gpu_count", lambda: 4)
    hosts = ("a",) * 4
    errs = []
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        def member(rank, key):
            try:
                topo = topology(rank, 4, hosts).with_(local_rank=rank)
                c = create_communicator(topo, StoreClient("127.0.0.1", srv.port, SECRET), SECRET, (1, 3), key,
                                        backend="nccl", timeout=10.0)
                assert (c.rank, c.size, c.members, c.backend.device_id) == ((1, 3).index(rank), 2, (1, 3), rank)
            except Exception as e:  # noqa: BLE001
                errs.append(e)
        for _ in range(2):
            key = next_key((1, 3))
            ts = [threading.Thread(target=member, args=(r, key)) for r in (1, 3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
    assert not errs, errs
    assert len(inits) == 4 and {(s, r) for s, _, r in inits} == {(2, 0), (2, 1)}
    first, second = {u for _, u, _ in inits[:2]}, {u for _, u, _ in inits[2:]}
    assert len(first) == 1 and len(second) == 1 and first != second     # one id per group
