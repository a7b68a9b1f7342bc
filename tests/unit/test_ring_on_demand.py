"""Ring connections on demand: a rank connects only to the peers its algorithms use,
alltoall opens the rest in windows within HPCRING_RING_MAX_CONNECTIONS and closes them, every
collective stays exact, and a peer that stalls is still named.

Ranks are threads of this process over real loopback TCP, meeting through the real store
(RingBackend.create via Communicator.create); the frozen-peer case spawns processes.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import numpy as np
import pytest

import helpers.ring as H  # noqa: E402

from hpcring.bootstrap.store_client import StoreClient  # noqa: E402
from hpcring.bootstrap.store_server import StoreServer  # noqa: E402
from hpcring.collectives import Communicator  # noqa: E402
from hpcring.collectives.ring import HostLayout, node_layout, static_bound, static_peers  # noqa: E402
from hpcring.errors import CollectiveError  # noqa: E402


class Ranks:
    """n ring communicators (threads of this process) over loopback TCP and a real store."""

    def __init__(self, n: int, hosts=None, timeout: float = 30.0) -> None:
        self.server = StoreServer("127.0.0.1", 0, secret=H.SECRET)
        self.server.__enter__()
        self.n = n
        self.comms = [Communicator.create(H.topology(r, n, hosts),
                                          StoreClient("127.0.0.1", self.server.port, H.SECRET, 10),
                                          H.SECRET, timeout=timeout) for r in range(n)]

    def run(self, fn, ranks=None):
        """fn(comm) on every rank at once; (results, errors)."""
        ranks = range(self.n) if ranks is None else ranks
        res, errs = [None] * self.n, [None] * self.n

        def work(r):
            try:
                res[r] = fn(self.comms[r])
            except BaseException as e:  # noqa: BLE001
                errs[r] = e
        ts = [threading.Thread(target=work, args=(r,)) for r in ranks]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "a rank hung"
        return res, errs

    def run_ok(self, fn):
        res, errs = self.run(fn)
        for e in errs:
            if e is not None:
                raise e
        return res

    def close(self) -> None:
        for c in self.comms:
            c.close()
        self.server.__exit__(None, None, None)


@pytest.fixture
def ranks(monkeypatch):
    made = []

    def make(n, hosts=None, budget=None, **env):
        if budget is not None:
            monkeypatch.setenv("HPCRING_RING_MAX_CONNECTIONS", str(budget))
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        made.append(Ranks(n, hosts))
        return made[-1]
    yield make
    for g in made:
        g.close()


def peers_of(c) -> set[int]:
    return set(c.backend.connections()["peers"])


# ---- the peer sets --------------------------------------------------------------------------
@pytest.mark.parametrize("n", list(range(1, 34)) + [100, 257])
def test_static_peer_sets_are_symmetric_and_logarithmic(n):
    layouts = [None, tuple(f"h{r // 4}" for r in range(n)), tuple(f"h{r % 3}" for r in range(n))]
    for hosts in layouts:
        for shm in (False, True):
            sets = [static_peers(r, n, hosts or H.hosts_for(n), shm, 3) for r in range(n)]
            bound = static_bound(n, HostLayout(hosts or H.hosts_for(n)), shm, 3)
            assert max(sum(x.values()) for x in sets) <= bound <= max(sum(x.values()) for x in sets) + 12
            for r in range(n):
                assert r not in sets[r]
                for q, k in sets[r].items():
                    assert sets[q].get(r) == k, (n, r, q, hosts, shm)       # both sides agree
                    assert k == 3 or k == 1
                if not shm and n > 1:
                    assert len(sets[r]) <= 3 * max(1, (n - 1).bit_length()), sets[r]


def test_4096_ranks_stay_within_the_default_budget():
    n, hosts = 4096, tuple(f"node{r // 8}" for r in range(4096))
    lay = HostLayout(hosts)
    most = max(sum(static_peers(r, n, hosts, True, 1, lay).values()) for r in range(0, n, 7))
    assert most <= static_bound(n, lay, True) <= 48 - 2, most    # room for alltoall's window
    for r in (0, 9, 4095):           # the layout helper says what node_layout says
        local, column = node_layout(hosts, r)
        pos = column.index(r)
        assert set(lay.column_neighbours(r)) == {column[pos - 1], column[(pos + 1) % len(column)]}
        assert lay.local(r) == local


# ---- which connections the collectives open ------------------------------------------------
@pytest.mark.parametrize("n", [8, 12, 16])
def test_collectives_connect_only_their_peers(ranks, n):
    g = ranks(n)
    expect = [set(static_peers(r, n, H.hosts_for(n), False)) for r in range(n)]

    def ops(c):
        seen = []
        x = np.arange(4 * n, dtype=np.float32) + c.rank
        c.allreduce(x[:3])                                        # recursive doubling
        seen.append(peers_of(c))
        c.allreduce(np.ones(1 << 17, np.float32))                 # ring (512 KiB)
        c.broadcast(x, root=n - 1)                                # tree
        c.broadcast(np.ones(1 << 17, np.float32), root=1)         # chain
        c.allgather(x)
        c.reduce_scatter(x)
        c.barrier()
        seen.append(peers_of(c))
        return seen
    for r, seen in enumerate(g.run_ok(ops)):
        assert seen[0] == seen[1] == expect[r], (r, seen, expect[r])
        assert len(seen[1]) < n - 1 or n <= 8, seen
    if n == 16:
        assert {len(e) for e in expect} == {7}      # +-1, +-2, +-4, 8: not 15


# ---- correctness in on-demand mode ----------------------------------------------------------
LAYOUTS = {"tcp": lambda n: None,
           "twolevel": lambda n: tuple(f"h{r % 3}" for r in range(n)),     # 3 hosts, shared memory
           "mixed": lambda n: tuple("a" if r < n // 2 + 1 else "b" for r in range(n))}


@pytest.mark.parametrize("n,layout,budget", [(6, "tcp", 48), (12, "tcp", 6), (12, "twolevel", 48),
                                             (9, "twolevel", 14), (7, "mixed", 4), (5, "tcp", 2)])
def test_every_collective_matches_numpy(ranks, n, layout, budget):
    g = ranks(n, LAYOUTS[layout](n), budget, HPCRING_TWOLEVEL_MIN=0, HPCRING_RING_SHM_PIECE=4096)

    def ops(c):
        out = []
        for dtype in ("float32", "int64", "uint8", "float64"):
            for count in (0, 1, 7, 3 * n, 70001):
                rng = np.random.default_rng(count * 31 + c.rank)
                x = rng.integers(0, 50, count).astype(dtype)
                out.append(c.allreduce(x, op="max"))
                out.append(c.allreduce(x.astype(np.int64)))
                out.append(c.allgather(x))
                out.append(c.reduce_scatter(x.astype(np.int64), op="sum") if count % n == 0 else None)
                b = x.copy()
                c.broadcast(b, root=count % n)
                out.append(b)
                a = x[: count - count % n]
                out.append(c.alltoall(a))
                inplace = a.copy()
                c.alltoall(inplace, out=inplace)
                out.append(inplace)
        c.barrier()
        return out
    res = g.run_ok(ops)
    i = 0
    for dtype in ("float32", "int64", "uint8", "float64"):
        for count in (0, 1, 7, 3 * n, 70001):
            xs = [np.random.default_rng(count * 31 + r).integers(0, 50, count).astype(dtype) for r in range(n)]
            blk = count // n
            for r in range(n):
                o = res[r][i:i + 7]
                np.testing.assert_array_equal(o[0], np.max(xs, 0))
                np.testing.assert_array_equal(o[1], np.sum([x.astype(np.int64) for x in xs], 0))
                np.testing.assert_array_equal(o[2].ravel(), np.concatenate(xs))
                if count % n == 0:
                    np.testing.assert_array_equal(o[3], np.sum([x.astype(np.int64) for x in xs], 0)[r * blk:(r + 1) * blk])
                np.testing.assert_array_equal(o[4], xs[count % n])
                want = np.concatenate([xs[q][r * blk:(r + 1) * blk] for q in range(n)])
                np.testing.assert_array_equal(o[5], want)
                np.testing.assert_array_equal(o[6], want)
            i += 7


# ---- the connection budget ------------------------------------------------------------------
def test_alltoall_within_a_tiny_budget_closes_its_extra_connections(ranks):
    n, budget = 12, 6
    g = ranks(n, budget=budget)

    def ops(c):
        static = dict(static_peers(c.rank, n, H.hosts_for(n), False))
        x = np.arange(2 * n, dtype=np.int32) + 1000 * c.rank
        counts = []
        for _ in range(3):
            y = c.alltoall(x)
            assert y.tolist() == [1000 * q + 2 * c.rank + j for q in range(n) for j in (0, 1)]
            info = c.backend.connections()
            counts.append((info["descriptors"], set(info["peers"]) - set(static)))
        c.allreduce(np.ones(3))                       # still fine afterwards
        return len(static), counts
    most = 0
    for r, (nstatic, counts) in enumerate(g.run_ok(ops)):
        most = max(most, nstatic)
        for desc, extra in counts:
            assert desc == nstatic + len(extra), (r, desc, extra)
            assert len(extra) <= 2, (r, extra)        # one window's peers, the others closed
    assert most + 2 <= n - 1                           # the budget, not the mesh, bounded them


def test_alltoall_keeps_its_connections_when_the_budget_allows(ranks):
    n = 9
    g = ranks(n, budget=48)

    def ops(c):
        x = np.arange(n, dtype=np.float64) * (c.rank + 1)
        c.alltoall(x)
        first = c.backend.connections()
        c.alltoall(x)
        return first, c.backend.connections()
    for first, second in g.run_ok(ops):
        assert first["peers"] == second["peers"] and len(first["peers"]) == n - 1
        assert first["descriptors"] == second["descriptors"] == n - 1


def test_the_default_budget_keeps_every_peer_of_a_small_job(ranks):
    """Unset, the budget has no limit up to FULL_MESH_MAX_RANKS: a small job's alltoall opens
    its extra peers once and keeps them (a budget of 48 would reconnect them on every call at
    40-256 ranks)."""
    n = 10
    g = ranks(n)

    def ops(c):
        x = np.arange(n, dtype=np.int64) * (c.rank + 1)
        y = c.alltoall(x)
        np.testing.assert_array_equal(y, np.full(n, c.rank) * (np.arange(n) + 1))
        return c.backend.connections()
    for got in g.run_ok(ops):
        assert got["budget"] >= n - 1 and len(got["peers"]) == n - 1 == got["descriptors"]


# ---- a peer that does not come is named ------------------------------------------------------
def test_absent_peer_is_named_by_alltoall_and_the_error_is_sticky(ranks):
    n, victim = 10, 7
    g = ranks(n, budget=4)
    g.run_ok(lambda c: c.barrier())
    res, errs = g.run(lambda c: c.alltoall(np.zeros(n, np.int32), timeout=2.0),
                      ranks=[r for r in range(n) if r != victim])
    msgs = [str(e) for e in errs if e is not None]
    assert len(msgs) == n - 1 and all(isinstance(e, CollectiveError) for e in errs if e is not None)
    assert any(f"rank {victim} (node{victim})" in m for m in msgs), msgs
    assert all("alltoall#2" in m for m in msgs), msgs
    with pytest.raises(CollectiveError):
        g.comms[0].barrier(timeout=2.0)


def _frozen_alltoall(comm, victim):
    comm.barrier()
    if comm.rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)          # frozen: its kernel still accepts connections
    comm.alltoall(np.zeros(comm.size * 2, np.int64))
    return "finished"


def test_frozen_peer_is_named(monkeypatch):
    monkeypatch.setenv("HPCRING_RING_MAX_CONNECTIONS", "4")
    n, victim = 6, 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with StoreServer("127.0.0.1", 0, secret=H.SECRET) as server:
        procs = [ctx.Process(target=H._child, args=(r, n, server.port, H.SECRET, _frozen_alltoall, (victim,),
                                                    q, 6.0)) for r in range(n)]
        for p in procs:
            p.start()
        out = H.collect(q, procs, n - 1, 120.0)    # the others; then the frozen one is killed
    others = [r for r in range(n) if r != victim]
    for r in others:
        assert out.get(r, ("missing",))[0] == "error", out
        assert "CollectiveError" in out[r][1] and "alltoall#2" in out[r][1], out[r]
    assert any(f"rank {victim} (node{victim})" in out[r][1] for r in others), out
