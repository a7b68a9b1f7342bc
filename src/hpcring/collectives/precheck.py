"""The pre-collective check (``HPCRING_CHECK_COLLECTIVES=1``): before each collective every rank
allgathers (op, dtype, count, root, seq) as five int64s, and a difference fails on every rank at
once with a table of who called what -- instead of a hang or silently wrong results."""
from __future__ import annotations

from hpcring.collectives.backends import DTYPES
from hpcring.collectives.recorder import Record
from hpcring.config.envvars import get
from hpcring.ranks import ranks_label

_OP_NAMES = ("allreduce", "allreduce_grouped", "allgather", "broadcast", "reduce_scatter", "alltoall", "barrier")


def precheck_default() -> bool:
    """HPCRING_CHECK_COLLECTIVES=1 (or true/yes/on) turns the pre-collective check on."""
    return get("HPCRING_CHECK_COLLECTIVES")


def signature_code(rec: Record) -> tuple[int, int, int, int, int]:
    """(op, dtype, count, root, seq) as integers; -1 for "none"."""
    dtype = DTYPES.index(rec.dtype) if rec.dtype in DTYPES else (-1 if rec.dtype is None else 100 + len(rec.dtype))
    return (_OP_NAMES.index(rec.op), dtype, rec.count, -1 if rec.root is None else rec.root, rec.seq)


def _describe_code(row: tuple) -> str:
    op, dtype, count, root, seq = row
    parts = [f"count={count}"]
    if 0 <= dtype < len(DTYPES):
        parts.append(f"dtype={DTYPES[dtype]}")
    if root >= 0:
        parts.append(f"root={root}")
    return f"{_OP_NAMES[op]}#{seq}({', '.join(parts)})"


def precheck_message(seq: int, rows: list[tuple]) -> str:
    """'pre-collective check before collective #5 failed: ranks 0-4 called ...; rank 5 called ...'."""
    groups: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    parts = [f"{ranks_label(rs)} called {_describe_code(row)}"
             for row, rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    return f"pre-collective check (HPCRING_CHECK_COLLECTIVES) before collective #{seq} failed: " + "; ".join(parts)
