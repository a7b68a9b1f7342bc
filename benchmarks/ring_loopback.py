"""nccl-tests-style benchmark of the ring collectives on one host (loopback TCP).

    python benchmarks/ring_loopback.py -n 2 -b 8 -e 256M -f 4 --op allreduce
    python benchmarks/ring_loopback.py -n 2 --op allreduce --algo rd     # force recursive doubling
    python benchmarks/ring_loopback.py -n 2 --mpi                         # + mpi4py Allreduce (mpirun)
    python benchmarks/ring_loopback.py -n 8 --cutover --transport tcp     # ring vs rd vs rh, per size
    python benchmarks/ring_loopback.py -n 4 --op broadcast --algo tree    # or chain

Ranks are spawned processes that rendezvous through the authenticated store (as in a job).
Columns follow nccl-tests: time is the slowest rank's mean per iteration; algbw = size / time;
busbw = algbw * factor (allreduce 2(n-1)/n; allgather, reduce_scatter, alltoall (n-1)/n;
broadcast 1). Data are small integers stored as float32, so every result is exact and #wrong
(elements differing from the expected value, checked on every rank after the timed loop) must be 0.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

SECRET = b"benchmark-secret-0123456789abcdef"
FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n,
           "broadcast": lambda n: 1.0}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def sizes(args) -> list[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s *= args.stepfactor
    return out




def make_case(op: str, n: int, rank: int, count: int):
    """(run, wrong) closures for one op and per-rank element count (float32)."""
    x = np.full(count, rank + 1, np.float32)
    if op == "allreduce":
        out = np.empty_like(x)
        return (lambda c: c.allreduce(x, out=out)), (lambda: int(np.count_nonzero(out != n * (n + 1) / 2)))
    if op == "allgather":
        per = count // n
        xs = x[:per]
        out = np.empty((n, per), np.float32)
        want = np.repeat(np.arange(1, n + 1, dtype=np.float32)[:, None], per, 1)
        return (lambda c: c.allgather(xs, out=out)), (lambda: int(np.count_nonzero(out != want)))
    if op == "reduce_scatter":
        mine = count // n + (1 if rank < count % n else 0)
        out = np.empty(mine, np.float32)
        return (lambda c: c.reduce_scatter(x, out=out)), (lambda: int(np.count_nonzero(out != n * (n + 1) / 2)))
    if op == "broadcast":
        buf = x.copy()

        def run(c):
            buf[...] = rank + 1
            c.broadcast(buf, root=0)
        return run, (lambda: int(np.count_nonzero(buf != 1)))
    if op == "alltoall":
        m = count - count % n
        xs = np.repeat(np.arange(n, dtype=np.float32) + 100 * rank, m // n)
        out = np.empty_like(xs)
        want = np.repeat(np.arange(n, dtype=np.float32) * 100 + rank, m // n)
        return (lambda c: c.alltoall(xs, out=out)), (lambda: int(np.count_nonzero(out != want)))
    raise SystemExit(f"unknown op {op}")


def _native_max_direct() -> int:
    from hpcring import _native
    return _native.DIRECT_MAX_RANKS


def child(rank, n, port, args, q):
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.topology import Topology
    from hpcring.collectives import Communicator
    # --transport tcp: every rank on a "host" of its own, so ranks talk over loopback TCP;
    # shm: one host, so they share memory (the real layout of n ranks on one node)
    hosts = tuple("localhost" if args.transport == "shm" else f"local{r}" for r in range(n))
    topo = Topology(rank=rank, size=n, local_rank=rank, local_size=n, node_rank=0, num_nodes=1,
                    hosts=hosts, launcher="local", address="127.0.0.1")
    comm = Communicator.create(topo, StoreClient("127.0.0.1", port, SECRET, 60), SECRET, timeout=600,
                               sockbuf=args.sockbuf, shm=args.transport == "shm")
    algos = (["ring", "rd", "rh"] + (["direct"] if n <= _native_max_direct() else [])) if args.cutover else [args.algo]
    rows = []
    for nbytes in sizes(args):
        count = max(nbytes // 4, 0)
        for algo in algos:
            if algo in ("tree", "chain"):      # broadcast: force one algorithm
                comm.backend._comm.bcast_tree_max = 1 << 62 if algo == "tree" else 0
            else:                              # allreduce: (RD threshold, RH bytes per rank)
                from hpcring import _native
                comm.backend.rd_threshold, comm.backend.rh_chunk, comm.backend.direct_max = {
                    "ring": (0, 0, 0), "rd": (1 << 62, 0, 0), "rh": (0, 1 << 62, 0), "direct": (0, 0, 1 << 62),
                }.get(algo, (_native.RD_THRESHOLD_DEFAULT, _native.RH_CHUNK_DEFAULT, _native.DIRECT_MAX_DEFAULT))
            run, wrong = make_case(args.op, n, rank, count)
            iters = args.iters if nbytes < (16 << 20) else max(3, args.iters // 4)
            for _ in range(args.warmup):
                run(comm)
            comm.barrier()
            if args.cutover:            # the median call (algorithms compared call by call)
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    run(comm)
                    times.append(time.perf_counter() - t0)
                stat = np.median(times)
            else:                       # the mean over the loop, timed as the MPI child times it
                t0 = time.perf_counter()
                for _ in range(iters):
                    run(comm)
                stat = (time.perf_counter() - t0) / iters
            bad = wrong()
            t = comm.allreduce(np.array([stat]), op="max")[0]
            bad = int(comm.allreduce(np.array([bad], np.int64))[0])
            rows.append((nbytes, count, algo, t, bad))
    q.put((rank, rows))
    comm.close()


def run_ring(args) -> list:
    from hpcring.bootstrap.store_server import StoreServer
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with StoreServer("127.0.0.1", 0, secret=SECRET) as server:
        procs = [ctx.Process(target=child, args=(r, args.nranks, server.port, args, q)) for r in range(args.nranks)]
        for p in procs:
            p.start()
        results = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
    return results[0]


def header(title: str) -> None:
    print(f"# {title}")
    print(f"#{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'time(us)':>11} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
    print(f"#{'(B)':>12} {'(elements)':>12} {'':>8} {'':>6} {'':>11} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}")


def row(nbytes, count, t, bad, op, n, label="") -> None:
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    busbw = algbw * FACTORS[op](n)
    redop = "sum" if op in ("allreduce", "reduce_scatter") else "none"
    print(f" {nbytes:>12} {count:>12} {'float':>8} {redop:>6} {t * 1e6:>11.1f} {algbw:>8.3f} {busbw:>8.3f} {bad:>7} {label}")


def mpi_child(args) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    for nbytes in sizes(args):
        count = nbytes // 4
        x = np.full(count, rank + 1, np.float32)
        out = np.empty_like(x)
        iters = args.iters if nbytes < (16 << 20) else max(3, args.iters // 4)
        for _ in range(args.warmup):
            comm.Allreduce(x, out, op=MPI.SUM)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.Allreduce(x, out, op=MPI.SUM)
        t = comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)
        bad = comm.allreduce(int(np.count_nonzero(out != n * (n + 1) / 2)), op=MPI.SUM)
        if rank == 0:
            print(f"MPIROW {nbytes} {count} {t} {bad}", flush=True)


def run_mpi(args) -> list | None:
    mpirun = shutil.which("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        print("# mpi4py not installed: skipping the MPI comparison")
        return None
    if not mpirun:
        print("# mpirun not found: skipping the MPI comparison")
        return None
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(args.nranks), sys.executable, __file__,
           "--mpi-child", "-b", str(args.minbytes), "-e", str(args.maxbytes), "-f", str(args.stepfactor),
           "--iters", str(args.iters), "--warmup", str(args.warmup)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        print(f"# mpirun failed ({p.returncode}): {p.stderr.strip()[-500:]}")
        return None
    rows = []
    for line in p.stdout.splitlines():
        if line.startswith("MPIROW"):
            _, nb, cnt, t, bad = line.split()
            rows.append((int(nb), int(cnt), float(t), int(bad)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--nranks", type=int, default=2)
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"))
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("256M"))
    ap.add_argument("-f", "--stepfactor", type=int, default=4)
    ap.add_argument("--op", default="allreduce", choices=sorted(FACTORS))
    ap.add_argument("--algo", default="auto", choices=["auto", "ring", "rd", "rh", "direct", "tree", "chain"],
                    help="allreduce: ring/rd (recursive doubling)/rh (recursive halving); broadcast: tree/chain")
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"],
                    help="shm: ranks on one host share memory (default); tcp: loopback TCP only")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sockbuf", type=int, default=None)
    ap.add_argument("--cutover", action="store_true", help="time ring, recursive doubling, recursive halving (and direct exchange, n <= 3) per size")
    ap.add_argument("--mpi", action="store_true", help="also run mpi4py Allreduce under mpirun")
    ap.add_argument("--mpi-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mpi_child:
        mpi_child(args)
        return
    rows = run_ring(args)
    if args.cutover:
        algos = list(dict.fromkeys(r[2] for r in rows))
        print(f"# allreduce cut-over, {args.nranks} ranks, {args.transport}, median time (us): size "
              f"{' '.join(algos)} winner")
        by = {}
        for nbytes, count, algo, t, bad in rows:
            by.setdefault(nbytes, {})[algo] = (t, bad)
        for nbytes, d in by.items():
            best = min(d, key=lambda a: d[a][0])
            print(f" {nbytes:>12} " + " ".join(f"{d[a][0] * 1e6:>10.1f}" for a in algos)
                  + f" {best:>6}  wrong={sum(b for _, b in d.values())}")
        return
    header(f"hpcring ring {args.op}, {args.nranks} ranks, {args.transport}, algo={args.algo}")
    for nbytes, count, _algo, t, bad in rows:
        row(nbytes, count, t, bad, args.op, args.nranks)
    if args.mpi and args.op == "allreduce":
        mrows = run_mpi(args)
        if mrows:
            header(f"mpi4py Allreduce (Open MPI), {args.nranks} ranks")
            for nbytes, count, t, bad in mrows:
                row(nbytes, count, t, bad, "allreduce", args.nranks)
            ring = {r[0]: r[3] for r in rows}
            print("# speed-up of hpcring over MPI (MPI time / hpcring time)")
            for nbytes, _c, t, _b in mrows:
                if nbytes in ring and ring[nbytes] > 0:
                    print(f" {nbytes:>12} {t / ring[nbytes]:>6.2f}x")


if __name__ == "__main__":
    main()
