"""Slurm's task layout: tasks per node (``2(x3),1``) and which node each rank is on.

Pure functions, standard library only; launcher_reading.py checks a step's variables with them.
"""
from __future__ import annotations

import re

_TPN_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?\Z")


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node ``2(x3),1`` -> ``[2, 2, 2, 1]``; ValueError if malformed."""
    counts: list[int] = []
    for item in text.split(","):
        m = _TPN_ITEM.match(item.strip())
        if not m:
            raise ValueError(f"bad item {item!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def block(counts: list[int]) -> list[int]:
    """Node index of each rank, block distribution: fill node 0, then node 1, ..."""
    return [n for n, c in enumerate(counts) for _ in range(c)]


def cyclic(counts: list[int]) -> list[int]:
    """Node index of each rank, cyclic distribution: one task per node per round."""
    out: list[int] = []
    for rnd in range(max(counts, default=0)):
        out.extend(n for n, c in enumerate(counts) if c > rnd)
    return out
