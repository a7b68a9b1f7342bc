"""The one object every layer above bootstrap sees: who am I, who else is there, how to reach them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    hosts: tuple[str, ...]            # host of each rank, in rank order (len == size)
    launcher: str                     # which table matched: slurm, jsrun, lsf, openmpi, pmi, pmix, mvapich, torchrun, local, single
    job_id: str | None = None
    master_addr: str | None = None    # rank 0's address on the chosen interface
    master_port: int | None = None
    interface: str | None = None      # this rank's chosen interface name (may differ between hosts)
    address: str | None = None        # this rank's address on that interface
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # field -> env var it came from

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Distinct hosts in order of first appearance (node rank order)."""
        seen: dict[str, None] = {}
        for h in self.hosts:
            seen.setdefault(h, None)
        return tuple(seen)

    def with_(self, **changes) -> "Topology":
        return replace(self, **changes)
