"""The straggler watcher: every rank's rows of a window reach rank 0, which judges them.

No collective is added and nothing runs on the collective's path: the flight recorder already
keeps each collective's start and end. One background thread per rank looks at the rendezvous
store every ``period`` seconds (HPCRING_STRAGGLER_PERIOD; 0.25 s, or size/1000 s above 250
ranks, so the store sees at most about 1000 small requests a second however large the job):

1. rank 0 names the next window: ``strag/<comm>/want`` = its sequence number now + 1 and W
   (HPCRING_STRAGGLER_WINDOW), so every rank will reach it;
2. each rank, once its recorder has ended all W of them, writes its row (W float32 times inside,
   its compute and its ring sends' blocked share, about 0.2 KiB;
   :class:`~hpcring.diagnostics.stragglers.Row`) to
   ``strag/<comm>/row/<rank>``, replacing its previous one (the store holds one row per rank);
3. rank 0 reads every row in one batched request; when all are for the window it judges it
   (:func:`~hpcring.diagnostics.stragglers.judge`), prints a line on its stderr when the
   verdict changes (a new straggler, or none any more), appends it to
   ``<job folder>/diag/stragglers.jsonl`` (read by ``hpcring report``), writes the window's
   per-rank figures to ``<job folder>/live.json`` for ``hpcring top`` where the job has a
   folder (and, at most every 5 s, the median rank's collective rate to
   ``diag/windows.jsonl``: the report's rate over the run), and names the next window.

A rank that has no row for the window (its records were overwritten: more than
HPCRING_FLIGHT_RECORDS collectives in one period) writes an empty one and the window is
skipped; a window whose rows do not all come within 30 periods of rank 0's own (a rank is
stuck, which the hang watchdog names, or the job is ending) is given up and the next named.
However long rank 0 itself takes to end a window (slow steps), it waits for it.

Cost: a rank asks the store only once its recorder has passed the end of the window named (until
then a tick reads one counter), so per window about one round trip to learn the next window and
one write, off the training thread; rank 0 reads n rows a window (0.9 MiB at 4096 ranks) and
judges them with numpy (an n x W array). Measured in benchmarks/stragglers.py.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from hpcring.config import envvars
from hpcring.diagnostics import stragglers as sg
from hpcring.fsutil import write_json
from hpcring.jobdir import job_folder

log = logging.getLogger(__name__)
GIVE_UP_PERIODS = 30
WINDOW_LOG_EVERY = 5.0      # s between lines of diag/windows.jsonl (the report's rate over the run)


def rules_from_env() -> sg.Rules:
    return sg.Rules(share=envvars.get("HPCRING_STRAGGLER_SHARE"), min_ms=envvars.get("HPCRING_STRAGGLER_MIN_MS"),
                    min_frac=envvars.get("HPCRING_STRAGGLER_MIN_FRAC"),
                    link_share=envvars.get("HPCRING_STRAGGLER_LINK_SHARE"))


def period_for(size: int) -> float:
    p = envvars.get("HPCRING_STRAGGLER_PERIOD")
    return p if p > 0 else max(0.25, size / 1000.0)


class StragglerWatch:
    """One communicator's watcher on one rank (see the module doc); :meth:`start`, :meth:`stop`."""

    def __init__(self, comm, store, hosts, *, name: str = "world", window: int | None = None,
                 rules: sg.Rules | None = None, period: float | None = None, folder=None,
                 out=None, members=None, group: str | None = None, tag: str = "") -> None:
        """``hosts``: by the communicator's ranks. A group's watcher (``members``: its global
        ranks, ``group``: its name) names global ranks and the group, and keeps its verdicts in
        ``diag/stragglers-<tag>.jsonl`` (one writer a file); the job's rate and live.json stay the
        job-wide watcher's."""
        self.comm, self.store, self.hosts = comm, store, tuple(hosts)
        self.members, self.group, self.tag = (tuple(members) if members is not None else None), group, tag
        self.rank, self.size = comm.rank, comm.size
        self.window = window or envvars.get("HPCRING_STRAGGLER_WINDOW")
        self.rules = rules or rules_from_env()
        self.period = period if period is not None else period_for(self.size)
        self.folder = folder            # the job folder (rank 0 writes there), or None
        self.out = out if out is not None else sys.stderr
        self._key = f"strag/{name}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._want: tuple[int, int] | None = None       # rank 0: the window named; others: seen
        self._own: sg.Row | None = None                 # rank 0: its row of the named window
        self._ready_at = 0.0                            # ... and when it had it (the give-up clock)
        self._sent: int | None = None                   # the first seq of the last row written
        self._seen: tuple[int, int] | None = None       # others: the last window rank 0 named
        self._links_prev: tuple = (None, {})            # (monotonic, {peer: send wait s}) at the last row
        self.current: sg.Verdict | None = None          # rank 0: the verdict in force
        self.history: list[dict] = []                   # rank 0: every change, as written
        self.windows = 0                                # rank 0: windows judged
        # rank 0: called with each judged window's figures (the dict live.json holds); metrics
        # exporters hook in here. A listener that raises is logged and dropped.
        self.listeners: list = []
        self._logged = 0.0                              # rank 0: when windows.jsonl last got a line
        self.cpu_s = 0.0                                # CPU this watcher's thread used (its cost)

    def start(self) -> "StragglerWatch":
        if self._thread is None and self.size > 1:
            self._link_share()                           # the baseline of the first row's link waits
            self._thread = threading.Thread(target=self._run, name=f"hpcring-stragglers:{self.rank}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        if self.rank == 0:                   # the first window starts with the next collective
            try:
                self._name(self.comm.recorder.seq + 1, time.monotonic())
            except Exception as e:   # noqa: BLE001
                log.debug("rank 0: straggler watcher does not start: %s", e)
                return
        while not self._stop.wait(self.period):
            c0 = time.thread_time()
            try:
                self.tick()
            except Exception as e:   # noqa: BLE001 - the store gone (job ending): stop quietly
                log.debug("rank %d: straggler watcher stops: %s", self.rank, e)
                return
            finally:
                self.cpu_s += time.thread_time() - c0

    def tick(self) -> None:
        """One look (the thread calls it every period; tests call it directly)."""
        if self.rank == 0:
            self._lead()
        else:
            self._follow()

    def _follow(self) -> None:
        if self._seen is not None:
            first, w = self._seen
            if first != self._sent and self.comm.recorder.seq < first + w - 1:
                return            # the window named is not over here yet: nothing to ask or to tell
        raw = self.store.multi_check([f"{self._key}/want"])[0]
        if not raw:
            return
        first, w = (int(v) for v in raw.split())
        self._seen = (first, w)
        if first == self._sent:
            return
        row = self._row(first, w)
        if row is not None:
            self.store.set(f"{self._key}/row/{self.rank}", row.encode())
            self._sent = first

    def _row(self, first: int, w: int) -> sg.Row | None:
        """This rank's row for the window; None while some of it has not ended; an empty row
        when its records are gone."""
        if self.comm.recorder.seq < first + w - 1:
            return None
        recs = self.comm.recorder.span(first, w)
        if any(r.state in ("queued", "started") for r in recs):
            return None
        row = sg.window_of(recs, first, w, self.rank) or sg.Row(self.rank, first, _empty(), 0.0)
        row.peer, row.send_share = self._link_share()
        return row

    def _link_share(self) -> tuple[int, float]:
        """The ring peer this rank's sends waited on most since the last row, and the share of the
        wall time they waited; (-1, 0.0) for a backend that does not count it."""
        waits = getattr(getattr(self.comm, "backend", None), "link_waits", None)
        if waits is None:
            return -1, 0.0
        now = time.monotonic()
        cur = {peer: send for peer, send, _ in waits()}
        t_prev, prev = self._links_prev
        self._links_prev = (now, cur)
        if t_prev is None or now <= t_prev:
            return -1, 0.0
        delta = {p: v - prev.get(p, 0.0) for p, v in cur.items()}
        if not delta:
            return -1, 0.0
        peer = max(delta, key=delta.get)
        return peer, max(0.0, delta[peer]) / (now - t_prev)

    def _lead(self) -> None:
        rec = self.comm.recorder
        now = time.monotonic()
        if self._want is None:
            self._name(rec.seq + 1, now)
            return
        first, w = self._want
        if self._own is None or self._own.first != first:
            own = self._row(first, w)
            if own is None:
                return                  # rank 0 is still in the window: wait, however long it takes
            self._own, self._ready_at = own, now    # once: its link share covers the whole window
        keys = [f"{self._key}/row/{r}" for r in range(1, self.size)]
        blobs = self.store.multi_check(keys)
        rows = [self._own]
        for blob in blobs:
            row = sg.Row.decode(blob) if blob else None
            if row is None or row.first != first:
                if now - self._ready_at > GIVE_UP_PERIODS * self.period:
                    self._name(rec.seq + 1, now)
                return
            rows.append(row)
        self._judge(rows, first, w)
        self._name(max(rec.seq + 1, first + w), now)

    def _name(self, first: int, now: float) -> None:
        self._want = (first, self.window)
        self.store.set(f"{self._key}/want", f"{first} {self.window}".encode())

    # -- rank 0: verdicts ---------------------------------------------------------------------
    def _judge(self, rows: list[sg.Row], first: int, w: int) -> None:
        self.windows += 1
        if any(len(r.inside) != w for r in rows):
            return                                     # a rank's records were gone: skip the window
        verdict = sg.judge(rows, self.hosts, self.rules, self._op_names(first, w))
        if verdict is not None and self.members is not None:
            verdict = verdict.in_group(self.members, self.group)
        if self.members is None:
            self._live(rows, first, w, verdict)
        old = self.current
        if (verdict is None) == (old is None) and (verdict is None or verdict.key == old.key):
            return
        self.current = verdict
        line = verdict.line() if verdict is not None else sg.cleared_line(old, w)
        if verdict is None and self.group:
            line += f" ({self.group})"
        entry = {"at": time.time(), "first": first, "ops": w, "line": line,
                 "verdict": verdict.to_dict() if verdict is not None else None}
        self.history.append(entry)
        print(f"hpcring: {line}", file=self.out, flush=True)
        self._append(entry)

    def _op_names(self, first: int, w: int) -> str:
        names = sorted({r.op for r in self.comm.recorder.span(first, w)})
        return "collectives" if len(names) != 1 else f"{names[0]}s"

    def _append(self, entry: dict) -> None:
        if self.folder is None:
            return
        try:
            diag = os.path.join(self.folder, "diag")
            os.makedirs(diag, exist_ok=True)
            name = f"stragglers-{self.tag}.jsonl" if self.members is not None else "stragglers.jsonl"
            with open(os.path.join(diag, name), "a") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            log.warning("rank 0: could not record the straggler verdict: %s", e)

    def _live(self, rows: list[sg.Row], first: int, w: int, verdict) -> None:
        to_file = self.folder is not None and os.path.isdir(self.folder)
        if not to_file and not self.listeners:
            return
        late = sg.lateness(rows)
        ranks = []
        for r in rows:
            span = float(r.inside.sum()) + r.compute
            ranks.append({"rank": r.rank, "host": self.hosts[r.rank], "lateness_ms": round(late.get(r.rank, 0.0), 3),
                          "inside_s": round(float(r.inside.sum()), 6), "compute_s": round(r.compute, 6),
                          "ops_per_s": round(w / span, 3) if span > 0 else None})
        recs = self.comm.recorder.span(first + w - 1, 1)
        data = {"written": time.time(), "first": first, "ops": w, "size": self.size,
                "last_op": recs[0].op if recs else None, "ranks": ranks,
                "verdict": verdict.to_dict() if verdict is not None else None}
        for fn in list(self.listeners):
            try:
                fn(data)
            except Exception as e:   # noqa: BLE001 - an exporter's bug must not stop the verdicts
                log.warning("rank 0: straggler listener %r failed and is dropped: %s", fn, e)
                self.listeners.remove(fn)
        if not to_file:
            return
        try:
            write_json(os.path.join(self.folder, "live.json"), data)
            if data["written"] - self._logged >= WINDOW_LOG_EVERY:
                self._logged = data["written"]
                rates = sorted(r["ops_per_s"] for r in ranks if r["ops_per_s"])
                line = {"at": round(data["written"], 3), "first": first, "ops": w,
                        "ops_per_s": rates[len(rates) // 2] if rates else None,
                        "max_lateness_ms": round(max(late.values(), default=0.0), 3)}
                os.makedirs(os.path.join(self.folder, "diag"), exist_ok=True)
                with open(os.path.join(self.folder, "diag", "windows.jsonl"), "a") as f:
                    f.write(json.dumps(line) + "\n")
        except OSError as e:
            log.debug("rank 0: live.json not written: %s", e)


def _empty():
    import numpy as np
    return np.zeros(0)


def start_for(session, comm, name: str, members=None, group: str | None = None, tag: str = ""):
    """Start the watcher for ``comm`` (a job-wide communicator of ``session``; or a group's, given
    its global ``members``, its name and a file ``tag``) unless HPCRING_STRAGGLERS=0 or it has one
    rank; None then. A group's windows are timed on the job's size, as the job-wide one's (the
    store's load is what the period bounds)."""
    if not envvars.get("HPCRING_STRAGGLERS") or comm.size < 2:
        return None
    folder = None
    if comm.rank == 0:
        path = job_folder()
        folder = str(path) if (os.environ.get("SUBMITIT_FOLDER") or os.environ.get("HPCRING_JOB_DIR")
                               or path.is_dir()) else None
    hosts = session.topology.hosts
    if members is not None:
        hosts = [hosts[m] for m in members]
    return StragglerWatch(comm, session.store, hosts, name=name, folder=folder, members=members, group=group,
                          tag=tag, period=period_for(session.topology.size)).start()
