"""nccl-tests' output: the rows, their columns and number formats, the footer."""
from __future__ import annotations

from dataclasses import dataclass

from hpcring.bench.data import DTYPES
from hpcring.bench.cases import REDUCING, busbw_factor


@dataclass
class Row:
    size: int          # bytes
    count: int         # elements per rank (see module doc)
    type: str          # nccl-tests type name
    redop: str         # "sum", ... or "none"
    root: int          # broadcast root, else -1
    time_us: float
    algbw: float       # GB/s (1e9 bytes/s)
    busbw: float
    wrong: int


HEADER = ("#       size         count      type   redop    root     time   algbw   busbw #wrong\n"
          "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       ")


def format_header() -> str:
    return HEADER


def _time_str(us: float) -> str:
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def format_row(r: Row) -> str:
    """One line exactly like nccl-tests' out-of-place columns."""
    return (f"{r.size:12d}  {r.count:12d}  {r.type:>8s}  {r.redop:>6s}  {r.root:6d}"
            f"  {_time_str(r.time_us):>7s}  {r.algbw:6.2f}  {r.busbw:6.2f}  {r.wrong:5d}")


def avg_busbw(rows: list[Row]) -> float:
    return sum(r.busbw for r in rows) / len(rows) if rows else 0.0


def format_footer(rows: list[Row]) -> str:
    wrong = sum(r.wrong for r in rows)
    return (f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}\n"
            f"# Avg bus bandwidth    : {avg_busbw(rows):.6g} \n#")


def make_row(collective: str, dtype: str, op: str, root: int, n: int, size: int, count: int,
             seconds: float, wrong: int) -> Row:
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return Row(size=size, count=count, type=DTYPES[dtype][0], redop=op if collective in REDUCING else "none",
               root=root if collective == "broadcast" else -1, time_us=seconds * 1e6, algbw=algbw,
               busbw=algbw * busbw_factor(collective, n), wrong=int(wrong))
