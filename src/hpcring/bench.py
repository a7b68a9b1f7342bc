"""nccl-tests-style collective benchmark with a correctness check in every run (``hpcring bench``).

Where it runs:
  * inside any launcher, as a rank (``hpcring run -- hpcring bench ...``, ``srun``, ``mpirun``, or a
    script under ``hpcring submit`` that calls :func:`run_as_rank`): every rank benchmarks, rank 0
    prints;
  * standalone (no launcher around it): :func:`bench_main` spawns ``--ranks`` local ranks itself
    through :func:`hpcring.launch.run` (local backend env) and prints rank 0's table untagged.

Columns follow nccl-tests (out-of-place only): ``size`` is the bytes of the largest buffer of the
call (allgather: the gathered output; reduce_scatter: the input; alltoall: one rank's buffer),
``count`` the elements per rank (allgather/reduce_scatter: one rank's share; alltoall: per peer),
``time`` the mean of ``iters`` timed calls on the slowest rank (after ``warmup`` calls and a barrier),
``algbw = size / time``, ``busbw = algbw * factor`` with factor allreduce 2(n-1)/n; allgather,
reduce_scatter, alltoall (n-1)/n; broadcast 1.

Correctness: rank r's input is a deterministic pattern ``G_r`` of small integers with period 1021
elements (from the seed and r), so every rank can compute the expected result of any collective
for every rank without communication; ``#wrong`` is the number of elements, summed over ranks,
that differ from it (exact comparison; ``avg`` within one rounding of the dtype). Integer-valued
data keep float16/bfloat16 sums exact, so the check is exact for them too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hpcring.errors import UsageError

OPS = ("sum", "prod", "min", "max", "avg")
# name -> (nccl-tests type name, numpy storage dtype)
DTYPES = {"float32": ("float", np.float32), "float64": ("double", np.float64), "float16": ("half", np.float16),
          "bfloat16": ("bfloat16", np.uint16), "int32": ("int32", np.int32), "int64": ("int64", np.int64),
          "uint8": ("uint8", np.uint8)}
DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
                 "int": "int32", "fp32": "float32", "fp64": "float64", "fp16": "float16"}
PERIOD = 1021          # the data pattern's period in elements (prime: no block size lines up with it)
ENV_TABLE = "HPCRING_BENCH_TABLE"   # set by the standalone parent: rank 0 writes its lines there


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``n`` ranks."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return _spec(collective).factor(n)


def _spec(collective: str) -> "Collective":
    try:
        return TABLE[collective]
    except KeyError:
        raise UsageError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}") from None


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


def normalize_dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return name


def is_float(dtype: str) -> bool:
    return dtype in ("float32", "float64", "float16", "bfloat16")


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


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
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


def counts_for(collective: str, nbytes: int, itemsize: int, n: int) -> tuple[int, int, int]:
    """(total elements of the largest buffer, the printed per-rank count, the printed size in bytes)."""
    total = nbytes // itemsize
    if _spec(collective).shares:
        total -= total % n
        return total, total // n, total * itemsize
    return total, total, total * itemsize


# ---------------------------------------------------------------------------------------------
# deterministic data and expected results
# ---------------------------------------------------------------------------------------------
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded[nan] = 0x7FC0
    return rounded


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float64/int64 values -> the dtype's storage (bfloat16 as uint16 bits; integers wrap)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(values.astype(np.float32))
    if is_float(dtype):
        return values.astype(DTYPES[dtype][1])
    return values.astype(np.int64).astype(DTYPES[dtype][1])    # wraps like the integer arithmetic


def as_values(storage: np.ndarray, dtype: str) -> np.ndarray:
    """Storage -> float64 (floats) or int64 (integers) values."""
    if dtype == "bfloat16":
        return bf16_bits_to_f32(storage).astype(np.float64)
    return storage.astype(np.float64 if is_float(dtype) else np.int64)


def rank_pattern(rank: int, dtype: str, op: str = "sum", seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input pattern (PERIOD elements, storage dtype). Small integers: sums of up to
    thousands of ranks stay exact in float16/bfloat16; for prod only -1, 1 and 2 (exact powers of 2)."""
    rng = np.random.default_rng([seed, rank, 0xBE7C])
    if op == "prod":
        vals = rng.choice(np.array([-1, 1, 1, 2]), PERIOD)
    else:
        vals = rng.integers(-4, 5, PERIOD)
    if dtype == "uint8" and op != "prod":
        vals = vals + 4                        # 0..8 keeps min/max meaningful without wrapping
    return to_storage(vals.astype(np.float64 if is_float(dtype) else np.int64), dtype)


def reduce_patterns(patterns: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """The expected elementwise reduction of the ranks' patterns, in storage dtype."""
    if not is_float(dtype):                    # integer arithmetic in the dtype itself: wraps like the backend
        acc = patterns[0].copy()
        for p in patterns[1:]:
            if op == "sum":
                acc = acc + p
            elif op == "prod":
                acc = acc * p
            elif op == "min":
                acc = np.minimum(acc, p)
            elif op == "max":
                acc = np.maximum(acc, p)
            else:
                raise UsageError(f"op {op} is not defined for {dtype}")
        return acc.astype(patterns[0].dtype)
    vals = np.stack([as_values(p, dtype) for p in patterns])
    red = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}[op](vals, axis=0)
    return to_storage(red, dtype)


def tile(pattern: np.ndarray, offset: int, length: int) -> np.ndarray:
    """Elements ``[offset, offset + length)`` of the infinite periodic repetition of ``pattern``."""
    if length <= 0:
        return pattern[:0].copy()
    return np.resize(np.roll(pattern, -(offset % len(pattern))), length)


def count_wrong(got: np.ndarray, want: np.ndarray, dtype: str, op: str = "sum") -> int:
    """Elements of ``got`` that differ from ``want`` (storage arrays of the same length). Exact, except
    ``avg`` which may be off by one rounding of the dtype (the backend divides in its own precision)."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.size != want.size:
        raise ValueError(f"size mismatch: got {got.size} elements, want {want.size}")
    if op == "avg" and is_float(dtype):
        g, w = as_values(got, dtype), as_values(want, dtype)
        eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}[dtype]
        bad = ~np.isclose(g, w, rtol=2 * eps, atol=0) & ~(np.isnan(g) & np.isnan(w))
        return int(np.count_nonzero(bad))
    if is_float(dtype) and dtype != "bfloat16":
        return int(np.count_nonzero((got != want) & ~(np.isnan(got) & np.isnan(want))))
    return int(np.count_nonzero(got != want))


@dataclass
class Case:
    """One benchmark point on one rank: ``run()`` is timed, ``check()`` returns this rank's #wrong."""
    run: Callable[[], object]
    check: Callable[[], int]
    buffers: list = field(default_factory=list)


def _sentinel(shape, dtype: str) -> np.ndarray:
    st = DTYPES[dtype][1]
    if dtype == "bfloat16":
        return np.full(shape, 0x7FC0, np.uint16)            # NaN
    if is_float(dtype):
        return np.full(shape, np.nan, st)
    return np.full(shape, 77, st)


MEMORIES = ("auto", "device", "host")


def device_module(comm, memory: str):
    """CuPy when the buffers live on the GPU: ``memory`` "device", or "auto" on a GPU backend
    (nccl-tests times device buffers); None for host (numpy) buffers, which a GPU backend stages."""
    on_gpu = getattr(comm.backend, "device", "cpu") == "cuda"
    if memory == "host" or (memory == "auto" and not on_gpu):
        return None
    if not on_gpu:
        raise UsageError(f"--memory device needs a GPU backend (nccl); backend {comm.backend.name} works on host memory")
    return comm.backend.array_module


def memory_label(comm, memory: str) -> str:
    xp = device_module(comm, memory)
    if xp is not None:
        return f"device (CuPy arrays on GPU {getattr(comm.backend, 'device_id', 0)})"
    if getattr(comm.backend, "device", "cpu") == "cuda":
        return "host (numpy, staged through the GPU by the backend: not what nccl-tests measures)"
    return "host (numpy)"


@dataclass
class _Point:
    """What every case builder gets: the communicator, the per-rank patterns, the point's size,
    and how buffers reach the memory under test (``put``) and come back for the check (``get``)."""
    comm: object
    pat: list
    dtype: str
    op: str
    root: int
    total: int
    put: Callable
    get: Callable

    @property
    def dt(self):             # dtype= for the call: only bfloat16 needs saying (uint16 storage)
        return "bfloat16" if self.dtype == "bfloat16" else None

    @property
    def mine(self):
        return self.pat[self.comm.rank]


def _allreduce(k: _Point) -> Case:
    x, out = k.put(tile(k.mine, 0, k.total)), k.put(_sentinel(k.total, k.dtype))
    want = lambda: tile(reduce_patterns(k.pat, k.op, k.dtype), 0, k.total)  # noqa: E731
    return Case(lambda: k.comm.allreduce(x, op=k.op, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype, k.op), [x, out])


def _reduce_scatter(k: _Point) -> Case:
    per, rank = k.total // k.comm.size, k.comm.rank
    x, out = k.put(tile(k.mine, 0, k.total)), k.put(_sentinel(per, k.dtype))
    want = lambda: tile(reduce_patterns(k.pat, k.op, k.dtype), rank * per, per)  # noqa: E731
    return Case(lambda: k.comm.reduce_scatter(x, op=k.op, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype, k.op), [x, out])


def _allgather(k: _Point) -> Case:
    per = k.total // k.comm.size
    x, out = k.put(tile(k.mine, 0, per)), k.put(_sentinel(k.comm.size * per, k.dtype))
    want = lambda: np.concatenate([tile(p, 0, per) for p in k.pat]) if per else k.get(out)[:0]  # noqa: E731
    return Case(lambda: k.comm.allgather(x, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype), [x, out])


def _alltoall(k: _Point) -> Case:
    per, rank = k.total // k.comm.size, k.comm.rank
    x, out = k.put(tile(k.mine, 0, k.total)), k.put(_sentinel(k.total, k.dtype))
    # rank q's block for this rank is elements [rank*per, (rank+1)*per) of q's input
    want = lambda: np.concatenate([tile(p, rank * per, per) for p in k.pat]) if per else k.get(out)[:0]  # noqa: E731
    return Case(lambda: k.comm.alltoall(x, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype), [x, out])


def _broadcast(k: _Point) -> Case:
    buf = k.put(tile(k.mine, 0, k.total))

    def check() -> int:     # fresh buffers for the checked call: non-roots start from the sentinel
        fresh = tile(k.mine, 0, k.total) if k.comm.rank == k.root else _sentinel(k.total, k.dtype)
        buf[...] = k.put(fresh)
        k.comm.broadcast(buf, root=k.root, dtype=k.dt)
        return count_wrong(k.get(buf), tile(k.pat[k.root], 0, k.total), k.dtype)
    return Case(lambda: k.comm.broadcast(buf, root=k.root, dtype=k.dt), check, [buf])


@dataclass(frozen=True)
class Collective:
    """One collective as nccl-tests treats it: its bus-bandwidth factor for n ranks, whether it
    reduces (has a redop), whether the size is split into n shares (count printed per share),
    and the builder of its buffers, timed call and check."""
    factor: Callable[[int], float]
    reducing: bool
    shares: bool
    build: Callable[[_Point], Case]


TABLE: dict[str, Collective] = {
    "allreduce": Collective(lambda n: 2.0 * (n - 1) / n, True, False, _allreduce),
    "allgather": Collective(lambda n: (n - 1) / n, False, True, _allgather),
    "broadcast": Collective(lambda n: 1.0, False, False, _broadcast),
    "reduce_scatter": Collective(lambda n: (n - 1) / n, True, True, _reduce_scatter),
    "alltoall": Collective(lambda n: (n - 1) / n, False, True, _alltoall),
}
COLLECTIVES = tuple(TABLE)
REDUCING = tuple(c for c, spec in TABLE.items() if spec.reducing)


def make_case(comm, collective: str, dtype: str, op: str, root: int, total: int, seed: int = 0,
              xp=None) -> Case:
    """Buffers, the timed call and its check for this rank (``total``: elements of the largest
    buffer). ``xp`` (CuPy): the buffers live on the GPU; checks copy them back."""
    pat = [rank_pattern(r, dtype, op, seed) for r in range(comm.size)]
    put = (lambda a: a) if xp is None else xp.asarray  # noqa: E731
    get = (lambda a: a) if xp is None else xp.asnumpy  # noqa: E731
    return _spec(collective).build(_Point(comm, pat, dtype, op, root, total, put, get))


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
def run_bench(comm, opts: BenchOptions, emit: Callable[[str], None] | None = None) -> list[Row]:
    """Every rank calls this with the same options; returns the rows (the same on every rank);
    ``emit`` (rank 0's printer) gets each table line as soon as it is measured."""
    opts.check()
    n = comm.size
    if opts.collective == "broadcast" and not 0 <= opts.root < n:
        raise UsageError(f"--root {opts.root} out of range for {n} ranks")
    itemsize = np.dtype(DTYPES[opts.dtype][1]).itemsize
    xp = device_module(comm, opts.memory)
    rows = []
    for nbytes in size_list(opts.minbytes, opts.maxbytes, opts.factor):
        total, count, size = counts_for(opts.collective, nbytes, itemsize, n)
        case = make_case(comm, opts.collective, opts.dtype, opts.op, opts.root, total, opts.seed, xp)
        for _ in range(opts.warmup):
            case.run()
        comm.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(opts.iters):
            case.run()
        comm.synchronize()      # device collectives return when enqueued: time until they completed
        seconds = (time.perf_counter() - t0) / opts.iters
        wrong = case.check()
        stats = comm.allreduce(np.array([seconds]), op="max")
        wrong_all = comm.allreduce(np.array([wrong], np.int64), op="sum")
        row = make_row(opts.collective, opts.dtype, opts.op, opts.root, n, size, count,
                       float(stats[0]), int(wrong_all[0]))
        rows.append(row)
        if emit:
            emit(format_row(row))
    return rows


def result_dict(opts: BenchOptions, rows: list[Row], n: int, hosts) -> dict:
    return {"collective": opts.collective, "backend": opts.backend, "ranks": n, "hosts": list(hosts),
            "dtype": opts.dtype, "op": opts.op if opts.collective in REDUCING else None,
            "root": opts.root if opts.collective == "broadcast" else None, "iters": opts.iters,
            "warmup": opts.warmup, "busbw_factor": busbw_factor(opts.collective, n),
            "rows": [dataclasses.asdict(r) for r in rows], "avg_busbw": avg_busbw(rows),
            "wrong": sum(r.wrong for r in rows)}


def write_plot(path: str, result: dict) -> None:
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["size"] > 0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"hpcring {result['collective']} ({result['backend']}), {result['ranks']} ranks, {result['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def preamble(opts: BenchOptions, backend_name: str, n: int, hosts, memory: str = "host (numpy)") -> list[str]:
    lines = [f"# hpcring bench: {opts.collective}, backend {backend_name}, {n} ranks on {len(set(hosts))} host(s)",
             f"# minBytes {opts.minbytes} maxBytes {opts.maxbytes} step: {opts.factor}(factor) warmup iters: "
             f"{opts.warmup} iters: {opts.iters} dtype: {opts.dtype} validation: 1 (always)",
             f"# buffers: {memory}",
             "#"]
    lines += [f"#  Rank {r:2d} on {h}" for r, h in enumerate(hosts)]
    return lines + ["#", format_header()]


def in_rank(environ=None) -> bool:
    """Is this process one rank of a launched job (rather than a command typed on a login node)?"""
    env = os.environ if environ is None else environ
    if env.get("HPCRING_SESSION"):
        return True
    from hpcring import session as _s
    if _s.current() is not None:
        return True
    try:
        from hpcring.bootstrap.launchers import detect
        return detect(env).launcher != "single"
    except Exception:
        return False


def resolved_backend(backend: str, session) -> str:
    """What ``auto`` resolved to, for the table's title."""
    if backend != "auto":
        return backend
    try:
        from hpcring.session import auto_backend
        return f"auto={auto_backend(session.topology)}"
    except Exception:
        from hpcring.config.envvars import get
        return f"auto={get('HPCRING_BACKEND') or 'ring'}"


def run_as_rank(opts: BenchOptions) -> int:
    """The rank side: bootstrap (or join the session), benchmark, rank 0 prints/writes. Returns the
    exit code (1 when any element was wrong)."""
    import hpcring
    opts.check()
    session = hpcring.init()
    comm = session.communicator(opts.backend, timeout=opts.timeout)
    rank, n = comm.rank, comm.size
    hosts = list(getattr(session.topology, "hosts", ()) or [f"rank{r}" for r in range(n)])
    table_path = os.environ.get(ENV_TABLE)
    sink = None
    if rank == 0:
        if table_path:
            sink = open(table_path, "a", buffering=1)
            emit = lambda line: sink.write(line + "\n")  # noqa: E731
        else:
            emit = lambda line: print(line, flush=True)  # noqa: E731
        backend_name = resolved_backend(opts.backend, session)
        lines = preamble(opts, backend_name, n, hosts, memory_label(comm, opts.memory))
        describe = getattr(comm.backend, "describe", None)   # the ring says which transport runs
        if describe:
            lines.insert(1, f"# transport: {describe()}")
        for line in lines:
            emit(line)
    else:
        emit = None
    try:
        rows = run_bench(comm, opts, emit)
        if rank == 0:
            emit(format_footer(rows))
            result = result_dict(opts, rows, n, hosts)
            if opts.json:
                with open(opts.json, "w") as fh:
                    json.dump(result, fh, indent=1)
                emit(f"# wrote {opts.json}")
            if opts.plot:
                write_plot(opts.plot, result)
                emit(f"# wrote {opts.plot}")
        comm.barrier()
    finally:
        if sink:
            sink.close()
    wrong = sum(r.wrong for r in rows)
    if wrong and rank == 0:
        print(f"hpcring bench: {wrong} wrong element(s): {opts.collective} {opts.dtype} {opts.op} "
              f"is broken on backend {opts.backend}", file=sys.stderr, flush=True)
    return 1 if wrong else 0


def to_argv(opts: BenchOptions) -> list[str]:
    """Options -> ``hpcring bench`` arguments (what the spawned ranks run)."""
    argv = ["--collective", opts.collective, "--backend", opts.backend, "-b", str(opts.minbytes),
            "-e", str(opts.maxbytes), "-f", repr(opts.factor), "--dtype", opts.dtype, "--op", opts.op,
            "--root", str(opts.root), "--iters", str(opts.iters), "--warmup", str(opts.warmup),
            "--seed", str(opts.seed), "--memory", opts.memory]
    if opts.timeout is not None:
        argv += ["--timeout", str(opts.timeout)]
    if opts.json:
        argv += ["--json", os.path.abspath(opts.json)]
    if opts.plot:
        argv += ["--plot", os.path.abspath(opts.plot)]
    return argv


def spawn_local(opts: BenchOptions, ranks: int, nodes: int = 1, out=None) -> int:
    """Standalone: start ``ranks`` local ranks (``nodes`` virtual nodes) through hpcring.launch and
    print rank 0's table as it is written (untagged). Returns the ranks' exit code."""
    from hpcring.config.site import load_site
    from hpcring.errors import HpcringError
    from hpcring.launch import run as launch_run
    opts.check()
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise UsageError(f"--ranks {ranks} must be a positive multiple of --nodes {nodes}")
    out = out or sys.stdout
    tmp = tempfile.mkdtemp(prefix="hpcring-bench-")
    table = os.path.join(tmp, "table.txt")
    open(table, "w").close()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "LSB_", "OMPI_COMM_WORLD", "PMI_", "PMIX_"))
           and k not in ("HPCRING_SESSION", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env[ENV_TABLE] = table
    cmd = [sys.executable, "-m", "hpcring.bench", *to_argv(opts)]
    done = threading.Event()

    def tail() -> None:
        with open(table) as fh:
            while True:
                line = fh.readline()
                if line:
                    out.write(line)
                    out.flush()
                elif done.is_set():
                    return
                else:
                    time.sleep(0.05)

    th = threading.Thread(target=tail, daemon=True)
    th.start()
    try:
        code = launch_run(cmd, load_site("local"), nodes, ranks // nodes, environ=env)
    except HpcringError as exc:
        code = getattr(exc, "exit_code", 1) or 1
    finally:
        done.set()
        th.join(timeout=5)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return code


def bench_main(opts: BenchOptions, ranks: int | None = None, nodes: int | None = None) -> int:
    """``hpcring bench``: a rank of a launched job benchmarks; otherwise spawn ``ranks`` (default 2) locally."""
    opts.check()
    if in_rank():
        if ranks is not None or nodes is not None:
            size = int(os.environ.get("WORLD_SIZE", "0") or 0)
            if ranks is not None and size and ranks != size:
                raise UsageError(f"--ranks {ranks} inside a job of {size} ranks: the launcher decides the ranks "
                                 "here", hint="drop --ranks/--nodes when running under hpcring run/srun/mpirun")
        return run_as_rank(opts)
    return spawn_local(opts, ranks or 2, nodes or 1)


if __name__ == "__main__":     # `python -m hpcring.bench ...` == `hpcring bench ...`
    import typer

    from hpcring.cli.bench_cmd import register
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(_app)
    _app(prog_name="hpcring bench")
