"""What the MPI backend's signature check costs: a small allreduce through hpcring's MPI backend
with the check on and off, against raw mpi4py, in one run (issue 39 item 4).

    mpirun --oversubscribe -np 2 python benchmarks/mpi_check_cost.py            # shared memory
    mpirun --oversubscribe -np 2 --mca btl tcp,self python benchmarks/mpi_check_cost.py   # TCP loopback
    salloc -N2 srun --mpi=pmix python benchmarks/mpi_check_cost.py                 # dev cluster
    python benchmarks/mpi_check_cost.py --launch [--tcp] [--ranks 2]                # runs mpirun itself

Variants, timed in alternating rounds (so a load change on a shared machine hits all alike), the
median of the rounds' mean per-call time on the slowest rank:

  raw Allreduce       ``comm.Allreduce(x, out, MPI.SUM)`` (mpi4py, blocking)
  raw Iallreduce      ``comm.Iallreduce(...)`` then ``Test()`` until done (what the backend does)
  backend check off   ``MpiBackend.allreduce`` with ``check = False``
  backend check on    ``MpiBackend.allreduce`` with the signature check (the default: at most
                      FOLD_RANKS ranks, the data rides in the check's slot allgather)
  check, not folded   the check as a (signature, -signature) MAX Iallreduce, then the data's own
                      Iallreduce (more than FOLD_RANKS ranks; before issue 39, every communicator)
  Communicator        ``Communicator.allreduce(x, out=out)`` (the public API, check on)

Every variant's result is checked (sum of rank+1 over the ranks): #wrong is printed per variant.
Prints one ``CHECKCOST {json}`` line (rank 0) and a table; ``--json PATH`` writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

VARIANTS = ("raw Allreduce", "raw Iallreduce", "backend check off", "backend check on", "check, not folded",
            "Communicator")
# (check, fold) per backend variant
SETTINGS = {"backend check off": (False, True), "check, not folded": (True, False)}


def _ranks_env() -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def measure(nbytes: int, calls: int, rounds: int) -> dict | None:
    from mpi4py import MPI
    from hpcring.collectives.api import Communicator
    from hpcring.collectives.mpi import MpiBackend

    world = MPI.COMM_WORLD
    be = MpiBackend.create(None, timeout=60.0)
    comm = Communicator(be, timeout=60.0)
    raw = be._comm                      # the backend's own duplicate: the same communicator's path
    rank, n = world.Get_rank(), world.Get_size()
    x = np.full(max(1, nbytes // 4), rank + 1, np.float32)
    out = np.zeros_like(x)
    want = n * (n + 1) / 2

    def raw_blocking():
        raw.Allreduce(x, out, MPI.SUM)

    def raw_nonblocking():
        req = raw.Iallreduce(x, out, MPI.SUM)
        while not req.Test():
            pass

    def backend():
        be.allreduce(x, out, "float32", "sum", 60.0)

    def api():
        comm.allreduce(x, out=out)

    calls_of = {"raw Allreduce": raw_blocking, "raw Iallreduce": raw_nonblocking, "backend check off": backend,
                "backend check on": backend, "check, not folded": backend, "Communicator": api}

    def setting(v: str) -> None:
        be.check, be.fold = SETTINGS.get(v, (True, fold))
    fold = be.fold
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    wrong: dict[str, int] = {v: 0 for v in VARIANTS}
    for v in VARIANTS:                  # warm-up, and every variant's result checked
        setting(v)
        for _ in range(20):
            out[:] = 0
            calls_of[v]()
        wrong[v] += int(np.count_nonzero(out != want))
    for _ in range(rounds):
        for v in VARIANTS:
            setting(v)
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                calls_of[v]()
            times[v].append(world.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
            wrong[v] += int(np.count_nonzero(out != want))
    setting("backend check on")
    wrong = {v: world.allreduce(w, op=MPI.SUM) for v, w in wrong.items()}
    res = {"ranks": n, "bytes": x.nbytes, "calls": calls, "rounds": rounds,
           "median_us": {v: float(np.median(t)) * 1e6 for v, t in times.items()},
           "min_us": {v: float(min(t)) * 1e6 for v, t in times.items()}, "wrong": wrong}
    comm.close()
    return res if rank == 0 else None


def table(res: dict) -> str:
    base = res["median_us"]["raw Allreduce"]
    lines = [f"# {res['bytes']} B float32 sum allreduce, {res['ranks']} ranks, {res['calls']} calls x "
             f"{res['rounds']} rounds (median of the rounds; slowest rank)",
             f"# {'variant':<20} {'time (us)':>10} {'min (us)':>10} {'x raw':>7} {'#wrong':>7}"]
    for v in VARIANTS:
        t = res["median_us"][v]
        lines.append(f"  {v:<20} {t:>10.1f} {res['min_us'][v]:>10.1f} {t / base:>6.2f}x {res['wrong'][v]:>7}")
    on, off = res["median_us"]["backend check on"], res["median_us"]["backend check off"]
    unf = res["median_us"]["check, not folded"]
    lines.append(f"# the check costs {on - off:+.1f} us per call ({unf - off:+.1f} us not folded); backend with "
                 f"the check / raw Allreduce = {on / base:.2f}x (target <= 2x; not folded {unf / base:.2f}x)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--launch", action="store_true", help="start the ranks with mpirun here")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tcp", action="store_true", help="with --launch: Open MPI's TCP btl over loopback")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.launch:
        argv = ["mpirun", "--oversubscribe", "-np", str(args.ranks)]
        if args.tcp:
            argv += ["--mca", "btl", "tcp,self"]
        argv += [sys.executable, str(Path(__file__).resolve()), "--bytes", str(args.bytes), "--calls",
                 str(args.calls), "--rounds", str(args.rounds)] + (["--json", args.json] if args.json else [])
        return subprocess.run(argv, env=_ranks_env(), stdin=subprocess.DEVNULL).returncode
    res = measure(args.bytes, args.calls, args.rounds)
    if res is not None:
        print("CHECKCOST " + json.dumps(res), flush=True)
        print(table(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return 1 if any(res["wrong"].values()) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
