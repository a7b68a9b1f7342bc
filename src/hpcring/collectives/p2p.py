"""Point-to-point requests: what every backend's send/recv returns, their deadlines and records.

A :class:`Request` is a :class:`~hpcring.collectives.engine.Handle` (``wait``, ``done``,
``add_done_callback``; a receive's result is the source rank) that completes exactly once: the
transport completes it, or its deadline fails it (the ring's native queue keeps its own deadlines,
MPI's requests use :data:`KEEPER`; nobody has to be waiting: a torch Work's future learns of the
failure on time).

Records: a message is recorded on both ends under one *channel*, ``rank S -> rank D, tag T``
(global ranks), numbered by the channel's own count, so the n-th send on a channel and the n-th
receive on it carry the same sequence number, and the watchdog's diagnosis of a failed receive
compares exactly the two ranks of the pair (a group of two, see hpcring.collectives.groups):
"p2p#3 (rank 2 -> rank 3, tag 7): rank 2 (node1) never joined: ..., now in allreduce at
train.py:88". The records do not touch the communicator's collective sequence numbers (the
ranks of a pipeline send different numbers of messages).
"""
from __future__ import annotations

import heapq
import threading
import time
from collections import deque

from hpcring.collectives.engine import Handle
from hpcring.collectives.recorder import DONE, STARTED, FlightRecorder, Record, _caller
from hpcring.errors import CollectiveError, UsageError

SEND, RECV = "send", "recv"
MAX_TAG = 2**31 - 1        # int32: what torch's backends and MPI (at least up to MPI_TAG_UB) agree on


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes} B"


def check_peer(peer, rank: int, size: int, what: str, *, any_ok: bool = False) -> int | None:
    """The peer as an int, or None (any source, receives only); UsageError before anything moves."""
    if peer is None and any_ok:
        return None
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise UsageError(f"{what}: the peer rank must be an integer, got {peer!r}")
    if not 0 <= peer < size:
        raise UsageError(f"{what}: peer rank {peer} is outside ranks 0-{size - 1}")
    if peer == rank:
        raise UsageError(f"{what}: rank {rank} cannot send to or receive from itself",
                         hint="copy the tensor locally instead")
    return peer


def check_tag(tag, what: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise UsageError(f"{what}: tag must be an integer 0..{MAX_TAG}, got {tag!r}")
    return tag


def failure(rank: int, hosts, kind: str, peer: int | None, tag: int, nbytes: int, why: str,
            hint: str | None = None) -> CollectiveError:
    """``rank 3 (node2) waited for recv from rank 2 (node1), tag 7, 4 MiB: <why>``: one wording
    for a :class:`Request` and the Communicator's short path (which makes no Request)."""
    def host(r):
        return "?" if r is None or r >= len(hosts) else hosts[r]
    who = "any rank" if peer is None else f"rank {peer} ({host(peer)})"
    return CollectiveError(f"rank {rank} ({host(rank)}) waited for {kind} {'to' if kind == SEND else 'from'} "
                           f"{who}, tag {tag}, {size_text(nbytes)}: {why}", hint=hint)


class Request(Handle):
    """One send or receive in flight. ``buf``: the bytes (a 1-D uint8 numpy view); ``peer``: the
    other rank (communicator-local; None: a receive from any rank); ``source``: the rank a
    receive matched. ``state``: posted -> active (bytes moving) -> done."""

    def __init__(self, kind: str, buf, peer: int | None, tag: int, timeout: float, *, rank: int,
                 hosts, record: Record | None = None) -> None:
        super().__init__(f"{kind} {'to' if kind == SEND else 'from'} "
                         f"{'any rank' if peer is None else f'rank {peer}'} (tag {tag})")
        self.kind, self.buf, self.peer, self.tag = kind, buf, peer, tag
        self.nbytes = buf.nbytes
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.rank, self.hosts = rank, hosts
        self.record = record
        self.state = "posted"
        self.source: int | None = None
        self._once = threading.Lock()
        self._finished = False

    def _host(self, r: int | None) -> str:
        return "?" if r is None or r >= len(self.hosts) else self.hosts[r]

    def describe(self) -> str:
        """``recv from rank 2 (node1), tag 7, 4 MiB``"""
        who = "any rank" if self.peer is None else f"rank {self.peer} ({self._host(self.peer)})"
        return f"{self.kind} {'to' if self.kind == SEND else 'from'} {who}, tag {self.tag}, {size_text(self.nbytes)}"

    def complete(self, source: int | None = None, error: BaseException | None = None) -> bool:
        """Finish the request (the first call wins; later ones return False)."""
        with self._once:
            if self._finished:
                return False
            self._finished = True
        self.state = "done"
        if error is None:
            self.source = source if source is not None else self.peer
            if self.record is not None:
                FlightRecorder.finish(self.record)
            self._set(self.source)
        else:
            if self.record is not None:
                FlightRecorder.finish(self.record, error)
            self._set(error=error)
        return True

    def fail(self, why: str, hint: str | None = None) -> bool:
        """Fail with ``rank 3 (node2) waited for recv from rank 2 (node1), tag 7, 4 MiB: <why>``."""
        return self.complete(error=failure(self.rank, self.hosts, self.kind, self.peer, self.tag, self.nbytes,
                                           why, hint))

    @property
    def finished(self) -> bool:
        return self._finished

    def drive(self, timeout: float | None = None) -> None:
        """Help the request along in the waiting thread (a transport that can wait in C
        overrides this: hpcring.collectives.mailbox); the base one leaves it to the transport."""


SHORT_CLAIM = threading.Lock()   # who finishes a ShortHandle (held for a few assignments only)


class ShortHandle(Handle):
    """What the transports' short messages share (the ring's mailbox.ShortMessage, MPI's
    mpi_p2p.MpiShortMessage): a Handle built without Handle.__init__, so a message nobody watches
    costs no event, lock or list; finished once (``_state`` 0 pending, 1 being finished, 2
    finished) under one process-wide lock held for a few assignments. A subclass's ``__init__``
    sets kind, peer, tag, ``_state = 0`` and ``_result = _error = _event = _callbacks = None``."""

    short = True
    cuda_event = None

    @property
    def name(self) -> str:
        return f"{self.kind} {'to' if self.kind == SEND else 'from'} rank {self.peer} (tag {self.tag})"

    def _claim(self) -> bool:
        """True for the one caller that finishes the message."""
        with SHORT_CLAIM:
            if self._state:
                return False
            self._state = 1
            return True

    def _set(self, result=None, error: BaseException | None = None) -> None:
        with SHORT_CLAIM:
            self._result, self._error, self._state = result, error, 2
            callbacks, self._callbacks = self._callbacks, None
            ev = self._event
        if ev is not None:
            ev.set()
        if callbacks is not None:
            self._watchers_done()
            for fn in callbacks:
                self._call(fn)

    def _watchers_done(self) -> None:
        """Hook: the message had callbacks, all about to run (the mailbox forgets it)."""

    def _wait_finished(self, limit: float, timeout: float | None) -> None:
        """Wait up to ``limit`` s for another thread to finish it; CollectiveError naming the
        caller's ``timeout`` if it does not."""
        if self._state == 2:
            return
        with SHORT_CLAIM:
            if self._state != 2 and self._event is None:
                self._event = threading.Event()
            ev = self._event
        if self._state != 2 and not ev.wait(limit):
            raise CollectiveError(f"{self.name} did not finish within {timeout or 0:.1f} s (still running)",
                                  hint="the operation keeps its own deadline; wait again or raise it")

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None


class Keeper:
    """One thread for the whole process: fails each request whose deadline passed (through
    ``on_expire(request)`` of its transport, which words the error), at the deadline itself."""

    def __init__(self) -> None:
        self._heap: list = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._n = 0

    def watch(self, req: Request, on_expire) -> None:
        with self._cv:
            self._n += 1
            heapq.heappush(self._heap, (req.deadline, self._n, req, on_expire))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hpcring-p2p-deadlines", daemon=True)
                self._thread.start()
            # it sleeps until the earliest deadline: wake it only for an earlier one, and every
            # 256th request so that finished ones leave the heap (a wake-up per message took the
            # GIL from the thread waiting on it)
            if self._heap[0][2] is req or self._n % 256 == 0:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._heap and self._heap[0][2].finished:
                    heapq.heappop(self._heap)
                wait = (self._heap[0][0] - time.monotonic()) if self._heap else 60.0
                if wait > 0:
                    self._cv.wait(min(wait, 60.0))
                    continue
                _, _, req, on_expire = heapq.heappop(self._heap)
            if not req.finished:
                try:
                    on_expire(req)
                except Exception as e:  # noqa: BLE001 - the request must end whatever happens
                    req.fail(f"deadline passed ({e})")
                req.fail(f"no completion within the {req.timeout:g} s deadline")


KEEPER = Keeper()


class P2PLog:
    """A communicator's point-to-point records, by channel (see the module docstring). ``members``
    maps the communicator's ranks to global ranks (None: they are global)."""

    def __init__(self, rank: int, backend: str, members=None, capacity: int = 256) -> None:
        self.rank, self.backend = rank, backend
        self.members = tuple(members) if members is not None else None
        self._counts: dict[tuple[int, int, int], int] = {}
        self._done: dict[str, int] = {}
        self._records: deque[Record] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._channels: dict[tuple, tuple] = {}

    def _g(self, r: int) -> int:
        return r if self.members is None else self.members[r]

    def queue(self, kind: str, peer: int | None, tag: int, dtype: str | None, count: int, timeout: float,
              depth: int = 3) -> Record:
        ch = self._channels.get((kind, peer, tag))
        if ch is None:
            ch = self._channel(kind, peer, tag)
        site = _caller(depth)
        with self._lock:
            n = self._counts[ch[0]] = self._counts.get(ch[0], 0) + 1
            rec = Record(n, "p2p", dtype, count, None, self.backend, timeout, site, STARTED)
            rec.group = ch[1]
            self._records.append(rec)
        return rec

    def _channel(self, kind: str, peer: int | None, tag: int) -> tuple:
        """(count key, record group) of a channel, formatted once per channel, not per message."""
        me = self._g(self.rank)
        other = None if peer is None else self._g(peer)
        src, dst = (me, other) if kind == SEND else (other, me)
        name = f"rank {'any' if src is None else src} -> rank {dst}, tag {tag}"
        ch = ((-1 if src is None else src, dst, tag), (name, (me,) if other is None else tuple(sorted((src, dst)))))
        if len(self._channels) >= 4096:     # tags are free-form: keep the cache bounded
            self._channels.clear()
        self._channels[(kind, peer, tag)] = ch
        return ch

    def records(self, last: int | None = None) -> list[Record]:
        with self._lock:
            recs = list(self._records)
        return recs if last is None else recs[-last:]

    def last_done(self) -> dict[str, int]:
        """Highest completed sequence number per channel name (for the watchdog's snapshot)."""
        out: dict[str, int] = {}
        for r in self.records():
            if r.state == DONE:
                out[r.group[0]] = max(out.get(r.group[0], 0), r.seq)
        return out
