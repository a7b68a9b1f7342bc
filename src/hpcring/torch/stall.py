"""The stall inspector: operation names queued on some ranks and not on others for longer than
the deadline (``HPCRING_TIMEOUT``). When any rank flags a stall in a negotiation, every rank of the
set exchanges its queued names (two allgathers, in the same cycle everywhere) and fails its own
unmatched operations older than half the deadline, with one message naming each tensor and the ranks that have / lack it; the
engine goes on (Horovod warns, then shuts down; here the stalled operations fail, the rest runs).
"""
from __future__ import annotations

import numpy as np

from hpcring.ranks import rank_ranges
from hpcring.torch.exceptions import StallError


def _ranks(rs, members) -> str:
    g = [members[r] for r in rs] if members else list(rs)
    return f"{'rank' if len(g) == 1 else 'ranks'} {rank_ranges(g)}"


def inspect(comm, batch: list, timeout: float, members=None) -> tuple[StallError | None, set[str]]:
    """(the error for this rank's stalled operations or None, names not queued on every rank)."""
    size = comm.size
    text = "\n".join(e.name for e in batch).encode()
    lens = comm.allgather(np.array([len(text)], dtype=np.int64), timeout=timeout).reshape(-1)
    buf = np.zeros(int(lens.max()) or 1, dtype=np.uint8)
    buf[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    allnames = comm.allgather(buf, timeout=timeout).reshape(size, -1)
    have: dict[str, list[int]] = {}
    for r in range(size):
        for n in bytes(allnames[r, :lens[r]]).decode(errors="replace").split("\n"):
            if n:
                have.setdefault(n, []).append(r)
    lines, partial = [], set()
    for n, rs in sorted(have.items()):
        if len(rs) < size:
            partial.add(n)
            missing = [r for r in range(size) if r not in rs]
            lines.append(f"'{n}' submitted by {_ranks(rs, members)}, not by {_ranks(missing, members)}")
    if not lines:
        return None, partial
    err = StallError(f"hpcring.torch: operation names do not match across ranks after {timeout:.0f} s "
                     f"(HPCRING_TIMEOUT): " + "; ".join(lines[:8]) + (" ..." if len(lines) > 8 else ""),
                     hint="every rank must submit the same named operations (hvd.allreduce(..., name=...)); "
                          "check rank-dependent branches")
    return err, partial
