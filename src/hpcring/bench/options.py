"""What a benchmark run is asked for: sizes, dtype, op, iterations, memory; checked up front."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from hpcring.config.text import shown
from hpcring.errors import UsageError
from hpcring.fsutil import check_output_path
from hpcring.bench.data import is_float, normalize_dtype
from hpcring.bench.cases import COLLECTIVES, MEMORIES, REDUCING
from hpcring.collectives.dtypes import OPS
BACKENDS = ("auto", "ring", "mpi", "nccl")

# Bounds that keep one typo from running for hours or until memory runs out: the largest message
# (-e 99999999999999999999 used to double sizes until allocation failed), the number of sizes
# (-f 1.0000001 would make millions) and the step factor.
MAX_BYTES = 8 << 30
MAX_SIZES = 256
MAX_FACTOR = 1024.0
BUFFERS_PER_RANK = 3          # input, output and the expected result, each up to the largest size

_SIZE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<unit>[KMG]?)(?:I?B)?", re.ASCII)


def parse_size(text: str | int, what: str = "size") -> int:
    """``8``, ``4K``, ``1M``, ``2G``, ``1.5M`` (binary multiples, like nccl-tests) -> bytes, at most
    :data:`MAX_BYTES`. ``what`` names the flag in errors."""
    hint = f"give bytes like 8, 64K, 16M or 1G (at most {MAX_BYTES >> 30}G)"
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise UsageError(f"{what}: bad size {text!r}", hint=hint)
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(text.strip().upper()) if len(text) <= 64 else None
        if not m:
            raise UsageError(f"{what}: bad size {shown(text)} (a number of bytes with an optional K, M or G)",
                             hint=hint)
        value = int(float(m["num"]) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m["unit"]])
    if value < 0 or value > MAX_BYTES:
        raise UsageError(f"{what}: size {shown(text)} is out of range (0 to {MAX_BYTES} bytes)", hint=hint)
    return value


def size_list(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """nccl-tests -b/-e/-f: minbytes, minbytes*f, ... up to maxbytes (inclusive); at most
    :data:`MAX_SIZES` sizes."""
    if maxbytes < minbytes:
        raise UsageError(f"--maxbytes {maxbytes} is smaller than --minbytes {minbytes}",
                         hint="swap them, or raise --maxbytes")
    if not (isinstance(factor, (int, float)) and math.isfinite(factor)) or factor > MAX_FACTOR or (
            factor <= 1 and maxbytes != minbytes):
        raise UsageError(f"--stepfactor must be a finite number > 1 and <= {MAX_FACTOR:g}, got {factor}",
                         hint="2 doubles the size each step (nccl-tests' -f 2)")
    out, s = [], minbytes
    while s <= maxbytes:
        out.append(int(s))
        if len(out) > MAX_SIZES:
            raise UsageError(f"--minbytes {minbytes} to --maxbytes {maxbytes} in steps of x{factor:.10g} is more than "
                             f"{MAX_SIZES} sizes", hint="use a larger --stepfactor or a narrower range")
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
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown --backend {shown(self.backend)}; choose one of {', '.join(BACKENDS)}")
        if self.collective not in COLLECTIVES:
            raise UsageError(f"unknown --collective {shown(self.collective)}; choose one of {', '.join(COLLECTIVES)}")
        self.dtype = normalize_dtype(self.dtype)
        if self.op not in OPS:
            raise UsageError(f"unknown --op {shown(self.op)}; choose one of {', '.join(OPS)}")
        if self.op == "avg" and not is_float(self.dtype) and self.collective in REDUCING:
            raise UsageError(f"op avg needs a floating-point dtype, not {self.dtype}")
        if self.iters < 1 or self.warmup < 0:
            raise UsageError("--iters must be >= 1 and --warmup >= 0")
        if self.memory not in MEMORIES:
            raise UsageError(f"unknown --memory {shown(self.memory)}; choose one of {', '.join(MEMORIES)}")
        size_list(self.minbytes, self.maxbytes, self.factor)
        if self.json:
            check_output_path(self.json, "--json")
        if self.plot:
            check_output_path(self.plot, "--plot")
            require_matplotlib()
            check_plot_format(self.plot)
        return self


def check_plot_format(path: str) -> None:
    """matplotlib can write ``path``'s suffix (none: PNG), checked before the run, not after it."""
    from matplotlib.figure import Figure
    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix[1:].lower()
    if suffix and suffix not in formats:
        raise UsageError(f"--plot {shown(path)}: matplotlib cannot write .{suffix} files",
                         hint=f"use one of {', '.join('.' + f for f in sorted(formats))}")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint="pip install matplotlib, or drop --plot (--json keeps every number)") from None
