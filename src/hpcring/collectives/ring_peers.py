"""The ring's peer sets: the peers each rank's algorithms use (:func:`static_peers`), a bound
of every rank's connections (:func:`static_bound`), the ranks of each host."""
from __future__ import annotations


def node_layout(hosts, rank: int) -> tuple[list[int], list[int] | None]:
    """(ranks on this rank's host, ranks with this rank's local index on every host in order of
    first appearance, or None when hosts differ in rank count: no two-level allreduce then)."""
    local = [r for r in range(len(hosts)) if hosts[r] == hosts[rank]]
    per_node: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        per_node.setdefault(h, []).append(r)
    if len({len(v) for v in per_node.values()}) != 1:
        return local, None
    return local, [v[local.index(rank)] for v in per_node.values()]


class HostLayout:
    """The ranks of each host, computed once (O(n)); what :func:`node_layout` says of one rank."""

    def __init__(self, hosts) -> None:
        self.per_node: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            self.per_node.setdefault(h, []).append(r)
        self.nodes = list(self.per_node.values())
        self.node_of = {h: i for i, h in enumerate(self.per_node)}
        self.hosts = hosts
        self.uniform = len({len(v) for v in self.nodes}) == 1

    def local(self, rank: int) -> list[int]:
        return self.per_node[self.hosts[rank]]

    def column_neighbours(self, rank: int) -> tuple[int, ...]:
        """The two-level ring's neighbours of ``rank`` (same local index, next/previous host)."""
        if not self.uniform or len(self.nodes) < 2:
            return ()
        i = self.node_of[self.hosts[rank]]
        li = self.nodes[i].index(rank)
        return (self.nodes[(i + 1) % len(self.nodes)][li], self.nodes[(i - 1) % len(self.nodes)][li])


def static_peers(rank: int, size: int, hosts, shm: bool, streams: int = 1,
                 layout: HostLayout | None = None) -> dict[int, int]:
    """The peers ``rank``'s collectives other than alltoall use -> connections to each (``streams``
    for the ring passes' neighbours, 1 for the latency-bound algorithms). Symmetric: q is in
    rank's set iff rank is in q's, with the same count, so both sides of a pair agree without a
    word. Must follow native/: allreduce_ring / allgather_ring / reduce_scatter_ring /
    broadcast_pipeline (r +- 1), broadcast_tree (any root: r +- 2^i), barrier (r +- 2^i),
    allreduce_rd and allreduce_rh (fold r^1 below 2 rem, partners v ^ 2^i), allreduce_direct and
    direct_others.c (every rank, in a job of at most DIRECT_MAX_RANKS = 3: the ring's neighbours), shared memory (the
    host's ranks: the liveness signal) and allreduce_shm's two-level ring (column neighbours)."""
    out: dict[int, int] = {}

    def add(q: int, k: int = 1) -> None:
        q %= size
        if q != rank:
            out[q] = max(out.get(q, 0), k)

    if size < 2:
        return out
    add(rank + 1, streams)
    add(rank - 1, streams)
    d = 2
    while d < size:
        add(rank + d)
        add(rank - d)
        d *= 2
    p = 1
    while p * 2 <= size:
        p *= 2
    rem = size - p
    if rank < 2 * rem and rank % 2 == 0:
        add(rank + 1)                      # folds into its odd partner and sits out
    else:
        v = rank // 2 if rank < 2 * rem else rank - rem
        if rank < 2 * rem:
            add(rank - 1)
        m = 1
        while m < p:
            pv = v ^ m
            add(pv * 2 + 1 if pv < rem else pv + rem)
            m *= 2
    if shm:
        layout = layout or HostLayout(hosts)
        local = layout.local(rank)
        if len(local) > 1:        # shared memory: every host of a uniform job has >= 2 ranks
            for q in local:
                add(q)
            for q in layout.column_neighbours(rank):
                add(q, streams)
    return out


FULL_MESH_MAX_RANKS = 256          # default budget: no limit up to this many ranks ...
DEFAULT_MAX_CONNECTIONS = 48       # ... and this many connections beyond
UNLIMITED = 1 << 20                # (a rank never holds more than (n - 1) x streams)


def static_bound(size: int, layout: HostLayout, shm: bool, streams: int = 1) -> int:
    """At least every rank's static connections (sum of :func:`static_peers` counts), the same
    on every rank and O(log n) once the layout is known: +-1 and +-2^i (translation invariant),
    log2 p + 1 recursive-doubling partners, the largest host's ranks and two column neighbours.
    Alltoall's window width comes from it, so it must not depend on the rank asking."""
    if size < 2:
        return 0
    offs = {d % size for i in range(size.bit_length()) for d in (1 << i, -(1 << i)) if (1 << i) < size} - {0}
    ring = {1 % size, (size - 1) % size} - {0}
    n = len(offs - ring) + len(ring) * streams + (size.bit_length() - 1) + 1
    if shm:
        most = max(len(v) for v in layout.nodes)
        if most > 1:
            n += most - 1 + (2 * streams if layout.uniform and len(layout.nodes) > 1 else 0)
    return n
