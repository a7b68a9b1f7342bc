"""Running a benchmark: every rank in a job, rank 0 printing; or standalone, spawning local ranks."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from typing import Callable

import numpy as np

from hpcring.config.envvars import MAX_LOCAL_RANKS, get
from hpcring.errors import HpcringError, UsageError
from hpcring.bench.data import DTYPES, ENV_TABLE
from hpcring.bench.cases import REDUCING, busbw_factor, counts_for, device_module, make_case, memory_label
from hpcring.bench.options import BUFFERS_PER_RANK, BenchOptions, require_matplotlib, size_list
from hpcring.bench.table import Row, avg_busbw, format_footer, format_header, format_row, make_row
import hpcring
from hpcring import session as _s
from hpcring.bootstrap.launchers import detect
from hpcring.collectives.choice import auto_backend
from hpcring.collectives import nccl_lib


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
    if _s.current() is not None:
        return True
    try:
        return detect(env).launcher != "single"
    except Exception:
        return False


def resolved_backend(backend: str, session) -> str:
    """What ``auto`` resolved to, for the table's title."""
    if backend != "auto":
        return backend
    try:
        return f"auto={auto_backend(session.topology)}"
    except Exception:
        return f"auto={get('HPCRING_BACKEND') or 'ring'}"


def run_as_rank(opts: BenchOptions) -> int:
    """The rank side: bootstrap (or join the session), benchmark, rank 0 prints/writes. Returns the
    exit code (1 when any element was wrong)."""
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
        transport = comm.describe()            # the ring says which transport runs
        if transport:
            lines.insert(1, f"# transport: {transport}")
        for line in lines:
            emit(line)
    else:
        emit = None
    failed = None
    try:
        rows = run_bench(comm, opts, emit)
        if rank == 0:
            emit(format_footer(rows))
            failed = _write_results(opts, result_dict(opts, rows, n, hosts), emit)
        comm.barrier()        # rank 0 reaches it even when writing failed: no one is left waiting
    finally:
        if sink:
            sink.close()
    if failed is not None:
        raise failed
    wrong = sum(r.wrong for r in rows)
    if wrong and rank == 0:
        print(f"hpcring bench: {wrong} wrong element(s): {opts.collective} {opts.dtype} {opts.op} "
              f"is broken on backend {opts.backend}", file=sys.stderr, flush=True)
    return 1 if wrong else 0


def _write_results(opts: BenchOptions, result: dict, emit) -> HpcringError | None:
    """Rank 0 writes --json/--plot; the error to raise after the final barrier, or None. (The
    paths were checked before the run; a disk can still fill up or a folder vanish meanwhile.)"""
    for what, path, write in (("--json", opts.json, _write_json), ("--plot", opts.plot, write_plot)):
        if not path:
            continue
        try:
            write(path, result)
        except (OSError, ValueError) as exc:      # ValueError: a --plot format matplotlib lacks
            return HpcringError(f"bench {what}: cannot write {path}: {exc.strerror or exc}",
                                hint=f"the table above is complete; rerun with {what} in a writable folder")
        emit(f"# wrote {path}")
    return None


def _write_json(path: str, result: dict) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


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


def _buffers_on_host(opts: BenchOptions) -> bool:
    """Do the ranks' buffers live in host memory (numpy), as ``auto`` will decide?"""
    if opts.memory != "auto":
        return opts.memory == "host"
    backend = opts.backend
    if backend == "auto":
        backend = get("HPCRING_BACKEND")
        if backend is None:
            backend = "nccl" if nccl_lib.gpu_available() else "ring"
    return backend != "nccl"


def check_host_memory(opts: BenchOptions, ranks: int, meminfo: str = "/proc/meminfo") -> None:
    """Standalone, host buffers: refuse sizes this machine cannot hold before starting any rank
    (else the ranks allocate until the kernel's OOM killer picks one)."""
    if not _buffers_on_host(opts):
        return                    # device memory: the GPU's own allocator reports it
    need = ranks * BUFFERS_PER_RANK * opts.maxbytes
    try:
        with open(meminfo) as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    if need > avail:
        gib = 1 << 30
        raise UsageError(f"--maxbytes {opts.maxbytes} needs about {need / gib:.1f} GiB on this machine "
                         f"({ranks} ranks x {BUFFERS_PER_RANK} buffers), but only {avail / gib:.1f} GiB is available",
                         hint="lower --maxbytes or --ranks")


def spawn_local(opts: BenchOptions, ranks: int, nodes: int = 1, out=None) -> int:
    """Standalone: start ``ranks`` local ranks (``nodes`` virtual nodes) through hpcring.allocation and
    print rank 0's table as it is written (untagged). Returns the ranks' exit code."""
    from hpcring.config.site import load_site  # deferred: pulls pydantic, yaml
    from hpcring import allocation  # deferred: pulls jinja2, pydantic, yaml
    opts.check()
    if ranks < 1 or nodes < 1 or ranks % nodes:
        raise UsageError(f"--ranks {ranks} must be a positive multiple of --nodes {nodes}")
    if ranks > MAX_LOCAL_RANKS:
        raise UsageError(f"--ranks {ranks}: standalone bench starts every rank on this machine (at most "
                         f"{MAX_LOCAL_RANKS})", hint="benchmark more ranks inside a job: hpcring run -N N -- hpcring bench")
    check_host_memory(opts, ranks)
    out = out or sys.stdout
    tmp = tempfile.mkdtemp(prefix="hpcring-bench-")
    table = os.path.join(tmp, "table.txt")
    open(table, "w").close()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "LSB_", "OMPI_COMM_WORLD", "PMI_", "PMIX_"))
           and k not in ("HPCRING_SESSION", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env[ENV_TABLE] = table
    cmd = [sys.executable, "-m", "hpcring", "bench", *to_argv(opts)]   # each rank runs the CLI command
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
        code = allocation.run(cmd, load_site("local"), nodes, ranks // nodes, environ=env)
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
