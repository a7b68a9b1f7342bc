"""The watchdog's side channel at scale: the trigger tree (every rank once, log2 n hops, a dead or
frozen rank's subtree still reached), its authenticated listener (nothing parsed before the MAC),
no idle store connections before a failure, the report's wire form, and a 4096-rank report that
fits one screen."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import math
import socket
import struct
import threading
import time
import types

import pytest

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_server import StoreServer
from hpcring.diagnostics.watchdog import fanout, listener, wire
from hpcring.diagnostics.report import diagnose
from hpcring.diagnostics.watchdog import Watchdog, _from_wire, _to_wire
from hpcring.errors import CollectiveError
from helpers.watchdog import WatchedComm

SECRET = b"f" * 32


# ------------------------------------------------------------------------------------ the tree

@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 9, 10, 13, 63, 64, 65, 73, 100, 512, 585, 1000, 4096, 5000])
def test_every_rank_has_one_parent_and_the_depth_is_log8(n):
    parent = {0: None}
    hops = {0: 0}
    todo = [0]
    while todo:
        v = todo.pop()
        kids = fanout.children(v, n)
        assert kids == sorted(kids, reverse=True)           # the largest subtree first
        for c in kids:
            assert c not in parent, f"{c} reached twice"
            parent[c], hops[c] = v, hops[v] + 1
            assert list(fanout.subtree(c, n)) == list(range(c, min(n, c + fanout.span(c, n))))
            assert set(fanout.subtree(c, n)) < set(fanout.subtree(v, n))
            todo.append(c)
    assert sorted(parent) == list(range(n))
    # the most non-zero base-8 digits of an index below n, by brute force
    digits = max(sum(1 for ch in (oct(x)[2:]) if ch != "0") for x in range(n))
    assert max(hops.values()) == fanout.depth(n) == digits
    assert fanout.depth(n) <= math.ceil(math.log(max(n, 2), 8))
    assert all(len(fanout.children(v, n)) <= 7 * fanout.levels(n) for v in range(n))   # sends per rank


# ----------------------------------------------------------------------- listeners over TCP

class _Ranks:
    """``n`` real listeners on loopback; each forwards what it receives (as the watchdog does)."""

    def __init__(self, n: int, root: int, dead=(), frozen=()) -> None:
        self.n, self.root = n, root
        self.got: dict[int, list[dict]] = {r: [] for r in range(n)}
        self.listeners, self.addrs, self.parked = {}, [None] * n, []
        for r in range(n):
            if r in frozen:       # accepts in the kernel (backlog) but never greets: a stopped process
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                s.listen(8)
                self.parked.append(s)
                self.addrs[r] = f"127.0.0.1:{s.getsockname()[1]}"
                continue
            lst = listener.Listener("127.0.0.1", SECRET, lambda m, r=r: self._on(r, m)).start()
            self.listeners[r] = lst
            self.addrs[r] = f"127.0.0.1:{lst.port}"
        for r in dead:            # its port is closed: connection refused
            self.listeners.pop(r).close()

    def _on(self, rank: int, msg: dict) -> None:
        self.got[rank].append(msg)
        fanout.forward(msg["root"], msg["n"], msg["v"], msg["addrs"], msg["trig"], SECRET, step_timeout=0.5)

    def start(self) -> list[int]:
        rel = [self.addrs[(self.root + i) % self.n] for i in range(self.n)]
        self.got[self.root].append({"root": self.root})
        return fanout.forward(self.root, self.n, 0, rel, {"rank": self.root, "error": "x"}, SECRET, step_timeout=0.5)

    def wait(self, ranks, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and not all(self.got[r] for r in ranks):
            time.sleep(0.02)

    def close(self) -> None:
        for lst in self.listeners.values():
            lst.close()
        for s in self.parked:
            s.close()


def test_the_trigger_reaches_every_rank_once_from_any_root():
    ranks = _Ranks(37, root=11)
    try:
        assert ranks.start() == []
        ranks.wait(range(37))
        assert all(len(ranks.got[r]) == 1 for r in range(37)), {r: len(v) for r, v in ranks.got.items()}
        assert all(m["trig"] == {"rank": 11, "error": "x"} for r, v in ranks.got.items() if r != 11 for m in v)
    finally:
        ranks.close()


def test_dead_and_frozen_ranks_do_not_cut_off_their_subtrees():
    # relative 32 and 8 are the root's children with subtrees (32-39, 8-15); 9 sits inside one
    n, dead, frozen = 40, {32, 9}, {8}
    ranks = _Ranks(n, root=0, dead=dead, frozen=frozen)
    try:
        ranks.start()
        alive = [r for r in range(n) if r not in dead | frozen]
        ranks.wait(alive)
        assert all(len(ranks.got[r]) == 1 for r in alive), {r: len(ranks.got[r]) for r in alive}
        assert not any(ranks.got[r] for r in dead | frozen)
    finally:
        ranks.close()


def _raw(port: int, payload_after_hello) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        ns = auth.DIAG.read_hello(s)
        s.sendall(payload_after_hello(ns))
        s.settimeout(3)
        try:
            s.recv(64)
        except OSError:
            pass


def _until(ready, timeout: float = 5) -> None:
    """Wait (polling, bounded) for what a listener's thread delivers."""
    end = time.monotonic() + timeout
    while not ready() and time.monotonic() < end:
        time.sleep(0.01)


def test_the_listener_parses_nothing_before_the_mac_and_caps_the_body():
    seen = []
    lst = listener.Listener("127.0.0.1", SECRET, seen.append).start()
    try:
        body = json.dumps({"root": 0}).encode()
        # wrong secret: the MAC fails, the body is never read
        with pytest.raises((ConnectionError, OSError)):
            wire.send(f"127.0.0.1:{lst.port}", body, b"x" * 32, timeout=3)
        # garbage of the right size
        _raw(lst.port, lambda ns: b"\0" * auth.DIAG.proof_len)
        # a valid MAC over a length past the cap: refused without reading the body

        def huge(ns):
            nc = b"n" * auth.NONCE_LEN
            extra = wire._EXTRA.pack(wire.MAX_BODY + 1, b"d" * 32)
            return nc + auth.DIAG.client_proof(SECRET, ns, nc, b"", extra) + extra
        _raw(lst.port, huge)
        # a valid MAC whose digest does not match the body sent
        def swapped(ns):
            nc = b"m" * auth.NONCE_LEN
            extra = wire._EXTRA.pack(len(body), b"\1" * 32)
            return nc + auth.DIAG.client_proof(SECRET, ns, nc, b"", extra) + extra + body
        _raw(lst.port, swapped)
        wire.send(f"127.0.0.1:{lst.port}", body, SECRET, timeout=5)     # the real one still gets in
        _until(lambda: seen)
        assert seen == [{"root": 0}]
    finally:
        lst.close()


def test_one_listener_thread_reads_many_senders_at_once_and_a_silent_one_blocks_nobody(monkeypatch):
    """The listener is one thread whatever arrives: 60 messages from 20 senders at once all get
    in, no thread is started for them, and a connection that never answers the greeting holds
    up nobody else (it is dropped after its step)."""
    monkeypatch.setattr(wire, "step", lambda: 1.0)
    seen: list = []
    lst = listener.Listener("127.0.0.1", SECRET, seen.append).start()
    silent = socket.create_connection(("127.0.0.1", lst.port), timeout=5)   # greeted, never answers
    try:
        threads = threading.active_count()
        t0 = time.monotonic()
        for batch in range(3):
            jobs = [(f"127.0.0.1:{lst.port}", wire.pack({"i": batch * 20 + i, "pad": "x" * (i * 997)}))
                    for i in range(20)]
            assert wire.send_many(jobs, SECRET, timeout=5) == [None] * 20
        assert time.monotonic() - t0 < 1.0                       # not behind the silent one
        assert threading.active_count() == threads
        _until(lambda: len(seen) >= 60)
        assert sorted(m["i"] for m in seen) == list(range(60))
        assert silent.recv(64).startswith(auth.DIAG.magic)      # it was greeted ...
        silent.settimeout(3)
        assert silent.recv(64) == b""                             # ... and closed after its step
    finally:
        silent.close()
        lst.close()
    assert not lst._thread.is_alive()


def test_a_full_listener_leaves_the_rest_in_the_backlog_without_spinning(monkeypatch):
    """At MAX_PENDING connections being read the listener stops accepting (the kernel's backlog
    holds the rest) instead of polling a readable socket in a loop; a slot freed by a silent
    connection's deadline lets the next one in."""
    monkeypatch.setattr(wire, "step", lambda: 1.0)
    monkeypatch.setattr(listener, "MAX_PENDING", 2)
    seen: list = []
    lst = listener.Listener("127.0.0.1", SECRET, seen.append).start()
    silent = [socket.create_connection(("127.0.0.1", lst.port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.2)
        cpu, t0 = time.process_time(), time.monotonic()
        wire.send(f"127.0.0.1:{lst.port}", json.dumps({"late": 1}).encode(), SECRET, timeout=5)
        took, used = time.monotonic() - t0, time.process_time() - cpu
        assert 0.5 < took < 4.0, took              # waited for a silent one's deadline
        assert used < 0.5 * took, (used, took)     # ... blocked, not spinning
        _until(lambda: seen)
        assert seen == [{"late": 1}]
    finally:
        for s in silent:
            s.close()
        lst.close()


def test_the_listener_drops_bytes_past_the_authenticated_length():
    seen: list = []
    lst = listener.Listener("127.0.0.1", SECRET, seen.append).start()
    try:
        body = json.dumps({"root": 1}).encode()

        def trailing(ns):
            nc = b"t" * auth.NONCE_LEN
            extra = wire._EXTRA.pack(len(body), hashlib.sha256(body).digest())
            return nc + auth.DIAG.client_proof(SECRET, ns, nc, b"", extra) + extra + body + b"{}"
        _raw(lst.port, trailing)
        wire.send(f"127.0.0.1:{lst.port}", json.dumps({"root": 2}).encode(), SECRET, timeout=5)
        _until(lambda: seen)
        assert seen == [{"root": 2}]
    finally:
        lst.close()


def test_a_listener_replies_with_its_acknowledgement_and_a_forged_reply_is_refused():
    """What ``on_message`` returns goes back with the acknowledgement (send's value, send_many's
    replies; a leaf's snapshot rides on the trigger's delivery); the reply is covered by the
    listener's proof and digest: a wrong proof, a reply over the cap or one that does not match
    its digest is an error on the sender's side, never handed on."""
    lst = listener.Listener("127.0.0.1", SECRET, lambda m: wire.pack({"echo": m["i"]}) if m["i"] else None).start()
    try:
        assert wire.unpack(wire.send(f"127.0.0.1:{lst.port}", json.dumps({"i": 7}).encode(), SECRET)) == {"echo": 7}
        assert wire.send(f"127.0.0.1:{lst.port}", json.dumps({"i": 0}).encode(), SECRET) == b""
        replies: list = []
        jobs = [(f"127.0.0.1:{lst.port}", json.dumps({"i": i}).encode()) for i in range(4)]
        assert wire.send_many(jobs, SECRET, timeout=5, replies=replies) == [None] * 4
        assert replies[0] == b"" and [wire.unpack(r)["echo"] for r in replies[1:]] == [1, 2, 3]
    finally:
        lst.close()

    def fake_listener(answer_for):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)

        def run():
            conn, _ = srv.accept()
            with conn:
                ns, greeting = auth.DIAG.hello()
                conn.sendall(greeting)
                frame = conn.recv(auth.DIAG.proof_len + 1024)
                nc, extra = auth.DIAG.check(SECRET, ns, frame[:auth.DIAG.proof_len])
                conn.sendall(answer_for(ns, nc, extra))
                time.sleep(0.5)
        threading.Thread(target=run, daemon=True).start()
        return srv

    def bad_proof(ns, nc, extra):
        return b"\0" * auth.MAC_LEN + wire._EXTRA.pack(0, hashlib.sha256(b"").digest())

    def over_cap(ns, nc, extra):
        rx = wire._EXTRA.pack(wire.MAX_BODY + 1, b"d" * 32)
        return auth.DIAG.server_proof(SECRET, ns, nc, b"", extra + rx) + rx

    def wrong_digest(ns, nc, extra):
        rx = wire._EXTRA.pack(2, hashlib.sha256(b"ok").digest())
        return auth.DIAG.server_proof(SECRET, ns, nc, b"", extra + rx) + rx + b"no"
    for forge in (bad_proof, over_cap, wrong_digest):
        srv = fake_listener(forge)
        try:
            with pytest.raises(ConnectionError):
                wire.send(f"127.0.0.1:{srv.getsockname()[1]}", b"{}", SECRET, timeout=3)
        finally:
            srv.close()
        srv = fake_listener(forge)
        try:
            replies = []
            errs = wire.send_many([(f"127.0.0.1:{srv.getsockname()[1]}", b"{}")], SECRET, timeout=3, replies=replies)
            assert isinstance(errs[0], ConnectionError) and replies == [b""], (forge.__name__, errs)
        finally:
            srv.close()


def test_a_reply_the_sender_does_not_take_is_reported_unsent():
    unsent: list = []
    big = wire.pack({"pad": base64.b64encode(os.urandom(5 << 20)).decode()})   # ~5 MiB that will not fit
    assert len(big) < wire.MAX_BODY                                          # the socket buffers at once
    lst = listener.Listener("127.0.0.1", SECRET, lambda m: big, unsent.append).start()
    try:
        body = json.dumps({"i": 1}).encode()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)    # the reply cannot land here
            s.settimeout(5)
            s.connect(("127.0.0.1", lst.port))
            ns = auth.DIAG.read_hello(s)
            nc = b"u" * auth.NONCE_LEN
            extra = wire._EXTRA.pack(len(body), hashlib.sha256(body).digest())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close with a reset
            s.sendall(nc + auth.DIAG.client_proof(SECRET, ns, nc, b"", extra) + extra + body)
            time.sleep(0.3)
        _until(lambda: unsent, 10)
        assert unsent == [{"i": 1}]
    finally:
        lst.close()


def test_send_many_delivers_to_all_at_once_and_types_each_failure():
    """One thread, many listeners: the live ones get their bodies; a closed port, a listener
    that never greets, one with another secret and a malformed address each fail on their own,
    with send()'s error types, and the whole call lasts one timeout, not one per failure."""
    seen: list = []
    good = [listener.Listener("127.0.0.1", SECRET, seen.append).start() for _ in range(5)]
    other = listener.Listener("127.0.0.1", b"o" * 32, seen.append).start()
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)                                          # accepts (kernel backlog), never greets
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        jobs = [(f"127.0.0.1:{g.port}", json.dumps({"to": i}).encode()) for i, g in enumerate(good)]
        jobs += [(f"127.0.0.1:{closed_port}", b"{}"), (f"127.0.0.1:{mute.getsockname()[1]}", b"{}"),
                 (f"127.0.0.1:{other.port}", b"{}"), ("no-port-here", b"{}")]
        t0 = time.monotonic()
        errs = wire.send_many(jobs, SECRET, timeout=1.5)
        took = time.monotonic() - t0
        assert errs[:5] == [None] * 5
        assert isinstance(errs[5], ConnectionRefusedError)
        assert isinstance(errs[6], TimeoutError) and "hello" in str(errs[6])
        assert isinstance(errs[7], (ConnectionError, OSError)) and errs[7] is not None
        assert isinstance(errs[8], (ValueError, OSError))
        assert took < 3.0, took                             # one timeout for all, not per failure
        _until(lambda: len(seen) >= 5)
        assert sorted(m["to"] for m in seen) == [0, 1, 2, 3, 4]    # the other secret's listener got nothing
        assert wire.send_many([], SECRET, timeout=1.0) == []
    finally:
        for g in good + [other]:
            g.close()
        mute.close()


@pytest.mark.parametrize("size", [100, 20_000, 3 << 20])
def test_send_many_carries_bodies_of_any_size(size):
    seen: list = []
    lst = [listener.Listener("127.0.0.1", SECRET, seen.append).start() for _ in range(3)]
    try:
        body = wire.pack({"pad": "x" * size})             # compressed above 16 KiB
        assert wire.send_many([(f"127.0.0.1:{x.port}", body) for x in lst], SECRET, timeout=10) == [None] * 3
        _until(lambda: len(seen) >= 3)
        assert [len(m["pad"]) for m in seen] == [size] * 3
    finally:
        for x in lst:
            x.close()


# ------------------------------------------------------------------------ watchdogs, one store

def test_48_watchdogs_use_the_store_only_to_trigger_and_all_get_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRING_JOB_ID", "5")
    n, frozen = 48, 47
    hosts = tuple(f"node{r // 4 + 1}" for r in range(n))
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        dogs, comms = [], []
        for r in range(n):
            topo = types.SimpleNamespace(rank=r, size=n, host=hosts[r], hosts=hosts, interface="lo",
                                         address="127.0.0.1")
            d = Watchdog(topo, ("127.0.0.1", srv.port), SECRET, grace=5.0, abort=False)
            d.where = (lambda r=r: "in load_batch at train.py:5" if r == frozen else "in allreduce at train.py:10")
            d.dump = lambda reason: None
            c = WatchedComm(r, n, stuck=r != frozen)
            d.register(c)
            dogs.append(d.start())
            comms.append(c)
        time.sleep(0.3)
        assert len(srv._loop.conns) == 0, "the watchdogs keep no idle connection to the store"
        before = srv.stats["connections"]          # each published its address at start, then hung up
        err = CollectiveError("allreduce#4: recv from rank 47 (node12) timed out")
        threads = [threading.Thread(target=dogs[r].on_failure, args=(comms[r], comms[r].stuck, err))
                   for r in (3, 20, 46)]          # three ranks fail at once; the rest hear it by the tree
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        end = time.monotonic() + 30
        for d in dogs:
            d._done.wait(max(0.0, end - time.monotonic()))
        reports = [d.report for d in dogs]
        try:
            assert all(rep is not None for rep in reports)
            assert {rep.headline for rep in reports} == {"allreduce#4: rank 47 (node12) never joined"}
            assert reports[0].categories["joined"] == list(range(47)) and sorted(reports[0].where) == list(range(n))
            # the three failing ranks connect; snapshots come up the tree and the report goes down it
            assert srv.stats["connections"] - before <= 3, srv.stats
        finally:
            for d in dogs:
                d.close()


# ----------------------------------------------------------------------------- the report

def _big_report(n: int = 4096, per_host: int = 8):
    hosts = [f"node{r // per_host + 1}" for r in range(n)]
    rec = {"seq": 812, "op": "allreduce", "dtype": "float32", "count": 1, "root": None, "backend": "ring",
           "timeout": 30.0, "site": "train.py:88 in step", "state": "started", "t_started": 1.0}
    snaps = {r: {"records": [rec], "last_done": 811, "where": "in allreduce at train.py:88 (step)"}
             for r in range(n - 1)}
    snaps[n - 1] = {"records": [], "last_done": 811, "where": "in load_batch at train.py:20"}
    return diagnose(n, hosts, snaps, {}, {"rank": 0, "host": "node1", "error": "timed out", "op": rec})


def test_a_4096_rank_report_is_one_screen():
    rep = _big_report()
    text = rep.text()
    lines = text.splitlines()
    assert len(lines) <= 10 and max(len(ln) for ln in lines) < 200, text
    assert rep.headline == "allreduce#812: rank 4095 (node512) never joined"
    assert "  joined    : ranks 0-4094 (node[1-512])" in lines
    assert "  where     : ranks 0-4094: in allreduce at train.py:88 (step)" in lines
    assert any(ln.startswith("  missing   : rank 4095 (node512): never joined: last completed #811, now in load_batch")
               for ln in lines)


def test_many_ranks_with_one_finding_share_a_line():
    n = 4096
    hosts = [f"node{r // 8 + 1}" for r in range(n)]
    rec = {"seq": 3, "op": "allreduce", "count": 1, "state": "started"}
    snaps = {r: {"records": [rec], "last_done": 2, "where": "in allreduce"} for r in range(0, n, 2)}
    rep = diagnose(n, hosts, snaps, {}, {"rank": 0, "error": "timed out", "op": rec})
    lines = rep.text().splitlines()
    assert len(lines) <= 10, rep.text()
    assert any(ln.startswith("  unreachable: 2048 ranks (1,3,5,7,9,11,13,15,...) (node[1-512]): no answer")
               for ln in lines), rep.text()


def test_the_wire_form_is_small_and_gives_the_same_report():
    rep = _big_report()
    wire = json.dumps(_to_wire(rep))
    assert len(wire) < 4096 < 50 * len(wire) < len(json.dumps(rep.to_dict()))   # read by every rank
    back = _from_wire(json.loads(wire), rep.hosts)
    assert back.text() == rep.text() and back.where == rep.where and back.hosts == rep.hosts
    # the text travels rendered (each rank rendering it is O(ranks)); rendering the rest gives it too
    plain = _from_wire({k: v for k, v in json.loads(wire).items() if k != "text"}, rep.hosts)
    assert plain.rendered is None and plain.text() == rep.text() == json.loads(wire)["text"]
    assert back.categories == {k: v for k, v in rep.categories.items() if v}


def test_scattered_ranks_and_hosts_are_cut_to_one_line():
    # seen at 2048 thread-ranks on an overloaded machine: hundreds of scattered unreachable ranks
    n = 2048
    hosts = [f"node{r // 8 + 1}" for r in range(n)]
    rec = {"seq": 1, "op": "allreduce", "count": 1, "state": "started"}
    answered = [r for r in range(n) if r % 3 and r % 7]
    snaps = {r: {"records": [rec], "last_done": 0, "where": "in allreduce"} for r in answered}
    rep = diagnose(n, hosts, snaps, {}, {"rank": 1, "error": "timed out", "op": rec})
    lines = rep.text().splitlines()
    assert len(lines) <= 10 and max(map(len, lines)) < 220, rep.text()
    assert rep.headline == "allreduce#1: 878 ranks (0,3,6-7,9,12,14-15,18,21,...) (node[1-256]) unreachable"
    assert sorted(rep.categories["unreachable"]) == [r for r in range(n) if r not in answered]   # the JSON has all


def test_the_reporter_waits_past_the_grace_only_while_snapshots_still_arrive(tmp_path):
    from hpcring.bootstrap.store_client import StoreClient
    n = 4
    topo = types.SimpleNamespace(rank=0, size=n, host="node1", hosts=("node1",) * n, interface="lo", address="127.0.0.1")
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        dog = Watchdog(topo, ("127.0.0.1", srv.port), SECRET, grace=2.0, abort=False)
        client = StoreClient("127.0.0.1", srv.port, SECRET, timeout=10)

        def arrive(ranks, every):
            c = StoreClient("127.0.0.1", srv.port, SECRET, timeout=10)
            for r in ranks:
                time.sleep(every)
                c.set(f"diag/snap/{r}", json.dumps({"rank": r, "records": [], "where": "x"}).encode())
                c.add("diag/nsnap", 1)
            c.close()
        own = {"rank": 0, "records": [], "where": "x"}        # the root's own, which it never waits for
        t = threading.Thread(target=arrive, args=(range(1, n), 0.9))    # slow but alive: 2.7 s > grace
        t.start()
        rep = dog._fallback.collect(client, {"rank": 0, "error": "x"}, None, own)
        t.join()
        assert sorted(rep.where) == list(range(n)), rep.categories      # none named unreachable
        for k in ("diag/nsnap",) + tuple(f"diag/snap/{r}" for r in range(n)):
            client.delete(k)
        t = threading.Thread(target=arrive, args=([1], 0.1))           # one comes, two never will
        start = time.monotonic()
        t.start()
        rep = dog._fallback.collect(client, {"rank": 0, "error": "x"}, None, own)
        took = time.monotonic() - start
        t.join()
        assert sorted(rep.where) == [0, 1] and rep.categories["unreachable"] == [2, 3]
        assert took >= 2.0                               # the grace itself is always given
        client.close()
