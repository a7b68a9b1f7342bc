"""Sub-communicators: collectives among any subset of a job's ranks.

A group is the same backend created over a *sub-topology* (rank = index among the members,
size = number of members, hosts = the members' hosts), under store keys unique to the group, so
it has its own connections, sequence numbers, flight records and deadlines:

* ring: connections among the members only, to the peers its algorithms use (ring.static_peers),
  shared memory among the members that share a host;
* mpi: ``MPI_Comm_create_group`` on the world communicator, collective over the members only;
* nccl: a new unique id through the store, under the group's keys.

Creation follows torch's rules: every rank of the parent may call :func:`group_session` (a
non-member gets None and does nothing); the members create the group collectively, in the same
order. The store keys are ``hpcring/grp/<digest of the member list>/<n>``, where n counts the
groups over that exact member list this process has created (so two groups over the same ranks
are two groups, and ranks outside the list need not take part).

Failures name *global* ranks and hosts: :func:`hpcring.ranks.globalize` rewrites the backend's
group-local rank numbers in error messages, and the group's flight records carry the group's name and members, so
the watchdog's report diagnoses the group's collective among its members (docs/diagnostics.md).
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

from hpcring.errors import UsageError
from hpcring.collectives.api import Communicator
from hpcring.collectives.choice import BACKENDS, auto_backend
from hpcring.ranks import rank_ranges

_COUNTS: dict[tuple[int, ...], int] = {}
_LOCK = threading.Lock()

# "rank 3 (", "ranks 1, 2 (", "rank(s) 1 (", "this rank (3)": the forms the backends name ranks in


def check_members(ranks: Sequence[int], size: int) -> tuple[int, ...]:
    """The sorted, distinct member list; UsageError for ranks outside 0..size-1 or an empty list."""
    try:
        members = tuple(sorted({int(r) for r in ranks}))
    except (TypeError, ValueError):
        raise UsageError(f"group ranks must be integers, got {ranks!r}") from None
    if not members:
        raise UsageError("a group needs at least one rank")
    bad = [r for r in members if not 0 <= r < size]
    if bad:
        raise UsageError(f"group ranks {bad} are outside the job's ranks 0-{size - 1}")
    return members


def subtopology(topology, members: Sequence[int]):
    """``topology`` seen from inside the group ``members`` (global ranks, sorted): rank is the
    index among the members, hosts the members' hosts. ``local_rank`` / ``local_size`` stay the
    process's (they pick its GPU); ``node_rank`` / ``num_nodes`` count the members' hosts."""
    members = list(members)
    hosts = tuple(topology.hosts[r] for r in members)
    nodes = list(dict.fromkeys(hosts))
    rank = members.index(topology.rank)
    return topology.with_(rank=rank, size=len(members), hosts=hosts, node_rank=nodes.index(hosts[rank]),
                          num_nodes=len(nodes))


def next_key(members: Sequence[int]) -> str:
    """``<digest>/<n>``: the store key part of this process's n-th group over ``members``."""
    members = tuple(members)
    with _LOCK:
        n = _COUNTS[members] = _COUNTS.get(members, 0) + 1
    digest = hashlib.sha256(",".join(map(str, members)).encode()).hexdigest()[:16]
    return f"{digest}/{n}"


def name_of(members: Sequence[int], key: str) -> str:
    """A short readable group name for records and reports: ``group 2 of ranks 0,2``."""
    return f"group {key.rsplit('/', 1)[-1]} of ranks {rank_ranges(list(members))}"


def create_communicator(topology, store, secret, members: Sequence[int], key: str, *, backend: str,
                        timeout: float | None = None, watchdog=None, **options):
    """The group's Communicator on this (member) rank: ``backend`` over :func:`subtopology`."""
    members = tuple(members)
    sub = subtopology(topology, members)
    prefix = f"hpcring/grp/{key}/{backend}"
    if backend == "ring":
        options.setdefault("prefix", prefix)
    elif backend == "nccl":
        options.setdefault("prefix", prefix)
    elif backend == "mpi":
        options.setdefault("group_ranks", members)
        options.setdefault("prefix", prefix)
    return Communicator.create(sub, store, secret, timeout=timeout, backend=backend, watchdog=watchdog,
                               members=members, group=name_of(members, key), **options)


class GroupSession:
    """What a torch process group (or any caller) needs of a session, for one group: ``rank``,
    ``size``, ``members`` and ``communicator(backend="auto", timeout=)`` (created on first ask,
    collectively among the members; one per backend)."""

    def __init__(self, parent, members: tuple[int, ...], key: str) -> None:
        self.parent = parent
        self.members = members
        self.key = key
        self.name = name_of(members, key)
        self.topology = subtopology(parent.topology, members)
        self._comms: dict[str, object] = {}
        # set by the session: called with (self, backend, communicator) as each is created; what
        # it returns is stopped at close (the straggler watcher: diagnostics sit above this layer)
        self.on_communicator = None
        self._watches: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    @property
    def host(self) -> str:
        return self.topology.host

    def communicator(self, backend: str = "auto", *, timeout: float | None = None):
        if backend not in BACKENDS:
            raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if backend == "auto":
            backend = self.parent.default_backend or auto_backend(self.parent.topology)
        with self._lock:
            comm = self._comms.get(backend)
            if comm is None:
                p = self.parent
                options = {"abort_on_timeout": False} if backend == "mpi" and p.watchdog else {}
                comm = self._comms[backend] = create_communicator(
                    p.topology, p.store, p.secret, self.members, self.key, backend=backend, timeout=timeout,
                    watchdog=p.watchdog, **options)
                if self.on_communicator is not None:     # the session's watchers (stragglers)
                    self._watches[backend] = self.on_communicator(self, backend, comm)
        return comm

    def close(self) -> None:
        for watch in self._watches.values():
            if watch is not None:
                watch.stop()
        self._watches.clear()
        for comm in self._comms.values():
            comm.close()
        self._comms.clear()

    def __repr__(self) -> str:
        return f"<hpcring {self.name}: rank {self.rank}/{self.size} (global rank {self.members[self.rank]})>"


def group_session(session, ranks: Sequence[int]) -> GroupSession | None:
    """The group of ``ranks`` (global) of ``session``: a :class:`GroupSession` on members, None on
    the other ranks (torch's rule: every rank may call; non-members take no part)."""
    members = check_members(ranks, session.topology.size)
    if session.topology.rank not in members:
        return None
    return GroupSession(session, members, next_key(members))
