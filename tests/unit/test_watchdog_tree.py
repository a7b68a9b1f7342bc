"""The rounds after the trigger on the watchdog's tree (hpcring.diagnostics.watchdog.tree_rounds): snapshots
up, the report down, acknowledgements up and the exit down, with the store as the fallback of a
rank the tree loses; the wait budgets per level; compressed bodies with a bound on inflation."""
from __future__ import annotations

import json
import threading
import time
import types
import zlib

import pytest

from hpcring.bootstrap.store_server import StoreServer
from hpcring.diagnostics import watchdog as wdmod
from hpcring.diagnostics.watchdog import ending, fanout, wire
from hpcring.diagnostics.watchdog.store_fallback import StoreFallback
from hpcring.diagnostics.watchdog.tree_rounds import TreeRounds, gather_budget
from hpcring.diagnostics.watchdog import Watchdog
from hpcring.errors import CollectiveError
from helpers.watchdog import WatchedComm

SECRET = b"t" * 32


class _Job:
    """``n`` watchdogs in this process around a real store; rank ``frozen`` sits in load_batch."""

    def __init__(self, srv, n: int, frozen: int, abort: bool = False, grace: float = 3.0, stores=None) -> None:
        self.srv, self.n = srv, n
        self.hosts = tuple(f"node{r // 4 + 1}" for r in range(n))
        self.dogs, self.comms = [], []
        for r in range(n):
            topo = types.SimpleNamespace(rank=r, size=n, host=self.hosts[r], hosts=self.hosts, interface="lo",
                                         address="127.0.0.1")
            d = Watchdog(topo, ("127.0.0.1", srv.port), SECRET, grace=grace, abort=abort,
                         store=None if stores is None else stores[r])
            d.where = (lambda r=r: "in load_batch at train.py:5" if r == frozen else "in allreduce at train.py:10")
            d.dump = lambda reason: None
            c = WatchedComm(r, n, stuck=r != frozen, done=1)
            d.register(c)
            self.dogs.append(d.start())
            self.comms.append(c)

    def fail(self, rank: int) -> threading.Thread:
        c = self.comms[rank]
        t = threading.Thread(target=self.dogs[rank].on_failure,
                             args=(c, c.stuck, CollectiveError("allreduce#2: recv from rank 1 timed out")), daemon=True)
        t.start()
        return t

    def wait(self, timeout: float = 30.0) -> list:
        end = time.monotonic() + timeout
        for d in self.dogs:
            d._done.wait(max(0.0, end - time.monotonic()))
        return [d.report for d in self.dogs]

    def close(self) -> None:
        for d in self.dogs:
            d._closing = True
            d._listener._closing = True
        for d in self.dogs:
            d.close()


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRING_JOB_ID", "9")
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        yield srv


def test_budgets_shrink_down_the_tree_and_fit_in_the_roots_grace():
    for n in (2, 3, 17, 64, 1000, 4096):
        for v in range(1, n):
            b = gather_budget(v, n, 5.0)
            assert 0 <= b < 5.0
            for c in fanout.children(v, n):
                assert gather_budget(c, n, 5.0) < b, (n, v, c)      # a parent outwaits each child
            if not fanout.children(v, n):
                assert b == 0.0                                     # a leaf answers at once


def test_snapshots_come_up_and_the_report_goes_down_without_the_store(store):
    job = _Job(store, 24, frozen=23)
    try:
        before = store.stats["connections"]
        job.fail(5).join(30)
        reports = job.wait()
        assert all(r is not None for r in reports)
        assert {r.headline for r in reports} == {"allreduce#2: rank 23 (node6) never joined"}
        assert sorted(reports[5].where) == list(range(24))                  # every snapshot reached the root
        assert reports[0].text() == reports[5].text()                       # the same report, sent down
        assert store.stats["connections"] - before == 1                     # the trigger's, and nothing else
        assert all("heard" in d.timings and "published" in d.timings for d in job.dogs if d.rank != 5)
    finally:
        job.close()


def test_a_rank_whose_parent_is_gone_sends_its_subtree_through_the_store(store):
    # root 0: rank 8's parent is 0, ranks 9-15 are its children. Rank 8's listener goes away after
    # it forwarded the trigger (it died mid-failure): 9-15 still reach the report.
    n = 16
    job = _Job(store, n, frozen=15, grace=2.0)
    try:
        real = job.dogs[8]._tree_path.on_message

        def dying(msg):
            real(msg)
            if msg.get("kind") == "trigger":
                time.sleep(0.2)        # forwarded (its own handling has started); then it is gone
                job.dogs[8]._listener._sock.close()
        job.dogs[8]._listener._on_message = dying
        job.fail(0).join(30)
        reports = job.wait()
        rep = reports[0]
        for r in range(9, 16):
            assert r in rep.where, (r, rep.categories)      # through the store, not named unreachable
        assert "rank 15 (node4) never joined" in rep.headline
        assert all(reports[r] is not None for r in range(n))
    finally:
        job.close()


def test_a_subtree_that_comes_up_late_is_passed_on_alone():
    t = TreeRounds(rank=64, size=200)                      # subtree 64-127: children 72, 80, ... and 65-71
    assert t.place(0, 64, "127.0.0.1:1")
    t.set_kids([(72, "a"), (65, "b")], lost=[100, 101])     # (2 ranks below could not be reached)
    assert t.on_gather({"root": 0, "n": 200, "v": 72, "snaps": {"72": {"rank": 72}, "73": {"rank": 73}},
                        "stored": "80-84", "lost": "90"}) is None
    t.wait_gather(time.monotonic() + 0.05)                  # 65 never answers: the budget ends the wait
    up, stored, lost = t.take_up({"rank": 64})
    assert sorted(up) == [64, 72, 73] and stored == set(range(80, 85)) and lost == {90, 100, 101}
    late = t.on_gather({"root": 0, "n": 200, "v": 65, "snaps": {"65": {"rank": 65}}})
    assert late == ({65: {"rank": 65}}, set(), set())       # after ours went up: forwarded on its own
    # not this rank's tree: another root, another size, a rank outside our subtree
    for bad in ({"root": 1, "n": 200, "v": 65}, {"root": 0, "n": 201, "v": 65}, {"root": 0, "n": 200, "v": 2},
                {"root": 0, "n": 200, "v": 128}, {"root": 0, "n": 200, "v": "x"}, {"n": 200, "v": 65},
                {"root": 0, "n": 200, "v": 65, "lost": "many"}, {"root": 0, "n": 200, "v": 65, "stored": "5-300"}):
        assert t.on_gather({**bad, "snaps": {"65": {}}}) is None
    assert not t.place(3, 1, None)                         # a second trigger does not move us


def test_abort_mode_every_rank_prints_before_any_rank_exits(store, monkeypatch):
    # os._exit parks the calling thread here instead of ending the process; no scheduler to end
    exits, lines, release = {}, {}, threading.Event()

    def fake_exit(code):
        exits[threading.current_thread().name] = time.monotonic()
        release.wait(60)             # parked like an ended process, returns at the test's end

    monkeypatch.setattr(ending.os, "_exit", fake_exit)
    monkeypatch.setattr(ending.teardown, "end_job", lambda *a, **k: None)
    hook = lambda headline: lines.setdefault(threading.current_thread().name, time.monotonic())  # noqa: E731
    wdmod.add_exit_hook(hook)
    job = _Job(store, 12, frozen=11, abort=True, grace=1.5)
    try:
        job.fail(3)                  # (its thread then sleeps for the os._exit that ends a real process)
        end = time.monotonic() + 30
        while len(exits) < 12 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(lines) == 12 and len(exits) == 12, (sorted(lines), sorted(exits))
        assert min(exits.values()) >= max(lines.values())   # nobody left before everybody had printed
    finally:
        release.set()
        wdmod._EXIT_HOOKS.remove(hook)
        job.close()


def test_compressed_bodies_are_inflated_only_within_the_bound(monkeypatch):
    snaps = {str(r): {"rank": r, "where": "in allreduce at train.py:10", "records": [{"seq": 1}] * 8}
             for r in range(4096)}
    body = wire.pack({"kind": "gather", "snaps": snaps})
    assert body[:1] == b"x" and len(body) < len(json.dumps(snaps)) / 10      # snapshots differ little
    assert wire.unpack(body)["snaps"]["4095"]["rank"] == 4095
    assert wire.pack({"kind": "exit"})[:1] == b"{"                       # small ones stay plain
    monkeypatch.setattr(wire, "MAX_INFLATED", 1 << 16)
    with pytest.raises(ValueError, match="inflates past"):
        wire.unpack(zlib.compress(b"{" + b" " * (1 << 20) + b"}"))         # a bomb stops at the bound
    for junk in (b"x\x00garbage", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ValueError):
            wire.unpack(junk)


def test_a_stopped_rank_is_accounted_for_and_costs_the_grace_alone(store):
    # rank 9 accepts in its kernel but never greets (SIGSTOPped): the tree counts it as
    # unreachable after one step; the root gives it the grace (a starved rank would publish
    # through the store meanwhile), then reports, without the extensions for late arrivals
    import socket
    from hpcring.bootstrap.store_client import StoreClient
    job = _Job(store, 16, frozen=15, grace=6.0)
    parked = socket.socket()
    try:
        parked.bind(("127.0.0.1", 0))
        parked.listen(8)
        with StoreClient("127.0.0.1", store.port, SECRET, timeout=5) as c:
            c.set("diag/addr/9", f"127.0.0.1:{parked.getsockname()[1]}".encode())
        job.dogs[9].close()
        start = time.monotonic()
        job.fail(0)
        job.dogs[0]._done.wait(30)
        took = time.monotonic() - start
        rep = job.dogs[0].report
        assert rep is not None and rep.categories["unreachable"] == [9], rep.categories
        assert sorted(rep.where) == [r for r in range(16) if r != 9]
        assert 6.0 <= took < 7.5, took                        # the grace, not the 3 graces of its hard bound
    finally:
        parked.close()
        job.close()


@pytest.mark.parametrize("value, step", [(None, 2.0), ("10", 2.0), ("5", 2.0), ("120", 24.0), ("600", 120.0)])
def test_the_tree_step_follows_a_raised_handshake_timeout(monkeypatch, value, step):
    if value is None:
        monkeypatch.delenv("HPCRING_HANDSHAKE_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("HPCRING_HANDSHAKE_TIMEOUT", value)
    assert wire.step() == step


def test_failing_threads_do_the_trees_work_and_claim_on_their_session_connection(store, monkeypatch):
    """Every rank but the frozen one fails at once: each handles the tree's rounds (forward,
    snapshot, report, passing the report on) in its own failing thread, and claims the trigger
    on the session's store connection: one new store connection (the root's) and a thread for
    the frozen rank alone, whatever the number of ranks."""
    from hpcring.bootstrap.store_client import StoreClient
    n, frozen = 24, 23
    clients = [StoreClient("127.0.0.1", store.port, SECRET, timeout=10) for _ in range(n)]
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        return real_start(self)
    job = _Job(store, n, frozen=frozen, stores=clients)
    # every failing thread is inside trigger() before the first claim: a rank the tree reaches
    # before its own collective failed rightly starts a thread (a loaded machine does that)
    entered = threading.Barrier(n - 1, timeout=20)
    real_claim = StoreFallback.claim_trigger

    def claim_together(self):
        entered.wait()
        return real_claim(self)
    monkeypatch.setattr(StoreFallback, "claim_trigger", claim_together)
    sent_up: list = []
    real_send = wire.send
    monkeypatch.setattr(wire, "send", lambda *a, **k: sent_up.append(a[0]) or real_send(*a, **k))
    try:
        before = store.stats["connections"]
        monkeypatch.setattr(threading.Thread, "start", start)
        fails = [job.fail(r) for r in range(n) if r != frozen]
        reports = job.wait()
        for t in fails:
            t.join(10)
        assert {r.headline for r in reports if r is not None} == {"allreduce#2: rank 23 (node6) never joined"}
        assert all(r is not None for r in reports)
        mine = [s for s in started if s.startswith("hpcring-watchdog")]
        root = next(d.rank for d in job.dogs if d._tree.is_root)
        assert [s for s in mine if s.startswith("hpcring-watchdog-tree")] == [f"hpcring-watchdog-tree:{frozen}"], mine
        # the root forwards and sends the report down from threads of its own; nobody else
        assert {s.split(":")[1] for s in mine if not s.startswith("hpcring-watchdog-tree")} <= {str(root), str(frozen)}, mine
        assert store.stats["connections"] - before == 1, "claims go over the session's connections"
        # leaves (relative 1-7, 9-15, 17-23) answer the trigger with their snapshot: only the two
        # inner ranks (relative 8 and 16) send their subtrees up on connections of their own
        assert len(sent_up) == 2, sent_up
        assert all("published" in d.timings for d in job.dogs)
        assert all(d.timings.get("claimed") for d in job.dogs if d.rank != frozen)
    finally:
        job.close()
        for c in clients:
            c.close()


def test_a_claim_on_a_busy_session_connection_takes_a_connection_of_its_own(store):
    """Another thread holds the session's store client in a long parked read: the claim does
    not wait for it (ClientBusy within the claim's bound) and goes through a new connection."""
    from hpcring.bootstrap.store_client import StoreClient
    n = 4
    clients = [StoreClient("127.0.0.1", store.port, SECRET, timeout=30) for _ in range(n)]
    job = _Job(store, n, frozen=3, stores=clients)
    busy = threading.Thread(target=lambda: _ignore(lambda: clients[1].get("never", timeout=8)), daemon=True)
    busy.start()
    time.sleep(0.2)
    try:
        before = store.stats["connections"]
        start = time.monotonic()
        t = job.fail(1)
        job.dogs[1]._done.wait(20)
        assert job.dogs[1].report is not None and time.monotonic() - start < wdmod.CLAIM_TIMEOUT + 4.0
        assert job.dogs[1].report.headline == "allreduce#2: rank 3 (node1) never joined"
        assert store.stats["connections"] - before == 1          # its own connection, after the bounded wait
        t.join(10)
    finally:
        job.close()
        for c in clients:
            c.close()


def _ignore(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the parked read ends in a timeout; that is the point
        pass
