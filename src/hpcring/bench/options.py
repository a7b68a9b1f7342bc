"""What a benchmark run is asked for: sizes, dtype, op, iterations, memory; checked up front."""
from __future__ import annotations

from dataclasses import dataclass


from hpcring.errors import UsageError
from hpcring.bench.data import is_float, normalize_dtype
from hpcring.bench.cases import COLLECTIVES, MEMORIES, REDUCING


OPS = ("sum", "prod", "min", "max", "avg")


def parse_size(text: str | int) -> int:
    """``8``, ``4K``, ``1M``, ``2G``, ``1.5M`` (binary multiples, like nccl-tests) -> bytes."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in "KMG" else t)
    except ValueError:
        raise UsageError(f"bad size {text!r}: expected bytes like 8, 64K, 16M, 1G") from None
    if value < 0:
        raise UsageError(f"bad size {text!r}: negative")
    return int(value * mult)


def size_list(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """nccl-tests -b/-e/-f: minbytes, minbytes*f, ... up to maxbytes (inclusive)."""
    if maxbytes < minbytes:
        raise UsageError(f"max size {maxbytes} is smaller than min size {minbytes}")
    if factor <= 1 and maxbytes != minbytes:
        raise UsageError(f"step factor must be > 1, got {factor}")
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(int(s))
        if factor <= 1 or s == 0:
            if s == 0 and maxbytes > 0 and factor > 1:   # 0, then continue from 1 element's worth
                s = 1
                continue
            break
        s = s * factor
    return out


@dataclass
class BenchOptions:
    collective: str = "allreduce"
    backend: str = "auto"
    minbytes: int = 8
    maxbytes: int = 64 << 20
    factor: float = 2
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    iters: int = 20
    warmup: int = 5
    seed: int = 0
    timeout: float | None = None
    json: str | None = None
    plot: str | None = None
    memory: str = "auto"       # device | host | auto (device on a GPU backend, as nccl-tests)

    def check(self) -> "BenchOptions":
        if self.collective not in COLLECTIVES:
            raise UsageError(f"unknown collective {self.collective!r}; choose one of {', '.join(COLLECTIVES)}")
        self.dtype = normalize_dtype(self.dtype)
        if self.op not in OPS:
            raise UsageError(f"unknown op {self.op!r}; choose one of {', '.join(OPS)}")
        if self.op == "avg" and not is_float(self.dtype) and self.collective in REDUCING:
            raise UsageError(f"op avg needs a floating-point dtype, not {self.dtype}")
        if self.iters < 1 or self.warmup < 0:
            raise UsageError("--iters must be >= 1 and --warmup >= 0")
        if self.memory not in MEMORIES:
            raise UsageError(f"unknown --memory {self.memory!r}; choose one of {', '.join(MEMORIES)}")
        size_list(self.minbytes, self.maxbytes, self.factor)
        if self.plot:
            require_matplotlib()
        return self


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint="pip install matplotlib, or drop --plot (--json keeps every number)") from None
