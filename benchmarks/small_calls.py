"""Small collectives on one host, hpcring's Communicator (ring, shared memory) against Open MPI
(mpi4py under mpirun), at 2, 4 and 8 ranks: the calls where what surrounds the library call
and how a waiting rank hands over its core decide the time (docs/collectives.md "Small calls on
a crowded host").

    python benchmarks/small_calls.py                       # 2, 4, 8 ranks; every kind; 4 and 64 KiB
    python benchmarks/small_calls.py --ranks 4 --calls barrier,alltoall:4K
    python benchmarks/small_calls.py --src /path/to/other/checkout/src   # A/B: another build

Each point: 50 warm-up calls, then 5 timed loops of 1000 calls (300 from 64 KiB, 20 from 1 MiB)
after a barrier; the median loop's mean per call, on the slowest rank. Outputs are given
(``out=``) on both sides, float32, sum. Both run the same loops in the same order; ``--src``
runs the ring side with another checkout's ``src`` first on ``PYTHONPATH`` (its extension built
in place), which is how a change's before and after are measured in one run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

CALLS = ("barrier,allreduce:4K,allgather:4K,reduce_scatter:4K,broadcast:4K,alltoall:4K,"
         "allreduce:64K,allgather:64K,reduce_scatter:64K,broadcast:64K,alltoall:64K")


def parse_calls(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, size = item.strip().partition(":")
        if name not in ("barrier", "allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall"):
            raise SystemExit(f"unknown collective {name!r}")
        mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:].upper(), 1) if size else 1
        nbytes = int(size[:-1] if mult > 1 else size or 0) * mult
        out.append((name, 0 if name == "barrier" else nbytes))
    return out


def iters_for(nbytes: int) -> int:
    return 1000 if nbytes <= 4 << 10 else 300 if nbytes <= 64 << 10 else 20


def median_loop(barrier, fn, it: int) -> float:
    for _ in range(50):
        fn()
    loops = []
    for _ in range(5):
        barrier()
        t0 = time.perf_counter()
        for _ in range(it):
            fn()
        loops.append((time.perf_counter() - t0) / it)
    return statistics.median(loops)


def worker(kind: str, calls: list[tuple[str, int]]) -> None:
    import numpy as np
    if kind == "ring":
        import hpcring
        c = hpcring.init().communicator("ring")
        rank, n, barrier = c.rank, c.size, c.barrier

        def make(name, x, y, ag, rs):
            return {"barrier": lambda: c.barrier(), "allreduce": lambda: c.allreduce(x, out=y),
                    "allgather": lambda: c.allgather(x, out=ag), "alltoall": lambda: c.alltoall(x, out=y),
                    "reduce_scatter": lambda: c.reduce_scatter(x, out=rs),
                    "broadcast": lambda: c.broadcast(x)}[name]

        def slowest(v):
            return float(c.allreduce(np.array([v]), op="max")[0])
    else:
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        rank, n, barrier = c.Get_rank(), c.Get_size(), c.Barrier

        def make(name, x, y, ag, rs):
            return {"barrier": lambda: c.Barrier(), "allreduce": lambda: c.Allreduce(x, y),
                    "allgather": lambda: c.Allgather(x, ag), "alltoall": lambda: c.Alltoall(x, y),
                    "reduce_scatter": lambda: c.Reduce_scatter_block(x, rs),
                    "broadcast": lambda: c.Bcast(x)}[name]

        def slowest(v):
            return c.allreduce(v, op=MPI.MAX)
    row = []
    for name, nbytes in calls:
        count = max(nbytes // 4, n) // n * n            # divisible by the size (alltoall, reduce_scatter)
        x = np.ones(count, np.float32)
        y, ag, rs = np.empty_like(x), np.empty(count * n, np.float32), np.empty(count // n, np.float32)
        t = slowest(median_loop(barrier, make(name, x, y, ag, rs), iters_for(nbytes)))
        row.append(f"{name}:{nbytes}={t * 1e6:.2f}")
    if rank == 0:
        print("SMALLROW " + " ".join(row), flush=True)


def run(kind: str, n: int, calls: str, src: str | None) -> dict[str, float]:
    me = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--calls", calls]
    env = dict(os.environ)
    if kind == "ring":
        if src:
            env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        argv = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(n), "--", *me]
    else:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1")
        argv = ["mpirun", "--oversubscribe", "-np", str(n), *me]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in p.stdout.splitlines() if "SMALLROW " in ln), None)
    if p.returncode or line is None:
        raise SystemExit(f"{kind} x {n} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return {k: float(v) for k, _, v in (w.partition("=") for w in line.split("SMALLROW ", 1)[1].split())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--calls", default=CALLS, help="name[:size],...  (K/M suffixes)")
    ap.add_argument("--src", help="another checkout's src/ for the ring side (A/B)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    calls = parse_calls(a.calls)
    if a.worker:
        worker(a.worker, calls)
        return 0
    kinds = ["ring"] + (["mpi"] if shutil.which("mpirun") else [])
    print(f"# us per call, median of 5 loops, slowest rank; ratio = Open MPI's time / ring's (> 1: ring faster)"
          f"{'; ring from ' + a.src if a.src else ''}; load average {os.getloadavg()[0]:.1f}")
    print(f"# {'ranks':>5} {'call':>22} {'ring':>9} {'Open MPI':>9} {'ratio':>7}")
    for n in (int(v) for v in a.ranks.split(",")):
        res = {k: run(k, n, a.calls, a.src if k == "ring" else None) for k in kinds}
        for key, t in res["ring"].items():
            m = res.get("mpi", {}).get(key)
            print(f"  {n:>5} {key:>22} {t:>9.2f} {m if m is not None else float('nan'):>9.2f} "
                  f"{(m / t) if m else float('nan'):>6.2f}x", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
