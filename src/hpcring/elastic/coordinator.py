"""The elastic rendezvous's coordinator: one thread beside the store, outside every worker.

It lives where the store lives (the elastic driver, :mod:`hpcring.elastic.driver`), so losing
any worker, rank 0 included, loses neither the store nor the membership. Every TICK_S it reads
new join requests, heartbeats and normal exits from the store, takes deaths the driver saw (a
child process that exited), and acts on :func:`hpcring.elastic.membership.decide`: publish a
round, announce newcomers, abort a lost round, or publish the error that ends the job.
A worker silent for ``dead_after_s`` (no heartbeat: killed on another host, frozen, cut off)
counts as dead; the driver's own children are known dead at once.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from hpcring.elastic import protocol as P
from hpcring.elastic.membership import ADDED, ALIVE, DEAD, LEFT, Decision, Worker, decide
from hpcring.errors import BootstrapError

log = logging.getLogger("hpcring.elastic.coordinator")
TICK_S = 0.05
REQUEST_GAP_S = 60.0     # a numbered join request still unwritten after this: its worker died


HOST = "host:"            # a driver's report about every worker of one host (report_host)


def same_host(a: str, b: str) -> bool:
    """Whether two names are one host (a worker may say node1.cluster where the launcher said node1)."""
    return a == b or a.split(".", 1)[0] == b.split(".", 1)[0]


class Coordinator:
    """Decides the rounds. ``client``: a StoreClient of the store (used from this thread only).
    ``say``: where one-line events go (the driver prints them)."""

    def __init__(self, client, *, start_np: int, min_np: int, max_np: int, reset_limit: int | None = None,
                 timeout_s: float = P.DEFAULT_TIMEOUT_S, dead_after_s: float = P.DEFAULT_DEAD_AFTER_S,
                 say: Callable[[str], None] | None = None) -> None:
        if not 1 <= min_np <= start_np <= max_np:
            raise ValueError(f"need 1 <= min_np ({min_np}) <= np ({start_np}) <= max_np ({max_np})")
        self.client = client
        self.start_np, self.min_np, self.max_np = start_np, min_np, max_np
        self.reset_limit, self.timeout_s, self.dead_after_s = reset_limit, timeout_s, dead_after_s
        self.say = say or (lambda text: log.info("%s", text))
        self.workers: dict[str, Worker] = {}
        self.round_no = 0
        self.members: list[str] = []
        self.resets = 0
        self.error: str | None = None
        self.history: list[dict] = []           # every round published (and when)
        self._seen = 0                          # requests read
        self._gap_since: float | None = None    # when the next numbered request was found unwritten
        self._beats: dict[str, tuple[int, float]] = {}   # wid -> (counter, when it last changed)
        self._reports: list[tuple[str, str, str]] = []    # (wid, status, why) from the driver
        self._lock = threading.Lock()
        self._due_since: float | None = None    # since when a round is due (the first: the first request)
        self._aborted = 0
        self._announced: set[str] = set()
        self._updated = 0
        self._finished = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcring-elastic-coordinator", daemon=True)

    # -- from other threads ------------------------------------------------------------------
    def start(self) -> "Coordinator":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def report(self, wid: str, status: str, why: str = "") -> None:
        """The driver saw ``wid`` end: DEAD (``why``: its exit) or LEFT (exit code 0)."""
        with self._lock:
            self._reports.append((wid, status, why))

    def report_host(self, host: str, status: str, why: str = "") -> None:
        """The driver saw the launcher step of ``host`` end: every live worker there is DEAD or
        LEFT (a node's workers are one step: their exits are not seen one by one)."""
        with self._lock:
            self._reports.append((HOST + host, status, why))

    def snapshot(self) -> dict:
        with self._lock:
            return {"round": self.round_no, "members": list(self.members), "resets": self.resets,
                    "error": self.error, "status": {w.wid: w.status for w in self.workers.values()},
                    "hosts": {w.wid: w.host for w in self.workers.values()}}

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(TICK_S):
            try:
                self.tick(time.monotonic())
                failures = 0
            except BootstrapError as e:       # the store is ours and local: this is not expected
                failures += 1
                log.warning("elastic coordinator: %s", e.message)
                if failures > 100:
                    self.error = f"the coordinator lost its store: {e.message}"
                    return

    def tick(self, now: float) -> Decision | None:
        self._read_requests(now)
        self._read_liveness(now)
        with self._lock:
            reports, self._reports = self._reports, []
        for wid, status, why in reports:
            if wid.startswith(HOST):
                host = wid[len(HOST):]
                for w in [w for w in self.workers.values() if w.status == ALIVE and same_host(w.host, host)]:
                    self._mark(w.wid, status, why)
            else:
                self._mark(wid, status, why)
        if self.error is not None:
            return None
        due = self._due(now)
        waited = 0.0 if due is None else now - due
        d = decide(self.workers, self.round_no, self.members, start_np=self.start_np, min_np=self.min_np,
                   max_np=self.max_np, resets=self.resets, reset_limit=self.reset_limit, waited_s=waited,
                   timeout_s=self.timeout_s)
        if d.abort and self._aborted < self.round_no:
            self._aborted = self.round_no
            self.client.set(P.ABORT, str(self.round_no).encode())
        if d.action == "form":
            self._form(d.members)
        elif d.action == "error":
            self._fail(d.message)
        elif d.action == "finished" and not self._finished:
            self._finished = True        # late newcomers hear it; the job itself succeeded
            self.client.set(P.round_key(self.round_no + 1), P.dumps({"round": self.round_no + 1, "error": d.message}))
            self.say(f"elastic: {d.message}")
        elif d.notify == ADDED:
            new = {w.wid for w in self.workers.values() if w.waiting and w.wid not in self.members}
            if not new <= self._announced:
                self._announced |= new
                self._updated += 1
                self.client.set(P.UPDATED, P.dumps({"timestamp": self._updated, "result": ADDED}))
                self.say(f"elastic: {', '.join(sorted(new - set(self.members)))} waiting to join: "
                         f"asking round {self.round_no}'s members to reset at their next commit")
        return d

    def _due(self, now: float) -> float | None:
        """Since when a round has been due (None: none is)."""
        if self.round_no == 0:      # the clock starts with the first worker that asks (not the queue)
            if self._due_since is None and any(w.waiting for w in self.workers.values()):
                self._due_since = now
            return self._due_since
        due = any(self.workers[m].status == DEAD or (self.workers[m].status == ALIVE and self.workers[m].waiting)
                  for m in self.members)
        if not due:
            self._due_since = None
        elif self._due_since is None:
            self._due_since = now
        return self._due_since

    def _read_requests(self, now: float) -> None:
        n = self.client.add(P.NREQ, 0)
        while self._seen < n:
            raw = self.client.check(P.req(self._seen + 1))
            if raw is None:
                # numbered but not written yet: a worker between its add and its set (a loaded
                # machine can stall it for seconds); read it next tick, never skip it, unless it
                # stays missing long enough that the worker must have died in between
                since = self._gap_since = self._gap_since or now
                if now - since < REQUEST_GAP_S:
                    return
            self._seen += 1
            self._gap_since = None
            try:
                req = json.loads(raw) if raw is not None else None
            except ValueError:
                req = None
            if req is None:
                continue
            wid = str(req["wid"])
            w = self.workers.get(wid)
            if w is None:
                w = self.workers[wid] = Worker(wid, self._seen, str(req.get("host", "?")))
                self._beats[wid] = (-1, now)
            if w.status != ALIVE:
                self.client.set(P.expelled(wid), w.why.encode() or b"dead")
                continue
            w.waiting, w.reason = True, str(req.get("reason", "start"))

    def _read_liveness(self, now: float) -> None:
        alive = [w for w in self.workers.values() if w.status == ALIVE]
        if not alive:
            return
        keys = [P.hb(w.wid) for w in alive] + [P.left(w.wid) for w in alive]
        values = self.client.multi_check(keys)
        for i, w in enumerate(alive):
            beat, gone = values[i], values[len(alive) + i]
            if gone is not None:
                self._mark(w.wid, LEFT, "")
                continue
            count = int(beat) if beat is not None else -1
            last, since = self._beats[w.wid]
            if count != last:
                self._beats[w.wid] = (count, now)
            elif now - since > self.dead_after_s:
                self._mark(w.wid, DEAD, f"no heartbeat for {now - since:.1f} s")

    def _mark(self, wid: str, status: str, why: str) -> None:
        w = self.workers.get(wid)
        if w is None:      # the driver saw a child end that never asked to join
            w = self.workers[wid] = Worker(wid, 10**9, "?")
        if w.status != ALIVE:
            return
        w.status, w.why, w.waiting = status, why, False
        if status == DEAD:
            self.client.set(P.expelled(wid), why.encode() or b"dead")
            where = f"a member of round {self.round_no}" if wid in self.members else "not a member"
            self.say(f"elastic: worker {wid} lost ({why}; {where})")

    def _form(self, members: list[str]) -> None:
        self.round_no += 1
        if self.round_no > 1:
            self.resets += 1
        hosts = [self.workers[m].host for m in members]
        for m in members:
            self.workers[m].waiting = False
        with self._lock:
            self.members = list(members)
        self._due_since = None
        # every rank must agree on skipping the sync (a removal-only HostsUpdatedInterrupt): only
        # when every member came back from one; a failed collective or a newcomer means sync
        sync = any(self.workers[m].reason != "interrupt" for m in members)
        rec = {"round": self.round_no, "members": members, "hosts": hosts, "resets": self.resets,
               "updated": self._updated, "sync": sync}
        self.client.set(P.round_key(self.round_no), P.dumps(rec))
        self.client.set(P.CURRENT, str(self.round_no).encode())
        self.history.append({**rec, "at": time.time()})
        self.say(f"elastic: round {self.round_no}: {len(members)} workers, rank order {', '.join(members)}")

    def _fail(self, message: str) -> None:
        self.error = message
        self.client.set(P.round_key(self.round_no + 1), P.dumps({"round": self.round_no + 1, "error": message}))
        if self._aborted < self.round_no:
            self._aborted = self.round_no
            self.client.set(P.ABORT, str(self.round_no).encode())
        self.say(f"elastic: the job cannot go on: {message}")
