"""Horovod's process sets: collectives among a subset of the ranks, on hpcring's sub-communicators
(:mod:`hpcring.collectives.groups`). Each registered set has its own engine on its members (its
own communicator, negotiation, response cache and fusion), so operations of different sets run
independently, and the timeline shows each operation's set.

* static: ``hvd.init(process_sets=[hvd.ProcessSet([0, 1]), ...])`` registers them at init;
* dynamic: ``hvd.add_process_set([0, 2])`` / ``hvd.remove_process_set(ps)``, called by every rank
  in the same order (as Horovod requires), also ranks that are not members.

As in Horovod, ``root_rank`` of a broadcast on a set is a *global* rank, and results are in the
set's rank order (``ps.rank()`` is the index there).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from hpcring.torch import state
from hpcring.torch.engine import Engine
from hpcring.torch.exceptions import InvalidArgumentError

_LOCK = threading.Lock()


class ProcessSet:
    """A set of global ranks. Registered (``process_set_id`` set) by ``init`` or add_process_set."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm = None

    def __init__(self, ranks_or_comm) -> None:
        if hasattr(ranks_or_comm, "Get_group"):
            raise InvalidArgumentError("hpcring.torch: ProcessSet from an MPI communicator is not supported",
                                       hint="pass the list of global ranks")
        try:
            self.ranks = sorted({int(r) for r in ranks_or_comm})
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"ProcessSet: ranks must be integers, got {ranks_or_comm!r}") from None
        self.process_set_id = None
        self._engine = None
        self._group = None

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (-1 when not a member), None when not registered."""
        if self.process_set_id is None:
            return None
        me = state.session().topology.rank
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        if self.process_set_id is None:
            return None
        return state.session().topology.rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registry: dict[int, ProcessSet] = {}
_next_id = [1]


def setup_global(size: int, engine) -> None:
    global_process_set.ranks = list(range(size))
    global_process_set.process_set_id = 0
    global_process_set._engine = engine
    _registry.clear()
    _registry[0] = global_process_set
    _next_id[0] = 1


def engine_for(process_set):
    """The engine that runs operations of ``process_set`` on this rank (ValueError if it cannot)."""
    if process_set is None or process_set is global_process_set:
        return state.engine()
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None or _registry.get(process_set.process_set_id) is not process_set:
        raise InvalidArgumentError(f"{process_set} is not registered",
                                   hint="pass it to hvd.init(process_sets=[...]) or hvd.add_process_set()")
    if process_set._engine is None:
        raise InvalidArgumentError(f"rank {state.session().topology.rank} is not a member of {process_set}",
                                   hint="only the set's ranks may run its operations")
    return process_set._engine


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (every rank calls, in the same order) and return it."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    glob = state.engine()
    size = glob.size
    with _LOCK:
        if ps.process_set_id is not None:
            raise InvalidArgumentError(f"{ps} is already registered")
        if not ps.ranks or any(not 0 <= r < size for r in ps.ranks):
            raise InvalidArgumentError(f"ProcessSet ranks {ps.ranks} must be a non-empty subset of 0-{size - 1}")
        for other in _registry.values():
            if other.ranks == ps.ranks:
                raise InvalidArgumentError(f"a process set with ranks {ps.ranks} exists already: {other}")
        ps.process_set_id = _next_id[0]
        _next_id[0] += 1
        _registry[ps.process_set_id] = ps
    group = state.session().group(ps.ranks)
    if group is not None:
        ps._group = group
        comm = group.communicator(glob.backend if glob.backend in ("ring", "mpi", "nccl") else "auto",
                                  timeout=glob.timeout)
        ps._engine = Engine(comm, timeline=glob.timeline, pset_id=ps.process_set_id, members=list(ps.ranks))
        ps._engine.threshold, ps._engine.cycle_s = glob.threshold, glob.cycle_s
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank calls); False for the global set or an unknown one."""
    if process_set is global_process_set or not isinstance(process_set, ProcessSet):
        return False
    with _LOCK:
        if _registry.get(process_set.process_set_id) is not process_set:
            return False
        del _registry[process_set.process_set_id]
    _close(process_set)
    process_set._invalidate()
    return True


def _close(ps: ProcessSet) -> None:
    eng, group = ps._engine, ps._group
    ps._engine = ps._group = None
    if eng is not None:
        eng.shutdown()
    if group is not None:
        try:
            group.close()
        except Exception:  # noqa: BLE001 - closing a failed group must not mask the removal
            pass


def shutdown_all() -> None:
    """Stop every set's engine (at hvd.shutdown)."""
    for pid, ps in list(_registry.items()):
        if pid != 0:
            _close(ps)
            ps._invalidate()
    _registry.clear()
    global_process_set._engine = None
