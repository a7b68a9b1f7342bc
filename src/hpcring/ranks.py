"""How ranks are written in every message: ``rank 3``, ``ranks 0-2,5``, with their hosts.

One module so the hang report, the doctor, the bootstrap errors, the stacks summary and the
submit verdict name ranks the same way. A leaf: it imports nothing of hpcring's but the hostlist
compressor, on use.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from hpcring.errors import HpcringError

UNKNOWN_HOSTS = ("", "?")       # what launcher tables put where a rank's host is not known


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 4]`` -> ``"0-2,4"`` (sorted, duplicates dropped)."""
    rs = sorted(set(ranks))
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def expand_ranges(text, size: int | None = None) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``: the inverse of :func:`rank_ranges`. With ``size``, every
    rank must lie below it (ValueError otherwise: the text came from another process)."""
    out: list[int] = []
    for part in filter(None, str(text).split(",")):
        lo, _, hi = part.partition("-")
        lo_i, hi_i = int(lo), int(hi or lo)
        if size is not None and not 0 <= lo_i <= hi_i < size:
            raise ValueError(f"rank range {part!r} outside 0..{size - 1}")
        out.extend(range(lo_i, hi_i + 1))
    return out


def ranks_label(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0-2,5``."""
    return f"{'rank' if len(set(ranks)) == 1 else 'ranks'} {rank_ranges(ranks)}"


def hosts_of(ranks: Iterable[int], hosts: Sequence[str], *, compress: bool = False) -> str:
    """The distinct hosts of ``ranks`` (by rank index into ``hosts``): sorted and comma-separated,
    or in hostlist syntax (``node[1-3]``) with ``compress``."""
    hs = sorted({hosts[r] for r in ranks if r < len(hosts)})
    if compress and hs:
        from hpcring.hostlist import compress as to_hostlist  # deferred: hostlist (~2.5 ms) off the CMD's start (rank_site)
        try:
            return to_hostlist(hs)
        except HpcringError:
            pass
    return ", ".join(hs)


def who(ranks: Sequence[int], hosts: Sequence[str], *, compress: bool = False) -> str:
    """``ranks 0-2 (node1, node2)``."""
    return f"{ranks_label(ranks)} ({hosts_of(ranks, hosts, compress=compress)})"


def each_on_host(ranks: Sequence[int], hosts: Sequence[str], limit: int = 16) -> str:
    """``rank 3 on node2, rank 5 (host unknown)``, at most ``limit`` of them, then ``and N more``."""
    def one(r: int) -> str:
        host = hosts[r] if r < len(hosts) and hosts[r] not in UNKNOWN_HOSTS else None
        return f"rank {r} on {host}" if host else f"rank {r} (host unknown)"
    text = ", ".join(one(r) for r in ranks[:limit])
    return text + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def runs(values: Sequence) -> list[tuple[int, int, object]]:
    """Runs of consecutive ranks with equal values: ``[(first, last, value), ...]``."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i - 1, values[start]))
            start = i
    return out


# the rank numbers a collective's message names: "rank 3 (host)", "ranks 1, 2 (a, b)", "ranks 0-2,5
# (...)", "rank(s) 1 (h)", and "this rank (0)"
_RANKS = re.compile(r"\b(rank\(s\) |ranks? )(\d+(?:-\d+)?(?:,\s?\d+(?:-\d+)?)*)(?= \()")
_THIS = re.compile(r"\bthis rank \((\d+)\)")


def globalize(text: str | None, members: Sequence[int] | None) -> str | None:
    """``text`` with the group-local rank numbers it names replaced by global ranks (a group's
    members, in group rank order): a group's errors name the job's ranks."""
    if not text or members is None:
        return text

    def g(n: str) -> str:
        i = int(n)
        return str(members[i]) if 0 <= i < len(members) else n
    def sub(m) -> str:
        spec = m.group(2)
        if "-" not in spec and ", " in spec or spec.isdigit():
            return m.group(1) + ", ".join(g(x) for x in spec.split(", "))
        local = [i for part in spec.split(",") for a, _, b in [part.strip().partition("-")]
                 for i in range(int(a), int(b or a) + 1)]
        return m.group(1) + rank_ranges([int(g(str(i))) for i in local])
    text = _RANKS.sub(sub, text)
    text = _THIS.sub(lambda m: f"this rank ({g(m.group(1))})", text)
    return text
