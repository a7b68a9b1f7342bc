"""Communicator: the user-facing collectives on numpy arrays, torch tensors and CuPy arrays.

Semantics (all ranks call the same collectives in the same order with matching arguments):

* ``out=None`` returns a new array; ``out=x`` works in place; any other ``out`` must have the
  right dtype, element count and be C-contiguous and writable. The result has the type of the
  input (numpy -> numpy, torch -> torch on the input's device, CuPy -> CuPy).
* dtypes: float16, bfloat16, float32, float64, int32, int64, uint8. bfloat16 is 2-byte storage:
  a torch.bfloat16 tensor, an ml_dtypes bfloat16 array, or a uint16 array passed with
  ``dtype="bfloat16"``. ops: sum, prod, min, max, avg (avg only for floating-point dtypes).
* deadlines: every call has one: ``timeout=`` on the call, else the communicator's default
  (``Communicator(timeout=)``, else HPCRING_TIMEOUT, which ``hpcring submit/run --timeout`` sets,
  else 300 s; all resolved by :func:`hpcring.config.envvars.collective_timeout`). A missed deadline
  or a dead peer raises :class:`~hpcring.errors.CollectiveError` naming the op, peer rank and host, and the
  communicator stays failed (every later call raises the first error).
* async: ``*_async`` returns a :class:`Handle`; ops run in submission order on one worker thread
  per communicator (synchronous calls queue behind pending async ones).

Host memory goes to the backend without copies (numpy views, DLPack for torch CPU tensors).
Device memory is staged through host memory for a host backend (ring, mpi). A device backend
(``backend.device == "cuda"``, NCCL) receives device memory without copies: CuPy arrays as flat
views, CUDA torch tensors (and other CUDA DLPack objects) through ``cupy.from_dlpack``; results are
new CuPy arrays / CUDA tensors on the backend's GPU (or ``out``/``x`` itself). Such a call runs on
the caller's current stream on that GPU, captured when the call is made (also for ``*_async``):
torch's current stream when a CUDA torch tensor is involved, else CuPy's. Such calls are
stream-ordered: enqueued in the calling thread, they return without waiting for the GPU (results
are valid in stream order; ``*_async`` handles complete, and done-callbacks run, once the GPU
finished; :meth:`Communicator.synchronize` waits for all), and a poller thread keeps each one's
deadline. numpy inputs on a device backend are staged by the backend and waited for.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpcring.collectives.arrays import active_on, adapt, check_op, check_out, fuse, new_like, store_into, finish
from hpcring.collectives.backends import DTYPES, Backend, chunk_counts
from hpcring.collectives.engine import Completions, Handle, Worker
from hpcring.collectives.execution import Execution
from hpcring.collectives.fastpath import _GENERAL, _KA, _KB, _KG, _KR, _KT, _KZ, ShortPath
from hpcring.collectives.p2p_api import PointToPoint
from hpcring.collectives.precheck import precheck_default
from hpcring.collectives.recorder import FlightRecorder
from hpcring.ranks import globalize
from hpcring.errors import HpcringError, UsageError
from hpcring.config import envvars


_ASYNC_DOC = ("Like :meth:`{}`, returning a :class:`Handle` at once; the arrays must not be touched "
              "until it is done.")


# ---------------------------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------------------------
# the short path: fastpath.py; point-to-point: p2p_api.py; how a call runs: execution.py
class Communicator(ShortPath, PointToPoint, Execution):
    """Collectives over a :class:`~hpcring.collectives.backends.Backend`."""

    def __init__(self, backend: Backend, *, timeout: float | None = None, watchdog=None,
                 members=None, group: str | None = None) -> None:
        self.backend = backend
        self._n = backend.size          # the short path's copy (a backend's size never changes)
        # a group's communicator (hpcring.collectives.groups): the global rank of each member, and
        # the group's name in flight records and reports; None for the job's own communicators
        self.members = tuple(members) if members is not None else None
        self.group = group
        self.timeout = envvars.collective_timeout(timeout)     # finite and > 0, checked there
        self._worker = Worker(f"hpcring-comm:{backend.rank}")
        self.recorder = FlightRecorder(backend.rank, backend.size, backend.name, group=group,
                                       members=self.members)
        self.watchdog = watchdog
        if watchdog is not None:
            watchdog.register(self)
        self.precheck = precheck_default()
        self._ordered = Completions(self) if getattr(backend, "stream_ordered", False) else None

    @classmethod
    def create(cls, topology, store, secret: bytes | str, *, timeout: float | None = None,
               backend: str = "ring", watchdog=None, members=None, group: str | None = None,
               **backend_options) -> "Communicator":
        """Communicator for ``topology`` on ``backend`` ("ring": address exchange through
        ``store``; "mpi": MPI_COMM_WORLD via mpi4py; "nccl": unique id through ``store``).
        ``watchdog`` (:class:`hpcring.diagnostics.watchdog.Watchdog`) turns failures into a
        job-wide report. ``members`` / ``group``: see :mod:`hpcring.collectives.groups`
        (``topology`` is then the group's sub-topology)."""
        if backend == "ring":
            from hpcring.collectives.ring import RingBackend as impl  # deferred: only the chosen backend loads (ring ~25 ms)
        elif backend == "mpi":
            from hpcring.collectives.mpi import MpiBackend as impl  # deferred: only the chosen backend loads (mpi ~15 ms)
        elif backend == "nccl":
            from hpcring.collectives.nccl import NcclBackend as impl  # deferred: only the chosen backend loads (nccl ~5 ms)
        else:
            raise UsageError(f"unknown backend {backend!r}; choose one of ring, mpi, nccl")
        if backend in ("ring", "mpi"):  # they meet in the first collective, under its deadline
            backend_options.setdefault("lazy", True)
        timeout = envvars.collective_timeout(timeout)   # resolved once; backend and communicator get the value
        be = impl.create(topology, store, secret, timeout, **backend_options)
        return cls(be, timeout=timeout, watchdog=watchdog, members=members, group=group)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def error(self) -> str | None:
        """The backend's sticky error; a group's names global ranks."""
        if self.members is None:
            return self.backend.error
        return globalize(self.backend.error, self.members)

    # -- what upper layers may know of the backend (they ask here, not the backend) ----------
    @property
    def backend_name(self) -> str:
        """"ring", "mpi" or "nccl" (flight records, timelines, tables)."""
        return self.backend.name

    @property
    def device(self) -> str:
        """Memory the collectives take without staging: "cpu" (numpy) or "cuda" (CuPy arrays on
        GPU :attr:`device_id`)."""
        return getattr(self.backend, "device", "cpu")

    @property
    def device_id(self) -> int:
        return int(getattr(self.backend, "device_id", 0))

    @property
    def array_module(self):
        """The CuPy module of a "cuda" communicator's buffers; None on a host backend."""
        return getattr(self.backend, "array_module", None)

    @property
    def stream_ordered(self) -> bool:
        """Calls are queued on the caller's stream (NCCL): point-to-point is held for a group."""
        return self._ordered is not None

    def describe(self) -> str | None:
        """The transport in use, one line (the ring's: shared memory or tcp, streams,
        connections); None where the backend does not say."""
        describe = getattr(self.backend, "describe", None)
        return describe() if describe is not None else None

    def close(self, *, keep_backend: bool = False) -> None:
        """Stop this communicator's threads and close its backend (``keep_backend``: leave the
        backend open for its holder: an elastic round's NCCL communicator, shrunk next round)."""
        if self._ordered is not None:
            self._ordered.stop()
        self._worker.stop()
        if not keep_backend:
            self.backend.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- allreduce --------------------------------------------------------------------------
    def _allreduce(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                   dtype: str | None = None, is_async: bool = False):
        """Element-wise ``op`` over all ranks' ``x``; returns ``out`` (a new array when None;
        ``out=x`` for in place). Identical on all ranks."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "allreduce input", writable=out is x, dev=dev)
            check_op(op, a.tag, "allreduce")
            t = self._deadline(timeout)
            if out is x:
                res = a
            elif out is None:
                res = new_like(a, a.shape)
            else:
                res = adapt(out, dtype if a.tag != "bfloat16" else "bfloat16", "allreduce out", writable=True,
                             dev=dev)
                check_out(res, a, a.flat.size, "allreduce")

        def run():
            with active_on(dev):
                self.backend.allreduce(a.flat, res.flat, a.tag, op, t)
                return finish(res, a)
        return self._run(self._record("allreduce", a.tag, a.flat.size, None, t), run, is_async, dev)


    def _allreduce_grouped(self, arrays: Sequence, op: str = "sum", *, timeout: float | None = None,
                           inplace: bool = False, is_async: bool = False):
        """Allreduce many arrays as one fused buffer per dtype (one collective per dtype, in a
        fixed dtype order); returns the results in input order (the inputs themselves when
        ``inplace``)."""
        arrays = list(arrays)
        dev = self._cuda(*arrays)
        with active_on(dev):
            arrs = [adapt(x, None, f"allreduce_grouped input {i}", writable=inplace, dev=dev)
                    for i, x in enumerate(arrays)]
        for a in arrs:
            check_op(op, a.tag, "allreduce_grouped")
        t = self._deadline(timeout)
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrs):
            groups.setdefault(a.tag, []).append(i)

        def run():
            results: list[Any] = [None] * len(arrs)
            with active_on(dev):
                for tag in sorted(groups, key=DTYPES.index):      # same order on every rank
                    idx = groups[tag]
                    fused = fuse([arrs[i] for i in idx], dev)
                    self.backend.allreduce(fused, fused, tag, op, t)
                    pos = 0
                    for i in idx:
                        a = arrs[i]
                        n = a.flat.size
                        r = a if inplace else new_like(a, a.shape)
                        store_into(r, fused[pos:pos + n])
                        results[i] = finish(r, a)
                        pos += n
            return results
        count = sum(a.flat.size for a in arrs)
        tags = "+".join(sorted(groups, key=DTYPES.index))
        return self._run(self._record("allreduce_grouped", tags, count, None, t), run, is_async, dev)

    # -- allgather ------------------------------------------------------------------------
    def _allgather(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None,
                   is_async: bool = False):
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)`` (``out`` may have
        any shape with that many elements)."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "allgather input", writable=False, dev=dev)
            t = self._deadline(timeout)
            shape = (self.size, *a.shape)
            if out is None:
                res = new_like(a, shape)
            else:
                res = adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "allgather out", writable=True,
                             dev=dev)
                check_out(res, a, a.flat.size * self.size, "allgather")

        def run():
            with active_on(dev):
                self.backend.allgather(a.flat, res.flat, a.tag, t)
                return finish(res, a)
        return self._run(self._record("allgather", a.tag, a.flat.size, None, t), run, is_async, dev)

    # -- broadcast ------------------------------------------------------------------------
    def _broadcast(self, x, root: int = 0, *, timeout: float | None = None, dtype: str | None = None,
                   is_async: bool = False):
        """In place: ``x`` on every rank becomes root's ``x`` (same shape and dtype everywhere);
        returns ``x``."""
        if not (0 <= root < self.size):
            raise UsageError(f"broadcast: root {root} out of range for {self.size} ranks")
        dev = self._cuda(x)
        with active_on(dev):
            a = adapt(x, dtype, "broadcast buffer", writable=True, dev=dev)
        t = self._deadline(timeout)

        def run():
            with active_on(dev):
                self.backend.broadcast(a.flat, root, a.tag, t)
                return finish(a, a)
        return self._run(self._record("broadcast", a.tag, a.flat.size, root, t), run, is_async, dev)

    # -- reduce_scatter -------------------------------------------------------------------
    def _reduce_scatter(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                        dtype: str | None = None, is_async: bool = False):
        """This rank's share of the element-wise ``op`` over ranks. When ``x.shape[0]`` is
        divisible by the world size the result has shape ``(x.shape[0] // size, *x.shape[1:])``
        (rank r gets rows r*k .. r*k+k-1); otherwise ``x`` is flattened and rank r gets
        ``len // size + (r < len % size)`` consecutive elements."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "reduce_scatter input", writable=False, dev=dev)
            check_op(op, a.tag, "reduce_scatter")
            t = self._deadline(timeout)
            n = a.flat.size
            mine = chunk_counts(n, self.size)[self.rank]
            if len(a.shape) >= 1 and a.shape[0] % self.size == 0:
                shape = (a.shape[0] // self.size, *a.shape[1:])
            else:
                shape = (mine,)
            if out is None:
                res = new_like(a, shape)
            else:
                res = adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "reduce_scatter out",
                             writable=True, dev=dev)
                check_out(res, a, mine, "reduce_scatter")

        def run():
            with active_on(dev):
                self.backend.reduce_scatter(a.flat, res.flat, a.tag, op, t)
                return finish(res, a)
        return self._run(self._record("reduce_scatter", a.tag, n, None, t), run, is_async, dev)

    # -- alltoall -------------------------------------------------------------------------
    def _alltoall(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None,
                  is_async: bool = False):
        """Block j (of ``size`` equal blocks of the flattened ``x``) goes to rank j; block i of
        the result came from rank i. Result has ``x``'s shape; ``out=x`` works in place."""
        dev = self._cuda(x, out)
        with active_on(dev):
            a = adapt(x, dtype, "alltoall input", writable=out is x, dev=dev)
            t = self._deadline(timeout)
            if a.flat.size % self.size:
                raise UsageError(f"alltoall: {a.flat.size} elements cannot be split into {self.size} equal blocks")
            if out is x:
                res = a
            elif out is None:
                res = new_like(a, a.shape)
            else:
                res = adapt(out, "bfloat16" if a.tag == "bfloat16" else dtype, "alltoall out", writable=True,
                             dev=dev)
                check_out(res, a, a.flat.size, "alltoall")

        def run():
            with active_on(dev):
                self.backend.alltoall(a.flat, res.flat, a.tag, t)
                return finish(res, a)
        return self._run(self._record("alltoall", a.tag, a.flat.size, None, t), run, is_async, dev)

    # -- barrier --------------------------------------------------------------------------
    def _barrier(self, *, timeout: float | None = None, is_async: bool = False):
        """Return once every rank has entered the barrier."""
        t = self._deadline(timeout)
        return self._run(self._record("barrier", None, 0, None, t), lambda: self.backend.barrier(t), is_async)


    # -- the public methods: a synchronous and an ``*_async`` twin of each implementation ----
    # Written out, with the implementation's parameters (shown by help() and IDEs) and docstring:
    # stacks and hang reports read the frame's code name ("in allreduce"). The async one queues
    # the call and returns a :class:`Handle` (device collectives: completed by the GPU).
    def allreduce(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                  dtype: str | None = None):
        # the short path is tried first, without argument repacking
        if self.short_path and dtype is None:
            if self._fast:
                res = self._fast_try(_KA, "allreduce", x, out, op, None, timeout)
                if res is not _GENERAL:
                    return res
            res = (self._allreduce_host(x, op, out, timeout) if self._ordered is None
                   else self._short_device("allreduce", x, op, out, None, timeout))
            if res is not _GENERAL:
                return res
        return self._allreduce(x, op, out, timeout=timeout, dtype=dtype)
    allreduce.__doc__ = _allreduce.__doc__

    def allreduce_async(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                        dtype: str | None = None) -> Handle:
        return self._allreduce(x, op, out, timeout=timeout, dtype=dtype, is_async=True)
    allreduce_async.__doc__ = _ASYNC_DOC.format('allreduce')

    def allreduce_grouped(self, arrays: Sequence, op: str = "sum", *, timeout: float | None = None,
                          inplace: bool = False):
        return self._allreduce_grouped(arrays, op, timeout=timeout, inplace=inplace)
    allreduce_grouped.__doc__ = _allreduce_grouped.__doc__

    def allreduce_grouped_async(self, arrays: Sequence, op: str = "sum", *, timeout: float | None = None,
                                inplace: bool = False) -> Handle:
        return self._allreduce_grouped(arrays, op, timeout=timeout, inplace=inplace, is_async=True)
    allreduce_grouped_async.__doc__ = _ASYNC_DOC.format('allreduce_grouped')

    # the synchronous twins of allgather, broadcast and reduce_scatter, spelled out like
    # allreduce's: on a stream-ordered backend the short path is tried first
    def allgather(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None):
        if self.short_path and dtype is None:
            if self._fast:
                res = self._fast_try(_KG, "allgather", x, out, None, None, timeout)
                if res is not _GENERAL:
                    return res
            res = (self._short_host("allgather", x, None, out, None, timeout) if self._ordered is None
                   else self._short_device("allgather", x, None, out, None, timeout))
            if res is not _GENERAL:
                return res
        return self._allgather(x, out, timeout=timeout, dtype=dtype)
    allgather.__doc__ = _allgather.__doc__

    def allgather_async(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None) -> Handle:
        return self._allgather(x, out, timeout=timeout, dtype=dtype, is_async=True)
    allgather_async.__doc__ = _ASYNC_DOC.format('allgather')

    def broadcast(self, x, root: int = 0, *, timeout: float | None = None, dtype: str | None = None):
        if self.short_path and dtype is None and type(root) is int and 0 <= root < self._n:
            if self._fast:
                res = self._fast_try(_KB, "broadcast", x, None, None, root, timeout)
                if res is not _GENERAL:
                    return res
            res = (self._short_host("broadcast", x, None, None, root, timeout) if self._ordered is None
                   else self._short_device("broadcast", x, None, None, root, timeout))
            if res is not _GENERAL:
                return res
        return self._broadcast(x, root, timeout=timeout, dtype=dtype)
    broadcast.__doc__ = _broadcast.__doc__

    def broadcast_async(self, x, root: int = 0, *, timeout: float | None = None,
                        dtype: str | None = None) -> Handle:
        return self._broadcast(x, root, timeout=timeout, dtype=dtype, is_async=True)
    broadcast_async.__doc__ = _ASYNC_DOC.format('broadcast')

    def reduce_scatter(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                       dtype: str | None = None):
        if self.short_path and dtype is None:
            if self._fast:
                res = self._fast_try(_KR, "reduce_scatter", x, out, op, None, timeout)
                if res is not _GENERAL:
                    return res
            res = (self._short_host("reduce_scatter", x, op, out, None, timeout) if self._ordered is None
                   else self._short_device("reduce_scatter", x, op, out, None, timeout))
            if res is not _GENERAL:
                return res
        return self._reduce_scatter(x, op, out, timeout=timeout, dtype=dtype)
    reduce_scatter.__doc__ = _reduce_scatter.__doc__

    def reduce_scatter_async(self, x, op: str = "sum", out=None, *, timeout: float | None = None,
                             dtype: str | None = None) -> Handle:
        return self._reduce_scatter(x, op, out, timeout=timeout, dtype=dtype, is_async=True)
    reduce_scatter_async.__doc__ = _ASYNC_DOC.format('reduce_scatter')

    # alltoall and barrier: on a host backend the short path is tried first
    def alltoall(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None):
        if self.short_path and dtype is None and self._ordered is None:
            if self._fast:
                res = self._fast_try(_KT, "alltoall", x, out, None, None, timeout)
                if res is not _GENERAL:
                    return res
            res = self._short_host("alltoall", x, None, out, None, timeout)
            if res is not _GENERAL:
                return res
        return self._alltoall(x, out, timeout=timeout, dtype=dtype)
    alltoall.__doc__ = _alltoall.__doc__

    def alltoall_async(self, x, out=None, *, timeout: float | None = None, dtype: str | None = None) -> Handle:
        return self._alltoall(x, out, timeout=timeout, dtype=dtype, is_async=True)
    alltoall_async.__doc__ = _ASYNC_DOC.format('alltoall')

    def barrier(self, *, timeout: float | None = None):
        if self.short_path and self._ordered is None:
            if self._fast:
                res = self._fast_try(_KZ, "barrier", None, None, None, None, timeout)
                if res is not _GENERAL:
                    return res
            res = self._short_host("barrier", None, None, None, None, timeout)
            if res is not _GENERAL:
                return res
        return self._barrier(timeout=timeout)
    barrier.__doc__ = _barrier.__doc__

    def barrier_async(self, *, timeout: float | None = None) -> Handle:
        return self._barrier(timeout=timeout, is_async=True)
    barrier_async.__doc__ = _ASYNC_DOC.format('barrier')

__all__ = ["Communicator", "Handle", "HpcringError"]
