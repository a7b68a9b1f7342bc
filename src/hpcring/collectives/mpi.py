"""MPI backend: the Backend interface on mpi4py's non-blocking collectives.

Every operation is started as a non-blocking MPI collective (``Iallreduce``, ``Iallgather``,
``Ibcast``, ``Ireduce_scatter``, ``Ialltoall``, ``Ibarrier``) and its request is polled with
``Test()`` until it completes or the call's deadline passes; between polls the thread sleeps
(50 us, doubling up to 1 ms) so that ranks oversubscribing a few cores leave them to the peers.

MPI cannot cancel a started collective, so a missed deadline is fatal for the job: the backend
builds a :class:`~hpcring.errors.CollectiveError` naming the op, its sequence number, element
count, dtype, bytes and the deadline, **reports it** (logger ``hpcring.collectives.mpi`` and one
line on stderr, flushed) and then calls ``MPI_Abort`` on ``MPI_COMM_WORLD`` with exit code
:data:`ABORT_CODE` (124), so ``mpirun``/``srun`` tear the whole job down instead of leaving the
other ranks hanging. ``abort_on_timeout=False`` (or env ``HPCRING_MPI_ABORT_ON_TIMEOUT=0``)
raises the CollectiveError instead (for tests and for callers that abort themselves); the
communicator is then dead (sticky error) and the stuck request is kept alive -- MPI may still
write into that call's buffers if the missing rank joins later.

dtypes: data movement (allgather, broadcast, alltoall) is done on bytes (``MPI_BYTE``), so every
dtype moves bit-exactly. Reductions: float32/float64 -> ``MPI_FLOAT``/``MPI_DOUBLE``; int32/int64
min/max on the signed types and sum/prod on ``MPI_UINT32_T``/``MPI_UINT64_T`` views (two's
complement wrap-around like numpy, without signed-overflow undefined behaviour); uint8 ->
``MPI_UINT8_T`` for min/max, and uint8 sum/prod on a uint32 copy (Open MPI 4.1's AVX ``MPI_SUM``
on 8-bit unsigned integers saturates at 255 instead of wrapping -- seen here on 1000 elements).
**float16 and bfloat16 are upcast to float32**, reduced by MPI in float32 and
rounded to nearest-even once at the end (no user-defined MPI op: those run a Python callback per
chunk and hold the GIL). This costs twice the bytes on the wire for 2-byte types but is at least
as accurate as the ring backend (one rounding instead of one per combination). ``avg`` is ``SUM``
followed by a division by the world size (in float32 for the 2-byte types). min/max of NaN follow
the MPI library (Open MPI's ``MPI_MIN``/``MAX`` do not promise NaN propagation, unlike the ring;
small calls folded into the signature check, below, propagate NaN as numpy does).

Signature check (``HPCRING_MPI_CHECK_SIGNATURES``, default on). Open MPI does not check that
ranks pass matching arguments: a rank all-reducing another count corrupts its heap (``double free
or corruption``, SIGABRT) and another collective at the same point hangs until the deadline. So
every rank's (op, count, dtype, reduction, root, sequence number) is agreed on before MPI sees the
call's buffers, and a difference raises at once on every rank ``allreduce#5 mismatched collective:
rank 1 (node2) called allreduce#5(count=32768, ...) but this rank (0) called
allreduce#5(count=65536, ...)``, the ring's wording. How:

* communicators of at most :data:`FOLD_RANKS` ranks: one ``Iallgather`` of a fixed-size slot per
  rank (the signature, then room for :data:`FOLD_BYTES` of data). The slot's size never depends on
  the call, so ranks that disagree still make matching MPI calls, and each one receives every
  rank's signature (the message needs nothing more). A call whose data fits in the slot (a 4 KiB
  allreduce, allgather, reduce-scatter, broadcast or alltoall) is **folded** into it: its result
  is made here from the gathered slots (reductions in rank order, in :func:`reduce_rows`, with the
  MPI path's arithmetic), so the check *is* the call: one MPI call in all. Larger calls follow
  with their own MPI call.
* more ranks (the gathered slots would grow with them): one ``Iallreduce`` of the signature and
  its negation under ``MPI_MAX`` (max of -s = -min of s: both extremes in one constant-size call),
  then, on a difference only, an ``Iallgather`` of the signatures for the message.

Cost: see docs/collectives.md (``benchmarks/mpi_check_cost.py``). A barrier is the check alone.

The backend works on a duplicate of ``MPI_COMM_WORLD`` (``Comm.Idup``, polled against the
creation deadline) whose rank and size must equal the hpcring Topology's.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np

from hpcring.collectives.backends import DTYPES, OPS, LazyDesc, LibraryBackend, chunk_counts
from hpcring.collectives.mpi_check import (CHECK_SPIN_S, FOLD_BYTES, FOLD_RANKS, SIG_LEN, SLOT_HEADER, SPIN_BYTES,
                                           SignatureCheck, _pack_sig, check_default, mismatch_message, signature)
from hpcring.collectives.mpi_datatypes import (_UFUNCS, _from_wire, _to_wire, _widened, from_float32, reduce_plan,
                                               reduce_rows, to_float32)
from hpcring.collectives.mpi_p2p import MpiPointToPoint
from hpcring.collectives.mpi_setup import _all_arrived, _import_mpi, _skip_finalize_at_exit
from hpcring.errors import CollectiveError, UsageError
from hpcring.config import envvars
from hpcring.config.envvars import get

log = logging.getLogger("hpcring.collectives.mpi")

ABORT_CODE = 124
POLL_MIN = 50e-6
POLL_MAX = 1e-3
ABORT_ENV = "HPCRING_MPI_ABORT_ON_TIMEOUT"


def abort_default() -> bool:
    """HPCRING_MPI_ABORT_ON_TIMEOUT (0/false/no/off disable), default on."""
    return get(ABORT_ENV)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.size > 0 and b.size > 0 and np.shares_memory(a, b))


class MpiBackend(SignatureCheck, MpiPointToPoint, LibraryBackend):
    """Collectives over a duplicate of MPI_COMM_WORLD (host memory, numpy buffers)."""

    name = "mpi"
    label = "MPI"
    device = "cpu"

    def __init__(self, comm, *, hosts=None, abort_on_timeout: bool | None = None,
                 abort_code: int = ABORT_CODE, mpi=None, check: bool | None = None) -> None:
        self._MPI = mpi if mpi is not None else _import_mpi()
        self._comm = comm
        self._init_state(comm.Get_rank(), comm.Get_size(), hosts)
        self.abort_on_timeout = abort_default() if abort_on_timeout is None else bool(abort_on_timeout)
        self.check = (check_default() if check is None else bool(check)) and self._size > 1
        self._sig = np.empty(2 * SIG_LEN, np.int64)       # reused: (signature, -signature)
        self.fold = self._size <= FOLD_RANKS              # the check is the slot Iallgather
        self._slots = None                                # _make_slots': made at the first check
        self._views: dict = {}                            # _views_of's cache
        self._plans: dict = {}                            # (dtype, op) -> _plan's answer
        self.abort_code = int(abort_code)
        self._stuck: list = []            # requests (and their buffers) of calls that timed out

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, topology=None, store=None, secret=None, timeout: float | None = None, *,
               abort_on_timeout: bool | None = None, abort_code: int = ABORT_CODE,
               lazy: bool = False, group_ranks=None, prefix: str = "hpcring/mpi") -> "MpiBackend":
        """Duplicate MPI_COMM_WORLD (collective: every rank must call) after checking that MPI's
        rank and size are the Topology's. With ``store``, every rank first meets there (bounded by
        the deadline): MPI_Init under PMIx waits for a missing rank without any deadline, the
        store names it. ``secret`` is unused (MPI meets by itself).

        ``lazy=True`` (with ``store`` and ``topology``; what :meth:`Communicator.create` asks for):
        the meeting, MPI_Init and the duplicate happen in the first collective, under its deadline,
        so a rank late to it is that collective's "never joined" in the watchdog's report, as for
        any later collective (and as on the ring).

        ``group_ranks`` (global ranks, sorted; ``topology`` is then the group's sub-topology, see
        hpcring.collectives.groups): a communicator of those ranks only, made with
        ``MPI_Comm_create_group`` (collective over the members alone); the meeting uses the
        group's keys under ``prefix``. A lazy group initializes MPI (if not done yet) in its first
        collective before the meeting: MPI_Init waits for every rank of the job, without a deadline."""
        if lazy and store is not None and topology is not None:
            be = cls.__new__(cls)
            be._init_lazy(topology, store, abort_on_timeout, abort_code)
            be._group = (tuple(group_ranks) if group_ranks is not None else None, prefix)
            return be
        if store is not None and topology is not None:
            # ranks start seconds apart on a busy machine: the bootstrap's deadline, not a collective's
            _all_arrived(store, topology, max(envvars.collective_timeout(timeout), envvars.get("HPCRING_INIT_TIMEOUT")),
                         f"{prefix}/arrived")
        MPI = _import_mpi()
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        world = MPI.COMM_WORLD
        rank, size = world.Get_rank(), world.Get_size()
        if group_ranks is not None:
            return cls._create_group(MPI, world, topology, group_ranks, abort_on_timeout, abort_code)
        if topology is not None and (rank != topology.rank or size != topology.size):
            raise CollectiveError(
                f"MPI says this process is rank {rank} of {size}, but the hpcring topology says rank "
                f"{topology.rank} of {topology.size} (launcher {topology.launcher}, host {topology.host})",
                hint="start every rank with one MPI launcher (mpirun, or srun --mpi=pmix with an MPI built "
                     "for PMIx); a process started otherwise is an MPI singleton of size 1. Or use backend='ring'")
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            log.warning("MPI thread level %s < MPI_THREAD_SERIALIZED: do not use the *_async calls", level)
        t = envvars.collective_timeout(timeout)
        hosts = topology.hosts if topology is not None else None
        idup = getattr(world, "Idup", None)
        if idup is None:
            comm = world.Dup()
        else:
            comm, req = world.Idup()
            probe = cls(world, hosts=hosts, abort_on_timeout=abort_on_timeout, abort_code=abort_code, mpi=MPI)
            probe._wait(req, "create", 0, "", t, time.monotonic(), keep=())
        comm.Set_name("hpcring")
        return cls(comm, hosts=hosts, abort_on_timeout=abort_on_timeout, abort_code=abort_code, mpi=MPI)

    @classmethod
    def _create_group(cls, MPI, world, topology, members, abort_on_timeout, abort_code) -> "MpiBackend":
        """A communicator of ``members`` (global ranks) only: MPI_Comm_create_group, collective
        over the members."""
        members = [int(m) for m in members]
        rank = world.Get_rank()
        if rank not in members or (topology is not None and members.index(rank) != topology.rank):
            raise CollectiveError(f"MPI rank {rank} is not rank {getattr(topology, 'rank', '?')} of the group "
                                  f"of ranks {members}", hint="every member must create the group")
        grp = world.Get_group().Incl(members)
        try:
            comm = world.Create_group(grp)
        finally:
            grp.Free()
        comm.Set_name("hpcring-group")
        hosts = topology.hosts if topology is not None else None
        return cls(comm, hosts=hosts, abort_on_timeout=abort_on_timeout, abort_code=abort_code, mpi=MPI)

    def _init_lazy(self, topology, store, abort_on_timeout, abort_code) -> None:
        self._MPI = None                  # importing mpi4py.MPI runs MPI_Init: not before the meeting
        self._comm = None
        self._init_state(topology.rank, topology.size, topology.hosts)
        self._pending = (topology, store)
        self.abort_on_timeout = abort_default() if abort_on_timeout is None else bool(abort_on_timeout)
        self.abort_code = int(abort_code)
        self._stuck = []
        self.check = check_default() and self._size > 1
        self._sig = np.empty(2 * SIG_LEN, np.int64)
        self.fold = self._size <= FOLD_RANKS
        self._slots = None
        self._views = {}
        self._plans = {}

    def _start(self, name: str, timeout: float) -> tuple[int, float]:
        """The sequence number of the call and its time left, after the lazy setup (if due)."""
        seq = self._begin(name)
        if self._comm is not None:
            return seq, timeout
        return seq, self._setup(f"{name}#{seq}", timeout)

    def _setup(self, name: str, timeout: float) -> float:
        """The lazy setup (the meeting, MPI_Init, the duplicate) under ``timeout``; the time left."""
        topology, store = self._pending
        members, prefix = getattr(self, "_group", (None, "hpcring/mpi"))
        t0 = time.monotonic()
        if members is not None:
            # MPI_Init first (collective over the whole job, it holds the GIL while it waits): a
            # group's meeting in the store would otherwise wait on rank 0, whose store thread
            # starves while rank 0 sits in MPI_Init for its own group (seen at 4 ranks, 2 groups)
            MPI = _import_mpi()
            if not MPI.Is_initialized():
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
        try:
            _all_arrived(store, topology, timeout, f"{prefix}/arrived")
        except CollectiveError as e:
            self._error = f"{name} never joined: {e.message}"
            raise CollectiveError(self._error, hint=e.hint) from None
        try:
            made = type(self).create(topology, None, None, timeout, abort_on_timeout=self.abort_on_timeout,
                                     abort_code=self.abort_code, group_ranks=members)
        except CollectiveError as e:
            self._error = f"{name}: {e.message}"
            raise
        self._MPI, self._comm, self._pending = made._MPI, made._comm, None
        return max(0.001, timeout - (time.monotonic() - t0))

    # -- Backend properties ---------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._comm is not None and self._error is None and self._comm is not self._MPI.COMM_WORLD:
            try:
                self._comm.Free()
            except Exception:  # noqa: BLE001 - finalized already, nothing to release
                pass

    # -- machinery ------------------------------------------------------------------------
    def _where(self) -> str:
        return f"rank {self._rank} ({self._host(os.uname().nodename)})"

    def _wait(self, req, name: str, seq: int, desc: str, timeout: float, t0: float, keep,
              spin: float = 0.0) -> None:
        MPI = self._MPI
        deadline = t0 + timeout
        delay = POLL_MIN
        spin_end = time.monotonic() + spin
        try:
            while not req.Test():
                now = time.monotonic()
                if now < spin_end:
                    continue
                if now >= deadline:
                    self._timed_out(req, name, seq, desc, timeout, now - t0, keep)
                time.sleep(min(delay, max(deadline - now, 0.0)))
                delay = min(delay * 2, POLL_MAX)
        except MPI.Exception as e:
            msg = f"{name}#{seq}{desc} failed on {self._where()}: MPI error {e.Get_error_class()}: {e.Get_error_string()}"
            self._error = msg
            raise CollectiveError(msg) from None

    def _timed_out(self, req, name, seq, desc, timeout, elapsed, keep) -> None:
        msg = (f"{name}#{seq}{desc} did not complete within the {timeout:g} s deadline on {self._where()} "
               f"(waited {elapsed:.2f} s): at least one rank has not entered it or is stuck")
        self._error = msg
        self._stuck.append((req, keep))
        if self.abort_on_timeout:
            log.error("%s; aborting the MPI job (MPI_Abort, exit code %d)", msg, self.abort_code)
            try:
                sys.stderr.write(f"hpcring: CollectiveError: {msg}; aborting the MPI job "
                                 f"(MPI_Abort code {self.abort_code}; {ABORT_ENV}=0 to raise instead)\n")
                sys.stderr.flush()
            finally:
                self._MPI.COMM_WORLD.Abort(self.abort_code)
        _skip_finalize_at_exit()
        raise CollectiveError(msg, hint="MPI cannot cancel a started collective: this communicator is dead; "
                                        "find the missing rank (hpcring stacks) and restart the job")

    def _start_wait(self, name, seq, desc, timeout, t0, keep, start, spin: float = 0.0) -> None:
        try:
            req = start()
        except self._MPI.Exception as e:
            self._start_failed(name, seq, desc, e)
        self._wait(req, name, seq, desc, timeout, t0, keep, spin)

    def _start_failed(self, name, seq, desc, e) -> None:
        """An MPI call refused to start a request: the sticky CollectiveError."""
        msg = f"{name}#{seq}{desc} failed to start on {self._where()}: {e.Get_error_string()}"
        self._error = msg
        raise CollectiveError(msg) from None

    def _run(self, name, seq, desc, timeout, start, keep, sig=None):
        t0 = time.monotonic()
        if sig is not None and self.check:
            self._agree(sig, name, seq, desc, timeout, t0)
        small = sum(getattr(b, "nbytes", 0) for b in keep) <= SPIN_BYTES
        self._start_wait(name, seq, desc, timeout, t0, keep, start, CHECK_SPIN_S if small else 0.0)

    @staticmethod
    def _bytes(buf: np.ndarray) -> np.ndarray:
        return buf.reshape(-1).view(np.uint8)

    def _reduce_args(self, dtype: str, op: str):
        """(wire view, MPI datatype, MPI op) of :meth:`_plan`, for the other reductions."""
        return (self._plans.get((dtype, op)) or self._plan(dtype, op))[:3]

    # -- collectives ----------------------------------------------------------------------
    def _plan(self, dtype: str, op: str) -> tuple:
        """A reduction's (wire view, MPI datatype, MPI op, widened, dtype code, op code) for
        (dtype, op), made once per communicator (reduce_plan's UsageError for a bad pair)."""
        view, mtype, mop = reduce_plan(dtype, op)
        plan = self._plans[dtype, op] = (view, getattr(self._MPI, mtype), getattr(self._MPI, mop),
                                         _widened(dtype, view), DTYPES.index(dtype), OPS.index(op))
        return plan

    def allreduce(self, sendbuf, recvbuf, dtype: str, op: str, timeout: float) -> None:
        plan = self._plans.get((dtype, op))
        if plan is None:                           # argument errors before a sequence number is used
            reduce_plan(dtype, op)
        if self._comm is None or self._error is not None or self._closed:
            seq, timeout = self._start("allreduce", timeout)
        else:                                      # _start's common case, inline
            seq = self._seq = self._seq + 1
        if plan is None:                           # (after _start: a lazy backend imports MPI there)
            plan = self._plan(dtype, op)
        view, mtype, mop, widened, dcode, ocode = plan
        MPI = self._MPI
        n = recvbuf.size
        desc = LazyDesc(n, dtype, op)
        sig = (0, n, dcode, ocode, -1, seq)        # signature("allreduce", seq, n, dtype, op)
        nb = recvbuf.nbytes
        if self.check and self.fold and nb <= FOLD_BYTES:
            # the data rides in the check's slot and is reduced here from every rank's copy: one
            # MPI call in all (_gather's steps inline: this is the small-message hot path)
            t0 = time.monotonic()
            mine, rows, slot, spec, heads = self._views.get((dtype, nb)) or self._views_of(dtype, recvbuf.dtype, nb)
            mine[...] = sendbuf if sendbuf.ndim == 1 else sendbuf.reshape(-1)
            _pack_sig(slot, 0, 0, n, dcode, ocode, -1, seq)
            try:
                req = self._comm.Iallgather(spec[0], spec[1])
            except MPI.Exception as e:
                self._start_failed("allreduce", seq, desc, e)
            spin_end = t0 + CHECK_SPIN_S
            while not req.Test():               # _wait's spin, inline; then _wait itself
                if time.monotonic() > spin_end:
                    self._wait(req, "allreduce", seq, desc, timeout, t0, spec)
                    break
            got = heads.tobytes()
            at = self._rank * SLOT_HEADER
            if got != got[at:at + SLOT_HEADER] * self._size:
                self._mismatch("allreduce", seq, np.frombuffer(got, np.int64).reshape(self._size, SIG_LEN))
            out = recvbuf if recvbuf.ndim == 1 else recvbuf.reshape(-1)
            if widened or op == "avg":
                reduce_rows(np.stack(rows), out, dtype, op)
                return
            uf = _UFUNCS[op]                     # in the dtype itself, rank order: as reduce_rows
            uf(rows[0], rows[1], out)
            for row in rows[2:]:
                uf(out, row, out)
            return
        if widened:
            work = _to_wire(sendbuf, dtype, view)
            self._run("allreduce", seq, desc, timeout,
                      lambda: self._comm.Iallreduce(MPI.IN_PLACE, [work, mtype], mop), (work,), sig)
            if op == "avg":
                work /= np.float32(self._size)
            _from_wire(work, recvbuf, dtype)
            return
        # the common case, inline (the per-call path): _run's steps without its closures
        t0 = time.monotonic()
        if self.check:
            self._agree(sig, "allreduce", seq, desc, timeout, t0)
        r = recvbuf.view(view)
        keep = (sendbuf, recvbuf)
        spin = CHECK_SPIN_S if 2 * recvbuf.nbytes <= SPIN_BYTES else 0.0
        try:
            if sendbuf is recvbuf or _same_memory(sendbuf, recvbuf):
                req = self._comm.Iallreduce(MPI.IN_PLACE, [r, mtype], mop)
            else:
                req = self._comm.Iallreduce([sendbuf.view(view), mtype], [r, mtype], mop)
        except MPI.Exception as e:
            self._start_failed("allreduce", seq, desc, e)
        self._wait(req, "allreduce", seq, desc, timeout, t0, keep, spin)
        if op == "avg":
            recvbuf /= recvbuf.dtype.type(self._size)

    def allgather(self, sendbuf, recvbuf, dtype: str, timeout: float) -> None:
        seq, timeout = self._start("allgather", timeout)
        desc = self._desc(sendbuf.size, dtype)
        s, r = self._bytes(sendbuf), self._bytes(recvbuf)
        if _same_memory(sendbuf, recvbuf):
            s = s.copy()
        sig = signature("allgather", seq, sendbuf.size, dtype)
        if self._folds(s.nbytes):
            nb = s.nbytes
            table = self._gather(sig, "allgather", seq, desc, timeout, time.monotonic(), s)
            r.reshape(self._size, nb)[...] = table[:, SLOT_HEADER:SLOT_HEADER + nb]
            return
        B = self._MPI.BYTE
        self._run("allgather", seq, desc, timeout, lambda: self._comm.Iallgather([s, B], [r, B]), (s, r), sig)

    def reduce_scatter(self, sendbuf, recvbuf, dtype: str, op: str, timeout: float) -> None:
        reduce_plan(dtype, op)
        seq, timeout = self._start("reduce_scatter", timeout)
        view, mtype, mop = self._reduce_args(dtype, op)
        n = sendbuf.size
        counts = chunk_counts(n, self._size)
        desc = self._desc(n, dtype, op)
        if recvbuf.size != counts[self._rank]:
            raise UsageError(f"reduce_scatter: recvbuf has {recvbuf.size} elements, rank {self._rank} "
                             f"gets {counts[self._rank]} of {n}")
        sig = signature("reduce_scatter", seq, n, dtype, op)
        if self._folds(sendbuf.nbytes):
            table = self._gather(sig, "reduce_scatter", seq, desc, timeout, time.monotonic(),
                                 self._bytes(sendbuf))
            off = sum(counts[:self._rank])
            rows = table[:, SLOT_HEADER:SLOT_HEADER + sendbuf.nbytes].view(sendbuf.dtype)
            reduce_rows(rows[:, off:off + counts[self._rank]], recvbuf.reshape(-1), dtype, op)
            return
        widened = _widened(dtype, view)
        if widened:
            s = _to_wire(sendbuf, dtype, view)
            r = np.empty(counts[self._rank], dtype=view)
        else:
            s = sendbuf.view(view)
            if _same_memory(sendbuf, recvbuf):
                s = s.copy()
            r = recvbuf.view(view)
        self._run("reduce_scatter", seq, desc, timeout,
                  lambda: self._comm.Ireduce_scatter([s, mtype], [r, mtype], counts, mop), (s, r), sig)
        if op == "avg":
            r /= r.dtype.type(self._size)
        if widened:
            _from_wire(r, recvbuf, dtype)

    def broadcast(self, buf, root: int, dtype: str, timeout: float) -> None:
        if not (0 <= root < self._size):
            raise UsageError(f"broadcast: root {root} out of range for {self._size} ranks")
        seq, timeout = self._start("broadcast", timeout)
        desc = self._desc(buf.size, dtype, root=root)
        b = self._bytes(buf)
        sig = signature("broadcast", seq, buf.size, dtype, root=root)
        if self._folds(b.nbytes):
            table = self._gather(sig, "broadcast", seq, desc, timeout, time.monotonic(),
                                 b if self._rank == root else None)
            if self._rank != root:
                b[...] = table[root, SLOT_HEADER:SLOT_HEADER + b.nbytes]
            return
        B = self._MPI.BYTE
        self._run("broadcast", seq, desc, timeout, lambda: self._comm.Ibcast([b, B], root), (b,), sig)

    def alltoall(self, sendbuf, recvbuf, dtype: str, timeout: float) -> None:
        if sendbuf.size % self._size:
            raise UsageError(f"alltoall: {sendbuf.size} elements cannot be split into {self._size} equal blocks")
        seq, timeout = self._start("alltoall", timeout)
        desc = self._desc(sendbuf.size, dtype)
        s, r = self._bytes(sendbuf), self._bytes(recvbuf)
        sig = signature("alltoall", seq, sendbuf.size, dtype)
        if self._folds(s.nbytes):
            blk = s.nbytes // self._size
            table = self._gather(sig, "alltoall", seq, desc, timeout, time.monotonic(), s)
            at = SLOT_HEADER + self._rank * blk
            r.reshape(self._size, blk)[...] = table[:, at:at + blk]
            return
        if _same_memory(sendbuf, recvbuf):
            s = s.copy()                  # MPI_IN_PLACE for Ialltoall is not reliable in every MPI
        B = self._MPI.BYTE
        self._run("alltoall", seq, desc, timeout, lambda: self._comm.Ialltoall([s, B], [r, B]), (s, r), sig)

    def barrier(self, timeout: float) -> None:
        seq, timeout = self._start("barrier", timeout)
        if self.check:          # the check's allreduce needs every rank's input: it is a barrier
            self._agree(signature("barrier", seq), "barrier", seq, "", timeout, time.monotonic())
            return
        self._run("barrier", seq, "", timeout, lambda: self._comm.Ibarrier(), ())


__all__ = ["MpiBackend", "ABORT_CODE", "reduce_plan", "to_float32", "from_float32", "abort_default", "check_default",
           "signature", "mismatch_message"]
