"""The background engine of one process set: queue, cycles, execution, timeline.

Horovod's model: each rank submits named operations in any order; an operation runs once every
rank of its process set has submitted it. One engine (one thread) per process set does, in cycles:

1. wait until a cycle should start (:meth:`Engine._wait_for_cycle`): every gradient an optimizer
   expects this step is queued (:meth:`Engine.expect`), or the queued bytes fill the fusion
   buffer, or ``cycle_time`` has passed (unset: host gradients of an optimizer wait for the first
   two, everything else 1 ms), so that gradients fuse;
2. negotiate (:mod:`hpcring.torch.controller`, with the response cache): the ready operations, in
   one order on every rank, and the ones that failed (mismatch, join, stall) on every rank alike;
3. run the ready ones (:mod:`hpcring.torch.fusion`, :mod:`hpcring.torch.executor`).

Failures: an operation that fails (differs across ranks, stalls, cannot run with a joined rank,
a bad argument found on the engine thread) fails its own handle on every rank; the engine goes
on. A failure of the communicator itself (a dead or frozen peer, a missed deadline: the
communicator stays failed) is unrecoverable: every pending handle fails with it, later
submissions raise it, and the watchdog's report names the rank. Every wait is bounded
(:meth:`Engine.check_alive`).
"""
from __future__ import annotations

import threading
import time

from hpcring.errors import CollectiveError, HpcringError
from hpcring.torch import executor, fusion
from hpcring.torch.controller import Controller
from hpcring.torch.entry import FUSABLE, AsyncHandle, Entry, StandIn, h63
from hpcring.torch.exceptions import (HorovodInternalError, InvalidArgumentError, JoinedRankError, StallError,
                                      internal)
from hpcring.config import envvars

DEFAULT_THRESHOLD = 128 * 1024 * 1024      # Horovod's default since 0.21
HOROVOD_CYCLE_MS = 1.0                     # Horovod's default since 0.21
AUTO_CYCLE_MS = -1.0                       # HPCRING_CYCLE_TIME unset: see Engine._wait_for_cycle
DEFAULT_CYCLE_MS = AUTO_CYCLE_MS
DEFAULT_CACHE_CAPACITY = 1024              # Horovod's HOROVOD_CACHE_CAPACITY default
HELD_MAX_S = 1.0      # auto: the longest held gradients wait (a backstop; the step's end comes first)
PROGRESS_GRACE_S = 30.0  # a wait fails when the engine made no progress for timeout + this


class Engine:
    """The engine of one process set (created by :func:`hpcring.torch.init` / add_process_set)."""

    def __init__(self, comm, *, local_rank: int = 0, timeline=None, pset_id: int = 0, members=None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.pset_id = pset_id
        self.threshold = int(envvars.get("HPCRING_FUSION_THRESHOLD", default=DEFAULT_THRESHOLD))
        self.cycle_s = envvars.get("HPCRING_CYCLE_TIME", default=DEFAULT_CYCLE_MS) / 1000.0   # < 0: auto
        cache = envvars.get("HPCRING_CACHE_CAPACITY", default=DEFAULT_CACHE_CAPACITY)
        self.timeout = comm.timeout
        self.backend = comm.backend_name
        self.timeline = timeline
        self.autotuner = None
        self.controller = Controller(comm, cache_capacity=int(cache), timeout=self.timeout, members=members)
        self._buffers = fusion.FusionBuffers()
        self._cv = threading.Condition()
        self._pending: list[Entry] = []
        self._names: dict[str, Entry] = {}
        self._due: dict[int, set[str]] = {}       # expect(): owner -> names it has still to submit
        self._flush = False                     # an owner's expected names are all queued: go now
        self._pending_bytes = 0                 # fusable bytes queued (the buffer-full trigger)
        self._held = 0                          # pending host gradients an optimizer expects (auto cycle)
        self._cycle_t0 = 0.0                    # when the last cycle started
        self._progress = time.monotonic()       # last sign of life of the engine thread
        self._error: BaseException | None = None
        self._stop = False
        self._join_handle: AsyncHandle | None = None
        self._joined_cycle = 0
        self._cycle = 0
        self._auto: dict[str, int] = {}          # kind -> automatic names given on this set
        self.stats = {"cycles": 0, "negotiate_s": 0.0, "collectives": 0, "fused_tensors": 0, "cache_hits": 0,
                      "full_negotiations": 0, "pack_s": 0.0, "backend_s": 0.0, "unpack_s": 0.0}
        self._thread = threading.Thread(target=self._loop, name=f"hpcring-torch:{pset_id}:{self.rank}", daemon=True)
        self._thread.start()

    # -- submission (any thread) ------------------------------------------------------------
    def submit(self, e: Entry) -> AsyncHandle:
        e.handle._engine = self
        e.pset = self.pset_id
        with self._cv:
            self._check_usable()
            if e.name is None:
                name, e.auto = self.take_auto(e.kind)
                e.set_name(name)
            if e.name in self._names:
                raise InvalidArgumentError(
                    f"hpcring.torch: an operation named '{e.name}' is already in flight on rank {self.rank}",
                    hint="names must be unique among pending operations; synchronize the first one")
            self._names[e.name] = e
            # wake the engine only when this entry changes when its cycle starts: it was idle or
            # holding gradients only (auto), or this completes an expected set or fills the buffer
            idle, all_held = not self._pending, self._held == len(self._pending)
            self._pending.append(e)
            wake = idle
            if e.kind in FUSABLE:
                self._pending_bytes += e.nbytes
                wake = wake or 0 < self.threshold <= self._pending_bytes
            for owner, due in self._due.items():
                if e.name in due:
                    due.discard(e.name)
                    e.held = e.stream is None
                    self._held += e.held
                    if not due:
                        del self._due[owner]
                        self._flush = wake = True
                    break
            wake = wake or (all_held and not e.held)
            if wake:
                self._cv.notify()
        return e.handle

    def _auto_text(self, kind: str, n: int) -> str:
        return f"{kind}.noname.{n}" if self.pset_id == 0 else f"{kind}.noname.ps{self.pset_id}.{n}"

    def take_auto(self, kind: str) -> tuple[str, tuple[str, int]]:
        """The next automatic name of ``kind`` on this set, ``<kind>.noname.<n>``, and its mark
        ``(kind, n)`` for the entries that carry it.

        Every rank of the set must count the same names, so a name is taken only by what every
        rank also counts: counted per kind; not by an operation refused before it reached the
        engine (bad arguments, a failed engine: a rank-local error); given back when the operation
        fails because some rank never submitted it (refused while a rank has joined, or stalled:
        :meth:`_give_back`), and taken by a joined rank for the automatic allreduces it stands in
        for (:meth:`_stand_in`). One that every rank submitted and that fails for all (a mismatch)
        keeps its name everywhere, as in Horovod."""
        with self._cv:
            n = self._auto.get(kind, 0)
            self._auto[kind] = n + 1
        return self._auto_text(kind, n), (kind, n)

    def _give_back(self, mark) -> None:
        """Un-take a refused operation's automatic name, if no later one of its kind was taken
        (an async call queued behind it keeps its name; the counters then differ, and the next
        unmatched name is reported as a stall)."""
        kind, n = mark
        with self._cv:
            if self._auto.get(kind) == n + 1:
                self._auto[kind] = n

    def _stand_in(self, name_hash: int) -> None:
        """A joined rank contributes to an allreduce: if it carries this rank's next automatic
        allreduce name (or a grouped one's first member), count that name here too."""
        for kind, suffix in (("allreduce", ""), ("grouped_allreduce", ".0")):
            n = self._auto.get(kind, 0)
            if name_hash == h63(self._auto_text(kind, n) + suffix):
                with self._cv:
                    self._auto[kind] = n + 1
                return

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stop:
            raise HorovodInternalError("hpcring.torch is shut down", hint="call hvd.init() again")

    def join(self) -> AsyncHandle:
        with self._cv:
            self._check_usable()
            if self._join_handle is None:
                self._join_handle = AsyncHandle("join", engine=self)
                self._cv.notify()
            return self._join_handle

    def check_alive(self, handle: AsyncHandle) -> None:
        """Raise (for ``handle``'s waiter) when the engine cannot finish it: it failed, stopped, or
        made no progress for longer than its deadline plus a grace (a frozen engine thread)."""
        if handle.done():
            return
        if self._error is not None:
            raise self._error
        if not self._thread.is_alive():
            raise HorovodInternalError(f"hpcring.torch: the engine stopped before '{handle.name}' finished")
        idle = time.monotonic() - self._progress
        if idle > self.timeout + PROGRESS_GRACE_S:
            raise HorovodInternalError(f"hpcring.torch: '{handle.name}' is pending and the engine made no "
                                       f"progress for {idle:.0f} s (HPCRING_TIMEOUT {self.timeout:.0f} s)")

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5.0)
        with self._cv:     # the thread may be stuck in a collective: fail what is left anyway
            self._fail_all(HorovodInternalError("hpcring.torch was shut down with operations in flight"))
        if self.timeline is not None and self.pset_id == 0:
            self.timeline.close()

    def expect(self, owner: object, names) -> None:
        """``owner`` (a DistributedOptimizer) will submit every one of ``names`` this step: once the
        last of them is queued, the cycle starts without waiting out the cycle time."""
        with self._cv:
            due = set(names)
            if due:
                self._due[id(owner)] = due
            else:
                self._due.pop(id(owner), None)

    def substitute(self, owner: object, name: str, names) -> None:
        """This step, ``owner`` submits ``names`` instead of ``name`` (a sparse gradient's parts)."""
        with self._cv:
            due = self._due.get(id(owner))
            if due is not None and name in due:
                due.discard(name)
                due.update(names)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        idle_cycles = 0
        while True:
            with self._cv:
                self._wait_for_cycle(idle_cycles)
                if self._stop:
                    self._fail_all(HorovodInternalError("hpcring.torch was shut down with operations in flight"))
                    return
            try:
                progressed = self._cycle_once()
            except BaseException as err:  # noqa: BLE001 - the communicator failed: every waiter gets it
                if not isinstance(err, HpcringError):
                    err = HorovodInternalError(f"hpcring.torch engine on rank {self.rank}: {type(err).__name__}: {err}")
                err = internal(err)
                with self._cv:
                    self._error = err
                    self._fail_all(err)
                return
            idle_cycles = 0 if progressed else min(idle_cycles + 1, 50)

    def _wait_for_cycle(self, idle_cycles: int) -> None:
        """Return (holding ``_cv``) when a cycle should start: at once for a full buffer or a
        complete expected set; else after the cycle time from the oldest queued operation or the
        previous cycle's start. Auto cycle time: held host gradients wait for those events (or
        HELD_MAX_S), other work 1 ms. After a cycle that matched nothing, back off up to 50 ms."""
        while not self._stop:
            self._progress = time.monotonic()
            if self._join_handle is not None:
                if idle_cycles:
                    self._cv.wait(min(0.001 * idle_cycles, 0.05))
                return
            if not self._pending:
                self._cv.wait(1.0)
                continue
            if idle_cycles == 0 and (self._flush or 0 < self.threshold <= self._pending_bytes):
                return
            cycle = self.cycle_s
            if cycle < 0:
                held = idle_cycles == 0 and self._held == len(self._pending)
                cycle = HELD_MAX_S if held else HOROVOD_CYCLE_MS / 1000.0
            span = max(cycle, min(cycle * (1 + idle_cycles), 0.05))
            wait = max(self._pending[0].t_queued, self._cycle_t0) + span - time.time()
            if wait <= 0:
                return
            self._cv.wait(wait)

    def _fail_all(self, err: BaseException) -> None:
        for e in self._pending:
            e.handle._set(error=err)
        self._pending.clear()
        self._names.clear()
        self._pending_bytes, self._held, self._flush = 0, 0, False
        if self._join_handle is not None:
            self._join_handle._set(error=err)
            self._join_handle = None

    def _take(self, entries: list[Entry]) -> None:
        """Remove ``entries`` (ready or failed) from the queue."""
        with self._cv:
            taken = {id(e) for e in entries if self._names.get(e.name) is e}
            if not taken:
                return
            for e in entries:
                if id(e) in taken:
                    del self._names[e.name]
                    if e.kind in FUSABLE:
                        self._pending_bytes -= e.nbytes
                    self._held -= e.held
            self._pending = [e for e in self._pending if id(e) not in taken]
            if not self._pending:
                self._flush = False

    def _cycle_once(self) -> bool:
        self._cycle += 1
        self._cycle_t0 = time.time()
        with self._cv:
            pending = list(self._pending)
            joining = self._join_handle is not None
        if joining and not self._joined_cycle:
            self._joined_cycle = self._cycle
        stalled = bool(pending) and time.time() - min(e.t_queued for e in pending) > self.timeout
        t0 = time.time()
        out = self.controller.negotiate(pending, self._joined_cycle, stalled, self.threshold,
                                        int(self.cycle_s * 1e6))
        t1 = time.time()
        self._progress = time.monotonic()
        st = self.stats
        st["cycles"] += 1
        st["negotiate_s"] += t1 - t0
        st["full_negotiations"] += out.full
        st["cache_hits"] += 0 if out.full else len(out.ready)
        if self.timeline is not None:
            self.timeline.negotiate(pending if out.full else out.ready, t0, t1)
        self.threshold, self.cycle_s = self.controller.threshold, self.controller.cycle_us / 1e6
        if out.failed:
            self._take([e for e, _ in out.failed])
            for e, err in out.failed:
                if e.auto is not None and isinstance(err, (JoinedRankError, StallError)):
                    self._give_back(e.auto)
                e.handle._set(error=err)
        if out.ready:
            for e in out.ready:
                if isinstance(e, StandIn):
                    self._stand_in(e.name_hash)
            self._take(out.ready)
            self._execute(out.ready)
        if out.all_joined:
            with self._cv:
                h, self._join_handle, self._joined_cycle = self._join_handle, None, 0
            if h is not None:
                h._set(out.last_joined if not self.controller.members else self.controller.members[out.last_joined])
            return True
        return bool(out.ready or out.failed)

    # -- execution --------------------------------------------------------------------------
    def _execute(self, ready: list[Entry]) -> None:
        chunks = fusion.plan(ready, self.threshold)
        for i, chunk in enumerate(chunks):
            try:
                with fusion.stream_context(chunk):
                    if chunk[0].kind in FUSABLE:
                        self._run_fused(chunk)
                    else:
                        self._run_single(chunk[0])
            except CollectiveError as err:       # the communicator failed: fatal (raised to _loop)
                for rest in chunks[i:]:          # this chunk and the ones that cannot run now
                    for e in rest:
                        e.handle._set(error=internal(err))
                raise
            except BaseException as err:  # noqa: BLE001 - this operation fails, the engine goes on
                for e in chunk:
                    e.handle._set(error=internal(err))
            self._progress = time.monotonic()

    def _run_fused(self, chunk: list[Entry]) -> None:
        t0, t1, t2, t3 = fusion.run_fused(self.comm, chunk, self._buffers, self.timeout)
        st = self.stats
        st["collectives"] += 1
        st["fused_tensors"] += len(chunk)
        st["pack_s"] += t1 - t0
        st["backend_s"] += t2 - t1
        st["unpack_s"] += t3 - t2
        if self.timeline is not None:
            self.timeline.fused(chunk, t0, t1, t2, t3, sum(e.nbytes for e in chunk), self.backend)
        for e in chunk:
            e.handle._set(e.output)

    def _run_single(self, e: Entry) -> None:
        t0 = time.time()
        result = executor.run_single(self.comm, e, self.timeout)
        self.stats["collectives"] += 1
        if self.timeline is not None:
            self.timeline.single(e, t0, time.time(), self.backend)
        e.handle._set(result)
