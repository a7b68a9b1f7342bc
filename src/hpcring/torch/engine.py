"""The background engine behind :mod:`hpcring.torch`: name matching across ranks, Tensor Fusion,
and execution on an hpcring :class:`~hpcring.collectives.api.Communicator`.

Horovod's model: each rank submits named operations in any order; an operation runs once every
rank has submitted it. Here one engine thread per process does, in cycles:

1. wait for work, then until the cycle should start (:meth:`Engine._wait_for_cycle`): every
   gradient an optimizer expects this step is queued (:meth:`Engine.expect`), or the queued
   bytes fill the fusion buffer, or ``cycle_time`` has passed (unset: host gradients of an
   optimizer wait for the first two, everything else 1 ms), so that gradients fuse;
2. **negotiate**: one fixed-size int64 allgather of (header, up to ``CAP`` entries). An entry is
   (name hash, signature hash, element count, kind/dtype code); the header carries flags and
   rank 0's fusion threshold and cycle time, which every rank adopts (the autotuner runs on
   rank 0 only, and fusion must be cut the same way everywhere);
3. the entries present on every (not joined) rank, in rank 0's submission order, are *ready*;
   same name with a different signature is an immediate error naming the tensor and the ranks;
4. ready allreduce/broadcast entries with the same (kind, dtype, device, op, scale factors,
   root) are packed into a fusion buffer up to the threshold (one copy in, one copy out, on the
   tensors' device), run as one collective, and unpacked; other kinds run one by one.

A rank only enters a cycle when it has work, so cycles stay aligned: the allgather completes only
when every rank entered it. Cost: one small allgather (``8 * (HDR + 4 * CAP)`` bytes per rank,
~4 KiB) per cycle, measured in benchmarks/horovod_synthetic.py. A name that some ranks submitted
and others did not for longer than the communicator's timeout sets the stall flag; all ranks
then exchange their pending names and fail every pending handle with one message naming the
tensors and the ranks that have / lack them. A rank that stops taking part (dead, hung) makes
the negotiation allgather fail with the backend's error naming that peer, prefixed with the
tensors this rank was waiting with.
"""
from __future__ import annotations

import functools
import hashlib
import threading
import time
from typing import Any

import numpy as np
import torch

from hpcring.errors import CollectiveError, HpcringError, UsageError

CAP = 128            # entries per negotiation message; more pending ones wait for the next cycle
HDR = 6              # stall flag, entry count, join cycle (+1, 0 = not joined), threshold, cycle us, 0
KINDS = ("allreduce", "broadcast", "allgather", "alltoall", "reducescatter", "barrier", "join")
FUSABLE = ("allreduce", "broadcast")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
           torch.uint8, torch.int8, torch.int16, torch.bool)
_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in _DTYPES}
DEFAULT_THRESHOLD = 128 * 1024 * 1024      # Horovod's default since 0.21
HOROVOD_CYCLE_MS = 1.0                     # Horovod's default since 0.21
AUTO_CYCLE_MS = -1.0                       # HPCRING_CYCLE_TIME unset: see Engine._wait_for_cycle
DEFAULT_CYCLE_MS = AUTO_CYCLE_MS
HELD_MAX_S = 1.0      # auto: the longest held gradients wait (a backstop; the step's end comes first)


@functools.lru_cache(maxsize=65536)     # the same names and signatures recur every step
def _h63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1




class Handle:
    """What ``*_async`` returns; pass it to :func:`hpcring.torch.synchronize` / ``poll``."""

    __slots__ = ("name", "_event", "_result", "_error", "_finish")

    def __init__(self, name: str, finish=None) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finish = finish          # result post-processing in the waiting thread (decompress)

    def _set(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None):
        if not self._event.wait(timeout):
            raise CollectiveError(f"hpcring.torch: '{self.name}' did not finish within {timeout:.1f} s")
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


class GroupHandle(Handle):
    """A handle over several (grouped operations): the result is the list of their results."""

    __slots__ = ("members",)

    def __init__(self, name: str, members: list[Handle]) -> None:
        super().__init__(name)
        self.members = members

    def done(self) -> bool:
        return all(h.done() for h in self.members)

    def wait(self, timeout: float | None = None):
        return [h.wait(timeout) for h in self.members]


class Entry:
    """One submitted operation. ``tensor``: the input (already compressed and contiguous);
    ``output``: where the result goes (allreduce/broadcast: written in place, may be ``tensor``)."""

    __slots__ = ("name", "kind", "tensor", "output", "op", "pre", "post", "root", "splits", "handle",
                 "t_queued", "name_hash", "sig_hash", "numel", "nbytes", "code", "stream", "held")

    def __init__(self, name: str, kind: str, tensor, output=None, *, op: str = "sum", pre: float = 1.0,
                 post: float = 1.0, root: int = -1, splits=None) -> None:
        self.name, self.kind, self.tensor, self.output = name, kind, tensor, output
        self.op, self.pre, self.post, self.root, self.splits = op, pre, post, root, splits
        self.handle = Handle(name)
        self.t_queued = time.time()
        dt = tensor.dtype if tensor is not None else torch.uint8
        # allgather / alltoall first dims may differ between ranks: not part of the signature
        shape = tuple(tensor.shape[1:]) if kind in ("allgather", "alltoall") and tensor is not None \
            else tuple(tensor.shape) if tensor is not None else ()
        self.name_hash = _h63(name)
        self.sig_hash = _h63(f"{kind}|{dt}|{shape}|{op}|{pre}|{post}|{root}")
        self.numel = tensor.numel() if tensor is not None else 0
        self.nbytes = self.numel * tensor.element_size() if tensor is not None else 0
        self.code = KINDS.index(kind) * 256 + (_DTYPES.index(dt) if dt in _DTYPES else 255)
        self.held = False              # set by Engine.submit: an optimizer expects it, on the host
        self.stream = None
        if tensor is not None and tensor.is_cuda:
            self.stream = torch.cuda.current_stream(tensor.device)

    def describe(self) -> str:
        return f"'{self.name}' ({self.kind}, {self.numel} x {_DTYPE_NAMES.get(self.tensor.dtype, '?') if self.tensor is not None else '-'})"


class Engine:
    """The per-process engine (created by :func:`hpcring.torch.init`)."""

    def __init__(self, comm, *, local_rank: int = 0, timeline=None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        from hpcring.config import envvars          # parsed and bounded there, one message per bad value
        self.threshold = int(envvars.get("HPCRING_FUSION_THRESHOLD", default=DEFAULT_THRESHOLD))
        self.cycle_s = envvars.get("HPCRING_CYCLE_TIME", default=DEFAULT_CYCLE_MS) / 1000.0   # < 0: auto
        self.timeout = comm.timeout
        self.backend = getattr(comm.backend, "name", "?")
        self.timeline = timeline
        self.autotuner = None
        self._cv = threading.Condition()
        self._pending: list[Entry] = []
        self._inflight: list[Entry] = []       # taken off _pending by the cycle now running
        self._names: dict[str, Entry] = {}
        self._due: dict[int, set[str]] = {}       # expect(): owner -> names it has still to submit
        self._flush = False                     # an owner's expected names are all queued: go now
        self._pending_bytes = 0                 # fusable bytes queued (the buffer-full trigger)
        self._held = 0                          # pending host gradients an optimizer expects (auto cycle)
        self._cycle_t0 = 0.0                    # when the last cycle started
        self._error: BaseException | None = None
        self._stop = False
        self._join_handle: Handle | None = None
        self._joined_cycle = 0
        self._cycle = 0
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.stats = {"cycles": 0, "negotiate_s": 0.0, "collectives": 0, "fused_tensors": 0,
                      "pack_s": 0.0, "backend_s": 0.0, "unpack_s": 0.0}
        self._thread = threading.Thread(target=self._loop, name=f"hpcring-torch:{self.rank}", daemon=True)
        self._thread.start()

    # -- submission (any thread) ------------------------------------------------------------
    def submit(self, e: Entry) -> Handle:
        with self._cv:
            if self._error is not None:
                raise self._error
            if self._stop:
                raise UsageError("hpcring.torch is shut down", hint="call hvd.init() again")
            if e.name in self._names:
                raise UsageError(f"hpcring.torch: an operation named '{e.name}' is already in flight on rank {self.rank}",
                                 hint="names must be unique among pending operations; synchronize the first one")
            self._names[e.name] = e
            # wake the engine only when this entry changes when its cycle starts: it was idle or
            # holding gradients only (auto), or this completes an expected set or fills the buffer
            # (else its timed wait ends on its own; a wake-up per gradient costs the backward pass
            # a thread switch each)
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

    def join(self) -> Handle:
        with self._cv:
            if self._join_handle is None:
                self._join_handle = Handle("join")
                self._cv.notify()
            return self._join_handle

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5.0)
        if self.timeline is not None:
            self.timeline.close()

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        idle_cycles = 0
        while True:
            with self._cv:
                self._wait_for_cycle(idle_cycles)
                if self._stop:
                    self._fail_all(UsageError("hpcring.torch was shut down with operations in flight"))
                    return
            try:
                progressed = self._cycle_once()
            except BaseException as err:  # noqa: BLE001 - every waiter gets the error
                if not isinstance(err, HpcringError):
                    err = CollectiveError(f"hpcring.torch engine on rank {self.rank}: {type(err).__name__}: {err}")
                with self._cv:
                    self._error = err
                    self._fail_all(err)
                return
            idle_cycles = 0 if progressed else min(idle_cycles + 1, 50)

    def _wait_for_cycle(self, idle_cycles: int) -> None:
        """Return (holding ``_cv``) when a cycle should start. A cycle ends its collecting early
        when every operation an optimizer expects this step is queued (nothing more will come to
        fuse with) or the queued fusable bytes fill the fusion buffer; otherwise it collects for
        the cycle time, counted from the oldest queued operation or the start of the previous cycle,
        whichever is later. With the cycle time unset (auto), gradients on the host that an
        optimizer expects wait for those two events (or 1 s, a backstop): on CPU the collectives
        compete with the backward pass for the same cores, so overlapping buys less than the extra
        cycles cost (docs/from-horovod.md, Performance); anything else (CUDA tensors, plain
        hvd.allreduce calls) gets Horovod's 1 ms. After a cycle that matched nothing (ranks queued
        different names) the wait backs off, up to 50 ms."""
        while not self._stop:
            if self._join_handle is not None:
                return
            if not self._pending:
                self._cv.wait()
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

    def expect(self, owner: object, names) -> None:
        """``owner`` (a DistributedOptimizer) will submit every one of ``names`` this step: once the
        last of them is queued, the cycle starts without waiting out the cycle time. Called again
        for each step; an owner with an empty list expects nothing."""
        with self._cv:
            due = set(names)
            if due:
                self._due[id(owner)] = due
            else:
                self._due.pop(id(owner), None)

    def _fail_all(self, err: BaseException) -> None:
        for e in self._pending + self._inflight:
            e.handle._set(error=err)
        self._pending.clear()
        self._inflight = []
        self._names.clear()
        self._pending_bytes, self._held, self._flush = 0, 0, False
        if self._join_handle is not None:
            self._join_handle._set(error=err)
            self._join_handle = None

    def _cycle_once(self) -> bool:
        self._cycle += 1
        self._cycle_t0 = time.time()
        with self._cv:
            batch = list(self._pending[:CAP])
            joining = self._join_handle is not None
        if joining and not self._joined_cycle:
            self._joined_cycle = self._cycle
        now = time.time()
        stalled = bool(batch) and now - batch[0].t_queued > self.timeout
        msg = np.zeros(HDR + 4 * CAP, dtype=np.int64)
        msg[:HDR] = (int(stalled), len(batch), self._joined_cycle, self.threshold, int(self.cycle_s * 1e6), 0)
        for i, e in enumerate(batch):
            msg[HDR + 4 * i: HDR + 4 * i + 4] = (e.name_hash, e.sig_hash, e.numel, e.code)
        t0 = time.time()
        try:
            table = self.comm.allgather(msg, timeout=self.timeout).reshape(self.size, -1)
        except CollectiveError as err:
            waiting = ", ".join(e.describe() for e in batch[:5]) + (" ..." if len(batch) > 5 else "")
            raise CollectiveError(f"hpcring.torch: rank {self.rank} was matching operations by name "
                                  f"({waiting or 'join'}) when the negotiation failed: {err.message}",
                                  hint=err.hint) from None
        t1 = time.time()
        self.stats["cycles"] += 1
        self.stats["negotiate_s"] += t1 - t0
        if self.timeline is not None:
            self.timeline.negotiate(batch, t0, t1)
        # rank 0's tuning parameters hold everywhere (fusion must be cut identically)
        self.threshold, self.cycle_s = int(table[0, 3]), table[0, 4] / 1e6
        joined = [int(table[r, 2]) for r in range(self.size)]
        active = [r for r in range(self.size) if not joined[r]]
        if table[:, 0].any():
            self._diagnose_stall(table, batch)
        entries = {r: {int(table[r, HDR + 4 * i]): tuple(int(v) for v in table[r, HDR + 4 * i: HDR + 4 * i + 4])
                       for i in range(int(table[r, 1]))} for r in range(self.size)}
        mine = {e.name_hash: e for e in batch}
        ready: list[Entry] = []
        if active:
            order_rank = active[0]
            for h in (int(table[order_rank, HDR + 4 * i]) for i in range(int(table[order_rank, 1]))):
                if not all(h in entries[r] for r in active):
                    continue
                sigs = {entries[r][h][1] for r in active}
                if len(sigs) > 1:
                    self._mismatch(h, entries, active, mine)
                e = mine.get(h)
                if e is None:                              # this rank joined: stand in with zeros
                    e = self._stand_in(h, entries[order_rank][h])
                ready.append(e)
        if ready:
            with self._cv:
                taken = {id(e) for e in ready if self._names.get(e.name) is e}
                for e in ready:
                    if id(e) in taken:
                        del self._names[e.name]
                        if e.kind in FUSABLE:
                            self._pending_bytes -= e.nbytes
                        self._held -= e.held
                self._pending = [e for e in self._pending if id(e) not in taken]
                if not self._pending:
                    self._flush = False
                self._inflight = ready
            self._execute(ready)
            self._inflight = []
        if not active:                                   # every rank joined
            last = max(range(self.size), key=lambda r: (joined[r], r))
            with self._cv:
                h, self._join_handle, self._joined_cycle = self._join_handle, None, 0
            if h is not None:
                h._set(last)
            return True
        return bool(ready)

    # -- diagnoses --------------------------------------------------------------------------
    def _mismatch(self, h: int, entries, active, mine) -> None:
        from hpcring.ranks import rank_ranges
        e = mine.get(h)
        groups: dict[tuple, list[int]] = {}
        for r in active:
            _, _, numel, code = entries[r][h]
            groups.setdefault((numel, code), []).append(r)
        parts = []
        for (numel, code), rs in groups.items():
            kind, dt = KINDS[code // 256], code % 256
            dname = _DTYPE_NAMES.get(_DTYPES[dt], "?") if dt < len(_DTYPES) else "?"
            parts.append(f"{'rank' if len(rs) == 1 else 'ranks'} {rank_ranges(rs)}: {kind} of {numel} x {dname}")
        name = f"'{e.name}'" if e is not None else f"#{h:x}"
        raise CollectiveError(f"hpcring.torch: operation {name} differs across ranks (kind, shape, dtype, op, "
                              f"scale factors or root): " + "; ".join(parts),
                              hint="every rank must submit the same operation under one name")

    def _diagnose_stall(self, table, batch) -> None:
        """Every rank arrives here in the same cycle: exchange pending names, fail with them."""
        from hpcring.ranks import rank_ranges
        text = "\n".join(e.name for e in batch).encode()
        lens = self.comm.allgather(np.array([len(text)], dtype=np.int64), timeout=self.timeout).reshape(-1)
        buf = np.zeros(int(lens.max()) or 1, dtype=np.uint8)
        buf[:len(text)] = np.frombuffer(text, dtype=np.uint8)
        allnames = self.comm.allgather(buf, timeout=self.timeout).reshape(self.size, -1)
        have: dict[str, list[int]] = {}
        for r in range(self.size):
            for n in bytes(allnames[r, :lens[r]]).decode(errors="replace").split("\n"):
                if n:
                    have.setdefault(n, []).append(r)
        lines = []
        for n, rs in sorted(have.items()):
            if len(rs) < self.size:
                missing = [r for r in range(self.size) if r not in rs]
                lines.append(f"'{n}' submitted by {'rank' if len(rs) == 1 else 'ranks'} {rank_ranges(rs)}, "
                             f"not by {'rank' if len(missing) == 1 else 'ranks'} {rank_ranges(missing)}")
        raise CollectiveError(f"hpcring.torch: operation names do not match across ranks after {self.timeout:.0f} s "
                              f"(HPCRING_TIMEOUT): " + "; ".join(lines[:8]) + (" ..." if len(lines) > 8 else ""),
                              hint="every rank must submit the same named operations (hvd.allreduce(..., name=...)); "
                                   "check rank-dependent branches")

    def _stand_in(self, h: int, ent: tuple) -> Entry:
        """A joined rank's zero contribution to an allreduce the other ranks run."""
        _, _, numel, code = ent
        kind = KINDS[code // 256]
        if kind != "allreduce":
            raise CollectiveError(f"hpcring.torch: rank {self.rank} has joined but other ranks run a {kind}; "
                                  "only allreduce can proceed while ranks have joined")
        z = torch.zeros(numel, dtype=_DTYPES[code % 256])
        e = Entry(f"joined#{h:x}", "allreduce", z, z)
        return e

    # -- execution --------------------------------------------------------------------------
    def _execute(self, ready: list[Entry]) -> None:
        groups: dict[tuple, list[Entry]] = {}
        order: list[tuple] = []
        for e in ready:
            if e.kind in FUSABLE:
                key = (e.kind, e.tensor.dtype, e.tensor.device, e.op, e.pre, e.post, e.root)
            else:
                key = (id(e),)
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append(e)
        for key in order:
            members = groups[key]
            if members[0].kind not in FUSABLE:
                self._single(members[0])
                continue
            chunk: list[Entry] = []
            nbytes = 0
            for e in members:
                b = e.nbytes
                if chunk and nbytes + b > self.threshold:
                    self._fused(chunk)
                    chunk, nbytes = [], 0
                chunk.append(e)
                nbytes += b
            if chunk:
                self._fused(chunk)

    def _fused(self, chunk: list[Entry]) -> None:
        first = chunk[0]
        stream = first.stream
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        try:
            with ctx:
                if stream is not None:
                    for e in chunk[1:]:
                        if e.stream is not None and e.stream != stream:
                            stream.wait_stream(e.stream)
                self._fused_run(chunk)
        except BaseException as err:  # noqa: BLE001 - the waiters get it; the engine stops on comm errors
            for e in chunk:
                e.handle._set(error=err)
            if isinstance(err, CollectiveError):
                raise
            return
        for e in chunk:
            e.handle._set(e.output)

    def _fused_run(self, chunk: list[Entry]) -> None:
        tl = self.timeline
        first = chunk[0]
        total = sum(e.numel for e in chunk)
        t0 = time.time()
        if len(chunk) == 1:
            buf = first.output.view(-1) if first.output.is_contiguous() else None
            if buf is None:
                raise UsageError(f"'{first.name}': output tensor must be contiguous")
            if first.output is not first.tensor:
                buf.copy_(first.tensor.reshape(-1))
        else:
            buf = self._buffer(first.tensor.dtype, first.tensor.device, total)
            torch.cat([e.tensor.reshape(-1) for e in chunk], out=buf)
        if first.pre != 1.0:
            buf.mul_(first.pre)
        t1 = time.time()
        if first.kind == "allreduce":
            self.comm.allreduce(buf, op=first.op, out=buf)
        else:
            self.comm.broadcast(buf, root=first.root)
        t2 = time.time()
        if first.post != 1.0:
            if buf.is_floating_point():
                buf.mul_(first.post)
            else:
                buf.copy_(torch.div(buf, 1.0 / first.post, rounding_mode="floor"))
        if len(chunk) > 1:
            pos = 0
            for e in chunk:
                e.output.view(-1).copy_(buf[pos:pos + e.numel])
                pos += e.numel
        t3 = time.time()
        st = self.stats
        st["collectives"] += 1
        st["fused_tensors"] += len(chunk)
        st["pack_s"] += t1 - t0
        st["backend_s"] += t2 - t1
        st["unpack_s"] += t3 - t2
        if tl is not None:
            tl.fused(chunk, t0, t1, t2, t3, total * first.tensor.element_size(), self.backend)

    def _buffer(self, dtype, device, n: int) -> torch.Tensor:
        key = (dtype, device)
        b = self._buffers.get(key)
        if b is None or b.numel() < n:
            b = torch.empty(max(n, 1), dtype=dtype, device=device)
            self._buffers[key] = b
        return b[:n]

    def _single(self, e: Entry) -> None:
        from hpcring.torch import ops as impl
        t0 = time.time()
        try:
            ctx = torch.cuda.stream(e.stream) if e.stream is not None else _null()
            with ctx:
                result = impl.run_single(self.comm, e)
        except BaseException as err:  # noqa: BLE001
            e.handle._set(error=err)
            if isinstance(err, CollectiveError):
                raise
            return
        if self.timeline is not None:
            self.timeline.single(e, t0, time.time(), self.backend)
        e.handle._set(result)


def _null():
    import contextlib
    return contextlib.nullcontext()
