"""Flight recorder: the last N collectives of a communicator, cheap enough to be always on.

Each collective the :class:`~hpcring.collectives.api.Communicator` runs gets a :class:`Record`:
sequence number, op, dtype, element count, root, backend, state (``queued`` -> ``started`` ->
``done`` or ``failed``), wall-clock timestamps and the Python call site that issued it. Records
live in a bounded deque (``HPCRING_FLIGHT_RECORDS``, default 2048), so memory is fixed however
long the job runs.

Two stores, one recorder: the general path keeps :class:`Record` objects in the deque (about
1 us per call: an object, a frame walk, a lock); the short paths of the host backends write a
slot of :attr:`FlightRecorder.flight`, a preallocated ring in C (``hpcring._native.Flight``: no
Python object per call; the ring backend's allreduce writes it from C in the same call as the
collective). One sequence counter (the ring's) numbers both; readers (:meth:`records`, reports,
dumps) see one history, merged by sequence number, with ring slots turned into Records on read.

The recorder is what the hang watchdog exchanges between ranks (the last few records and the
ones in flight) and what is dumped as JSON to ``<job folder>/diag/flight-rank<r>.json`` on a
failure, on a timeout and on SIGRTMIN+7 (see :mod:`hpcring.diagnostics.watchdog`).

Besides the bounded history it keeps :meth:`FlightRecorder.totals`: count, start and end of the
first and last, and sums of start times and of time inside, of every collective ended since the
start (O(1): the C ring adds each record as it ends; a Python record is added when the deque
drops it, or when totals are read). ``hpcring report`` splits a rank's time with them
(:mod:`hpcring.diagnostics.rank_summary`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from pathlib import Path

from hpcring import _native
from hpcring.fsutil import write_json
from hpcring.config.envvars import get

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../hpcring
_SKIP = (_PKG_DIR, os.path.dirname(threading.__file__) + os.sep + "threading.py",
         "<frozen runpy>", os.path.dirname(os.__file__) + os.sep + "runpy.py")


def _torch_dir() -> tuple[str, ...]:
    """torch's package folder (found without importing torch): a call made through
    torch.distributed is recorded at the user's line, not inside torch's wrappers."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return ()
    return tuple(spec.submodule_search_locations or ()) if spec else ()


_SKIP = _SKIP + _torch_dir()

QUEUED, STARTED, DONE, FAILED = "queued", "started", "done", "failed"


def default_capacity() -> int:
    return get("HPCRING_FLIGHT_RECORDS")


def _outside(filename: str) -> bool:
    return not filename.startswith(_SKIP)


def _caller(depth: int):
    """(filename, line, function) of the innermost frame outside hpcring, or None (hot path:
    no string formatting here, see :func:`call_site`)."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return None
    while f is not None:
        code = f.f_code
        if not code.co_filename.startswith(_SKIP):
            return code.co_filename, f.f_lineno, code.co_name
        f = f.f_back
    return None


def _format_site(where) -> str:
    return "?" if where is None else f"{os.path.basename(where[0])}:{where[1]} in {where[2]}"


def call_site(depth: int = 2) -> str:
    """``file:line in function`` of the innermost caller outside the hpcring package (and the
    threading/runpy machinery); "?" when there is none. ``depth`` frames are skipped first."""
    return _format_site(_caller(depth + 1))


def locate(frame) -> str:
    """Where a thread is, for hang reports: ``in allreduce at train.py:88 (train_step)`` when it
    is inside an hpcring call, else ``in load_batch at data.py:12``; "?" without user frames."""
    api = None
    f = frame
    while f is not None and not _outside(f.f_code.co_filename):
        if f.f_code.co_filename.startswith(_PKG_DIR) and not f.f_code.co_name.startswith("_"):
            api = f.f_code.co_name                    # outermost public hpcring function wins
        f = f.f_back
    while f is not None and not _outside(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "?" if api is None else f"in {api}"
    at = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
    if api is None or frame is f:
        return f"in {f.f_code.co_name} at {at}"
    return f"in {api} at {at} ({f.f_code.co_name})"


def main_thread_location() -> str:
    """:func:`locate` for the main thread (callable from any thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "?" if frame is None else locate(frame)


class Record:
    """One collective as this rank saw it (JSON-serialisable via :meth:`to_dict`). A plain
    slotted class: one is made per collective, so construction must cost well under a microsecond."""

    __slots__ = ("seq", "op", "dtype", "count", "root", "backend", "timeout", "_site", "state", "t_queued",
                 "t_started", "t_ended", "error", "group", "flight")
    FIELDS = ("seq", "op", "dtype", "count", "root", "backend", "timeout", "site", "state", "t_queued",
              "t_started", "t_ended", "error")

    def __init__(self, seq: int, op: str, dtype: str | None, count: int, root: int | None, backend: str,
                 timeout: float, site, state: str = QUEUED) -> None:
        self.seq, self.op, self.dtype, self.count, self.root = seq, op, dtype, count, root
        self.backend, self.timeout, self._site, self.state = backend, timeout, site, state
        self.t_queued = now = time.time()
        self.t_started = now if state == STARTED else None      # begun at once (FlightRecorder.begin)
        self.t_ended = self.error = None
        self.group = None             # a group's (recorder's) name and members; None: the job's
        self.flight = None            # the Flight ring whose slot this copies (FlightRecorder.record_of)

    @property
    def site(self) -> str:
        """``file:line in function`` of the call (formatted on demand: the hot path keeps a tuple)."""
        return self._site if isinstance(self._site, str) else _format_site(self._site)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.FIELDS}
        if self.group is not None:    # (name, members): reports diagnose it among its members
            d["group"], d["members"] = self.group[0], list(self.group[1])
        return d

    def __repr__(self) -> str:
        return f"Record({self.op}#{self.seq} {self.dtype} count={self.count} {self.state})"


class Totals:
    """Sums over ended records (:meth:`FlightRecorder.totals`; the C ring's ``Flight.totals()``
    keeps the same fields): times relative to ``base``, the first one's start."""

    __slots__ = ("done", "failed", "base", "first_started", "last_ended", "sum_started", "sum_inside",
                 "sum_failed")
    FIELDS = __slots__

    def __init__(self, d: dict | None = None) -> None:
        for k in self.FIELDS:
            setattr(self, k, (d or {}).get(k, 0))

    def add(self, rec: Record) -> None:
        """Count ``rec`` if it ended (a record dropped before it ended is not counted)."""
        if rec.t_ended is None or rec.t_started is None or rec.state not in (DONE, FAILED):
            return
        started, ended = rec.t_started, rec.t_ended
        if self.done + self.failed == 0:
            self.base = self.first_started = started
            self.last_ended = ended
        self.first_started = min(self.first_started, started)
        self.last_ended = max(self.last_ended, ended)
        if rec.state == FAILED:
            self.failed += 1
            self.sum_failed += ended - started
        else:
            self.done += 1
            self.sum_started += started - self.base
            self.sum_inside += ended - started

    def merged(self, other: "Totals") -> "Totals":
        """Both sets of records in one (sums moved to the earlier base)."""
        if other.done + other.failed == 0:
            return Totals(self.to_dict())
        if self.done + self.failed == 0:
            return Totals(other.to_dict())
        out = Totals()
        out.base = min(self.base, other.base)
        out.done, out.failed = self.done + other.done, self.failed + other.failed
        out.first_started = min(self.first_started, other.first_started)
        out.last_ended = max(self.last_ended, other.last_ended)
        out.sum_started = (self.sum_started + self.done * (self.base - out.base)
                           + other.sum_started + other.done * (other.base - out.base))
        out.sum_inside = self.sum_inside + other.sum_inside
        out.sum_failed = self.sum_failed + other.sum_failed
        return out

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}


class FlightRecorder:
    """Bounded, thread-safe history of one communicator's collectives."""

    def __init__(self, rank: int, size: int, backend: str, capacity: int | None = None, *,
                 group: str | None = None, members=None) -> None:
        """``group`` / ``members``: a sub-communicator's name and global ranks (``rank`` and
        ``size`` are then the group's); its records carry both."""
        self.rank, self.size, self.backend = rank, size, backend
        self.group = None if group is None else (group, tuple(members or ()))
        self.capacity = capacity or default_capacity()
        self._records: deque[Record] = deque(maxlen=self.capacity)
        self._dropped = Totals()      # Python records the deque has dropped (totals())
        self._lock = threading.Lock()
        # the short paths' records, and the one sequence counter (module docstring)
        self.flight = _native.Flight(self.capacity, _SKIP)

    def queue(self, op: str, dtype: str | None, count: int, root: int | None, timeout: float,
              site: str | None = None) -> Record:
        """Record a new collective (state ``queued``) and give it the next sequence number."""
        with self._lock:
            rec = Record(self.flight.take(), op, dtype, count, root, self.backend, timeout,
                         site if site is not None else _caller(2))
            if self.group is not None:
                rec.group = self.group
            if len(self._records) == self.capacity:       # the oldest goes: its time still counts
                self._dropped.add(self._records[0])
            self._records.append(rec)
        return rec

    def begin(self, op: str, dtype: str | None, count: int, root: int | None, timeout: float) -> Record:
        """:meth:`queue` and :meth:`start` in one step, for a call that starts at once (the short
        paths): the same record, queued and started at the same instant. The call site is looked
        for from two frames up (the public method that called the short path) outwards."""
        with self._lock:
            rec = Record(self.flight.take(), op, dtype, count, root, self.backend, timeout, _caller(3), STARTED)
            if self.group is not None:
                rec.group = self.group
            if len(self._records) == self.capacity:       # the oldest goes: its time still counts
                self._dropped.add(self._records[0])
            self._records.append(rec)
        return rec

    @staticmethod
    def start(rec: Record) -> None:
        rec.t_started = time.time()
        rec.state = STARTED

    @staticmethod
    def finish(rec: Record, error: BaseException | str | None = None) -> None:
        rec.t_ended = time.time()
        if error is None:
            rec.state = DONE
        else:
            rec.state = FAILED
            rec.error = str(error)
        if rec.flight is not None:    # a copy of a ring slot: the slot is the record
            rec.flight.end(rec.seq, rec.error)

    @property
    def seq(self) -> int:
        """Sequence number of the newest record (0 before the first collective)."""
        return self.flight.seq

    def _from_slot(self, t: tuple) -> Record:
        seq, op, dtype, count, root, timeout, state, t_queued, t_started, t_ended, site, error = t
        rec = Record(seq, op, dtype, count, root, self.backend, timeout, site, state)
        rec.t_queued, rec.t_started, rec.t_ended, rec.error = t_queued, t_started, t_ended, error
        rec.group = self.group
        return rec

    def record_of(self, seq: int) -> Record | None:
        """The Record of ring slot ``seq`` (None once overwritten): a copy whose :meth:`finish`
        writes through to the slot (the failure path of a short-path call)."""
        t = self.flight.get(seq)
        if t is None:
            return None
        rec = self._from_slot(t)
        rec.flight = self.flight
        return rec

    def records(self, last: int | None = None) -> list[Record]:
        """The newest ``last`` records (all kept: up to the capacity), oldest first, from both stores."""
        with self._lock:
            recs = list(self._records)
            slots = self.flight.snapshot()
        if slots:
            recs = sorted(recs + [self._from_slot(t) for t in slots], key=lambda r: r.seq)[-self.capacity:]
        return recs if last is None else recs[-last:]

    def span(self, first: int, count: int) -> list[Record]:
        """The kept records of collectives ``first .. first+count-1``, any order: the straggler
        watcher's window, without turning every kept ring slot into a Record."""
        with self._lock:
            recs = [r for r in self._records if first <= r.seq < first + count]
        have = {r.seq for r in recs}
        for s in range(first, first + count):
            if s not in have:
                t = self.flight.get(s)
                if t is not None:
                    recs.append(self._from_slot(t))
        return recs

    def in_flight(self) -> list[Record]:
        """Records queued or started and not ended, oldest first."""
        return [r for r in self.records() if r.state in (QUEUED, STARTED)]

    def last_done(self) -> int:
        """Highest sequence number completed successfully (0 if none)."""
        done = [r.seq for r in self.records() if r.state == DONE]
        return max(done, default=0)

    def totals(self) -> Totals:
        """Every collective ended since the start, the ones no longer kept included (module doc)."""
        with self._lock:
            kept = Totals(self._dropped.to_dict())
            for rec in self._records:
                kept.add(rec)
            ring = Totals(self.flight.totals())
        return ring.merged(kept)

    def summary(self, last: int = 8) -> dict:
        """What the watchdog exchanges: the newest records plus the counters."""
        return {"rank": self.rank, "backend": self.backend, "seq": self.seq, "last_done": self.last_done(),
                "records": [r.to_dict() for r in self.records(last)]}

    def dump(self, path: str | os.PathLike, extra: dict | None = None) -> Path:
        """Write every record (oldest first) as JSON to ``path`` (atomically) and return it."""
        path = Path(path)
        data = {"rank": self.rank, "size": self.size, "backend": self.backend, "pid": os.getpid(),
                **({"group": self.group[0], "members": list(self.group[1])} if self.group else {}),
                "host": os.uname().nodename, "dumped": time.time(), **(extra or {}),
                "records": [r.to_dict() for r in self.records()]}
        write_json(path, data, indent=1)
        return path
