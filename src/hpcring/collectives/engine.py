"""The async engine under the Communicator: :class:`Handle` (a pending result with
done-callbacks), :class:`Worker` (one thread per communicator running host-backend operations in
submission order) and :class:`Completions` (device collectives in flight on a stream-ordered
backend, completed from their CUDA events by a poller that keeps every deadline)."""
from __future__ import annotations

import logging
import queue
from collections import deque
import threading
import time
from typing import Any, Callable

from hpcring.collectives.recorder import FlightRecorder, Record
from hpcring.errors import CollectiveError

class Handle:
    """The pending result of an ``*_async`` call.

    ``add_done_callback(fn)`` chains work on completion (``fn(handle)`` runs once, in the thread
    that completes the operation, or at once when it is already done), so a caller such as the
    torch ProcessGroup can complete a future without a thread of its own waiting."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], Any]] | None = []
        self._cb_lock = threading.Lock()
        self.cuda_event = None          # device collectives: the CUDA event that marks completion

    def _set(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._cb_lock:
            callbacks, self._callbacks = self._callbacks, None
            self._event.set()
        for fn in callbacks or ():
            self._call(fn)

    def _call(self, fn) -> None:
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - a callback's bug must not kill the worker thread
            logging.getLogger("hpcring.collectives").exception("done-callback of %s raised", self.name)

    def add_done_callback(self, fn: Callable[["Handle"], Any]) -> None:
        """Call ``fn(self)`` once the operation finished (successfully or not); at once if it
        already has. Exceptions raised by ``fn`` are logged, not propagated."""
        with self._cb_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def result(self):
        """The result of a finished operation (raises its error); for a pending one, waits."""
        return self.wait()

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None):
        """Block until the operation finished and return its result (or raise its error).
        ``timeout`` (seconds) bounds the wait itself: CollectiveError if still running."""
        if not self._event.wait(timeout):
            raise CollectiveError(f"{self.name} did not finish within {timeout:.1f} s (still running)",
                                  hint="the operation keeps its own deadline; wait again or raise it")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        """The error of a finished operation, or None."""
        return self._error if self._event.is_set() else None


class Worker:
    """One thread per communicator executing submitted operations in order."""

    def __init__(self, name: str) -> None:
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, name: str, fn: Callable[[], Any]) -> Handle:
        h = Handle(name)
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._q.put((h, fn))
        return h

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            h, fn = item
            try:
                h._set(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                h._set(error=e)
            finally:
                with self._lock:
                    self._pending -= 1

    def stop(self) -> None:
        with self._lock:
            t = self._thread
            self._thread = None
        if t is not None:
            self._q.put(None)
            t.join(timeout=5.0)


class Completions:
    """Device collectives in flight on a stream-ordered backend.

    One thread per communicator polls their completion events, completes each flight record and
    handle, and enforces each deadline and NCCL's async error through ``backend.poll`` -- NCCL
    itself has no timeout. On a failure the communicator is aborted by the backend, the watchdog
    makes the job-wide report (and normally ends the process), and every outstanding handle gets
    the error.

    Ops on one stream complete in order, so they wait in one FIFO per stream and a round asks
    only each stream's oldest op (one event query per stream, not per op: a burst of 100 small
    ops in flight costs the same round as one). Ops behind a running one can only expire; they
    are checked against their own deadlines every DEADLINE_SCAN seconds (deadlines are seconds
    long). Polls every 0.2 ms growing to 2 ms while ops someone may wait for are outstanding (a
    handle, or a ``drain``/``synchronize`` in progress: a completion is noticed late by at most
    that), every 2 ms while only synchronous ops are (nobody waits on them: callers consume
    their results on the stream; polling them sooner only takes the GIL from the caller that is
    enqueueing the next ones), and sleeps on a condition when nothing is. A completed op with no
    handle gives its event back to the backend (``backend.recycle``) for a later op to record
    again. When the queue empties the poller lingers LINGER seconds polling at 2 ms before it
    sleeps: a stream of small ops that each finish before the next is enqueued would otherwise
    wake it once per op (a GIL hand-over each)."""

    POLL_MIN, POLL_MAX = 2e-4, 2e-3
    DEADLINE_SCAN = 0.05
    LINGER = 0.05

    def __init__(self, comm) -> None:
        self._comm = comm
        self._queues: dict[Any, deque] = {}     # stream pointer (None: unordered) -> FIFO of items
        self._count = 0
        self._held = 0                          # outstanding items with a handle
        self._draining = 0                      # drain() calls waiting
        self._sleeping = False                  # the poller waits for a notify (not lingering)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = threading.Event()
        self._idle.set()

    @property
    def _items(self) -> list:
        """Every outstanding item (a snapshot; for stop and failure paths)."""
        with self._cv:
            return [it for q in self._queues.values() for it in q]

    def _record(self, item: tuple) -> Record:
        """An item's Record: itself, or for a ring slot's sequence number a copy that writes
        through to the slot (recorded again, from what its pending op says, if the ring has
        overwritten it since)."""
        rec, pending = item[0], item[1]
        if type(rec) is not int:
            return rec
        recorder = self._comm.recorder
        return recorder.record_of(rec) or recorder.queue(pending.name, None, 0, None, pending.timeout)

    def add(self, rec: Record | int, pending, handle: Handle | None, result) -> None:
        """Watch ``pending`` (the backend's event); ``rec``: its Record, or the sequence number of
        its slot in the recorder's C ring (recorder.py)."""
        stream = getattr(pending, "stream", None)
        with self._cv:
            q = self._queues.get(stream)
            if q is None:
                q = self._queues[stream] = deque()
            q.append((rec, pending, handle, result))
            self._count += 1
            if handle is not None:
                self._held += 1
                if self._held == 1:
                    self._cv.notify()   # the poller may be in a lazy wait: someone waits now
            if self._idle.is_set():     # set only under self._cv (the poller, _fail): no race
                self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"hpcring-cuda-poll:{self._comm.rank}",
                                                daemon=True)
                self._thread.start()
            if self._sleeping:          # lingering, it finds the op on its next round
                self._cv.notify()

    def _loop(self) -> None:
        backend = self._comm.backend
        flight = self._comm.recorder.flight
        recycle = getattr(backend, "recycle", None)
        delay = self.POLL_MIN
        next_scan = time.monotonic() + self.DEADLINE_SCAN
        while True:
            with self._cv:
                if not self._count:
                    self._idle.set()
                    # linger a while before sleeping: back-to-back small ops empty the queue
                    # between two calls, and a notify per op would wake this thread per op
                    quiet = time.monotonic() + self.LINGER
                    while not self._count and not self._stopping and time.monotonic() < quiet:
                        self._cv.wait(self.POLL_MAX)
                    self._sleeping = True
                    while not self._count and not self._stopping:
                        self._cv.wait()
                    self._sleeping = False
                if not self._count:
                    return
                queues = list(self._queues.items())
            now = time.monotonic()
            scan = now >= next_scan
            if scan:
                next_scan = now + self.DEADLINE_SCAN
            finished = held = 0
            for stream, q in queues:
                i = 0
                while i < len(q):           # only this thread removes items: q[i] is stable
                    item = q[i]
                    rec, pending, handle, result = item
                    try:
                        done = backend.poll(pending, now) if (i == 0 or stream is None) else (
                            now >= pending.deadline and backend.poll(pending, now))
                    except BaseException as e:  # noqa: BLE001 - CollectiveError: deadline / async error
                        self._fail(item, e)
                        return
                    if done and (i == 0 or stream is None):
                        del q[i]            # the head (or an unordered op): deque ends are O(1)
                        if type(rec) is int:    # a slot of the recorder's C ring (the short path)
                            flight.end(rec)
                        else:
                            FlightRecorder.finish(rec)
                        if handle is not None:
                            handle._set(result)
                            held += 1
                        elif recycle is not None:
                            recycle(pending)
                        finished += 1
                        continue
                    if stream is not None and not scan:
                        break               # behind a running op on its stream: only deadlines
                    i += 1
            with self._cv:
                self._count -= finished
                self._held -= held
                eager = self._held or self._draining
                delay = self.POLL_MAX if not eager else self.POLL_MIN if finished else min(delay * 2, self.POLL_MAX)
                if self._count:
                    self._cv.wait(delay)    # drain() and a first handle cut it short

    def _fail(self, item, e: BaseException) -> None:
        with self._cv:
            items = [it for q in self._queues.values() for it in q]
            self._queues, self._count, self._held = {}, 0, 0
        err = self._comm._failed(self._record(item), e)   # may end the process (watchdog abort mode)
        for it in items:
            rec, _, handle, _ = it
            if rec is not item[0]:
                FlightRecorder.finish(self._record(it), err)
            if handle is not None:
                handle._set(error=err)
        with self._cv:
            self._thread = None
            self._idle.set()

    def drain(self, timeout: float | None = None) -> None:
        """Block until nothing is outstanding (each item keeps its own deadline; ``timeout``
        bounds this wait too)."""
        if self._idle.is_set():
            return
        with self._cv:
            self._draining += 1
            self._cv.notify_all()       # the poller goes eager at once
        try:
            idle = self._idle.wait(timeout)
        finally:
            with self._cv:
                self._draining -= 1
        if not idle:
            raise CollectiveError(f"device collectives still in flight after {timeout:g} s",
                                  hint="each keeps its own deadline; wait again or raise it")

    def stop(self) -> None:
        try:
            self.drain(max((it[1].deadline for it in list(self._items)), default=0) - time.monotonic() + 1.0)
        except CollectiveError:
            pass
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
