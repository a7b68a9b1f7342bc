"""Every collective side by side: hpcring's ring vs Open MPI (mpi4py) vs torch Gloo, on one host
with 2/4/8 ranks and on the dev cluster, in nccl-tests' columns, with the ratios from the same run.

    python benchmarks/compare_collectives.py --quick                  # one host 2/4/8 + dev cluster 3x1
    python benchmarks/compare_collectives.py --skip cluster           # one host only
    python benchmarks/compare_collectives.py --skip onehost --nodes 3 # dev cluster only
    python benchmarks/compare_collectives.py --one-host-ranks 2 --collectives allgather,alltoall --sizes 4K,64K
    python benchmarks/compare_collectives.py --skip cluster --rounds 5  # the median of 5 alternating rounds

Collectives: allreduce, allgather, reduce_scatter, broadcast, alltoall (float32, sum where it
reduces, root 0) and barrier; sizes 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB (--sizes). Every
implementation gets the same buffers and the same exact check from ``hpcring bench``
(src/hpcring/bench: rank r's deterministic pattern of small integers, outputs starting from
NaN, #wrong = elements that differ from the expected result, summed over ranks, checked after every
timed loop). Columns and bus-bandwidth factors are nccl-tests' (``hpcring.bench.table``): ``size``
is the largest buffer of the call, ``time`` the mean per call in the median of 5 timed loops
(--quick: 3), on the slowest rank. ``host CPU``: the share of this host's cores busy during the
timed loops (/proc/stat, coarse for short loops).

  * hpcring ring: ``Communicator`` (backend ``ring``) under ``hpcring run`` (one host: one node,
    so the ranks share memory; the dev cluster: ``salloc`` + ``hpcring run --site devcluster``);
  * Open MPI: mpi4py's blocking ``Allreduce``/``Allgather``/``Reduce_scatter_block``/``Bcast``/
    ``Alltoall``/``Barrier`` on ``COMM_WORLD`` under ``mpirun`` (one host, Open MPI's shared memory)
    or ``srun --mpi=pmix`` (dev cluster, TCP on eth0), ``mpi_yield_when_idle=1``;
  * torch Gloo: ``all_reduce`` (on a copy of the input: Gloo reduces in place; the copy is timed),
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``, ``all_to_all_single``,
    ``barrier`` under ``hpcring run`` (env://). A call this torch's Gloo lacks is emulated and
    its table says how.

Ratios: the other's time / the ring's (> 1: the ring is faster), per collective and size.
``--rounds N`` runs the three implementations in turn N times (ring, Open MPI, Gloo, ring, ...) and
keeps each point's median time (the JSON keeps every round's): a host whose speed drifts for
minutes (the 2-core VM's slow mode) then moves all three alike instead of one. The
machinery (launching, the dev cluster's settings, CPU sampling) is compare_devcluster.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare_devcluster as cd  # noqa: E402

ROOT = cd.ROOT
THIS = Path(__file__).resolve()
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "barrier")
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
IMPLS = ("hpcring ring", "Open MPI (mpi4py)", "torch gloo")
KIND = {"hpcring ring": "ring", "Open MPI (mpi4py)": "mpi", "torch gloo": "gloo"}


def iters_for(nbytes: int, quick: bool) -> int:
    """Calls per timed loop: a few ms to a few 100 ms per point (small sizes: enough calls that
    the loop is not one scheduler tick's noise)."""
    it = 1000 if nbytes <= 4 << 10 else 300 if nbytes <= 64 << 10 else 30 if nbytes <= 1 << 20 else \
        5 if nbytes <= 16 << 20 else 3
    return max(2, it // 5) if quick else it


# Timed loops per point: the median loop is kept. One loop of 3 calls at 64 MiB moved 1.5x between
# runs on the 2-core VM (memory bandwidth shared with the host's other guests), the median of 5 a
# few percent.
LOOPS, LOOPS_QUICK = 5, 3


def warmup_for(nbytes: int) -> int:
    return 1 if nbytes >= 16 << 20 else 3 if nbytes >= 1 << 20 else 20


def parse_sizes(text: str) -> list[int]:
    out = []
    for x in filter(None, text.split(",")):
        unit = {"K": 10, "M": 20, "G": 30}.get(x[-1].upper())
        out.append(int(float(x[:-1]) * (1 << unit)) if unit else int(x))
    return out


# ---------------------------------------------------------------------------------------------
# the same interface over the three implementations (what hpcring.bench's cases call)
# ---------------------------------------------------------------------------------------------
class MpiComm:
    """mpi4py's blocking calls on COMM_WORLD, with the Communicator's signatures (float32 only)."""

    def __init__(self) -> None:
        from mpi4py import MPI
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.emulated = ""

    def allreduce(self, x, op="sum", out=None, dtype=None):
        self.comm.Allreduce(x, out, op=self.MPI.SUM)

    def allgather(self, x, out=None, dtype=None):
        self.comm.Allgather(x, out)

    def reduce_scatter(self, x, op="sum", out=None, dtype=None):
        self.comm.Reduce_scatter_block(x, out, op=self.MPI.SUM)

    def broadcast(self, buf, root=0, dtype=None):
        self.comm.Bcast(buf, root)

    def alltoall(self, x, out=None, dtype=None):
        self.comm.Alltoall(x, out)

    def barrier(self):
        self.comm.Barrier()

    def max(self, v: float) -> float:
        return self.comm.allreduce(v, op=self.MPI.MAX)

    def sum(self, v: int) -> int:
        return self.comm.allreduce(v, op=self.MPI.SUM)

    def close(self) -> None:
        pass


class GlooComm:
    """torch.distributed's Gloo on numpy buffers (torch.from_numpy: no copies but Gloo's own)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.emulated = ""
        t = torch
        self._rs = self._probe(lambda: dist.reduce_scatter_tensor(t.zeros(1), t.ones(self.size)))
        self._ag = self._probe(lambda: dist.all_gather_into_tensor(t.zeros(self.size), t.ones(1)))

    @staticmethod
    def _probe(call) -> bool:
        """Does this Gloo have the call? (every rank tries the same small one, so all agree)"""
        try:
            call()
            return True
        except (RuntimeError, NotImplementedError, ValueError):
            return False

    def _t(self, a):
        return self.torch.from_numpy(a)

    def allreduce(self, x, op="sum", out=None, dtype=None):
        o = self._t(out)
        o.copy_(self._t(x))
        self.dist.all_reduce(o)

    def allgather(self, x, out=None, dtype=None):
        if self._ag:
            self.dist.all_gather_into_tensor(self._t(out), self._t(x))
        else:
            self.emulated = "allgather as all_gather into a list of views"
            self.dist.all_gather(list(self._t(out).chunk(self.size)), self._t(x))

    def reduce_scatter(self, x, op="sum", out=None, dtype=None):
        if self._rs:
            self.dist.reduce_scatter_tensor(self._t(out), self._t(x))
            return
        # this Gloo has no reduce-scatter: all_reduce a copy and keep this rank's share
        self.emulated = "reduce_scatter as all_reduce of a copy + this rank's share"
        t = self._t(x).clone()
        self.dist.all_reduce(t)
        per = out.size
        self._t(out).copy_(t[self.rank * per:(self.rank + 1) * per])

    def broadcast(self, buf, root=0, dtype=None):
        self.dist.broadcast(self._t(buf), root)

    def alltoall(self, x, out=None, dtype=None):
        self.dist.all_to_all_single(self._t(out), self._t(x))

    def barrier(self):
        self.dist.barrier()

    def max(self, v: float) -> float:
        t = self.torch.tensor([v], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])

    def sum(self, v: int) -> int:
        t = self.torch.tensor([v], dtype=self.torch.int64)
        self.dist.all_reduce(t)
        return int(t[0])

    def close(self) -> None:
        self.dist.destroy_process_group()


class RingComm:
    """hpcring's Communicator (backend ring): the interface the cases call already."""

    def __init__(self) -> None:
        import hpcring
        self.c = hpcring.init().communicator("ring")
        self.rank, self.size = self.c.rank, self.c.size
        self.emulated = ""
        for name in ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "barrier"):
            setattr(self, name, getattr(self.c, name))

    def max(self, v: float) -> float:
        return float(self.c.allreduce(np.array([v]), op="max")[0])

    def sum(self, v: int) -> int:
        return int(self.c.allreduce(np.array([v], np.int64))[0])

    def describe(self) -> str:
        return self.c.describe() or ""

    def close(self) -> None:
        pass


def worker(kind: str, collectives: list[str], sizes: list[int], quick: bool) -> None:
    from hpcring.bench.cases import counts_for, make_case
    comm = {"mpi": MpiComm, "gloo": GlooComm, "ring": RingComm}[kind]()
    n = comm.size
    for coll in collectives:
        for nbytes in ([0] if coll == "barrier" else sizes):
            it = iters_for(max(nbytes, 1), quick)
            if coll == "barrier":
                case_run, check, size, count = comm.barrier, (lambda: 0), 0, 0
            else:
                total, count, size = counts_for(coll, nbytes, 4, n)
                case = make_case(comm, coll, "float32", "sum", 0, total)
                case_run, check = case.run, case.check
            for _ in range(warmup_for(nbytes)):
                case_run()
            loops = []
            c0 = cd.cpu_ticks()
            for _ in range(LOOPS_QUICK if quick else LOOPS):
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(it):
                    case_run()
                loops.append((time.perf_counter() - t0) / it)
            cpu = cd.cpu_busy(c0, cd.cpu_ticks())
            t = comm.max(statistics.median(loops))
            wrong = comm.sum(int(check()))
            rec = {"kind": kind, "collective": coll, "n": n, "size": size, "nominal": nbytes, "count": count, "time": t,
                   "wrong": wrong, "cpu": cpu, "iters": it, "loops": len(loops)}
            if comm.emulated:
                rec["emulated"] = comm.emulated
            if kind == "ring":
                rec["transport"] = comm.describe()
            if comm.rank == 0:
                print("CMPROW " + json.dumps(rec), flush=True)
            del case_run, check
    comm.close()


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def worker_argv(kind: str, args) -> list[str]:
    a = [sys.executable, str(THIS), "--worker", kind, "--collectives", ",".join(args.collectives),
         "--sizes", ",".join(map(str, args.sizes))]
    return a + (["--quick"] if args.quick else [])


def one_host(args) -> dict[int, dict[str, list[dict]]]:
    """n ranks on this host, for n in --one-host-ranks: ring (shared memory), Open MPI (mpirun), Gloo."""
    env = {k: v for k, v in cd._env().items() if not k.startswith(("SLURM_", "OMPI_MCA_btl_tcp", "OMPI_MCA_oob"))}
    out: dict[int, dict[str, list[dict]]] = {}
    for n in args.one_host_ranks:
        local = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(n), "--"]
        res = {"hpcring ring": cd._run(f"ring, 1 host x {n}", local + worker_argv("ring", args), env)}
        if shutil.which("mpirun"):
            menv = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        OMPI_MCA_mpi_yield_when_idle="1")
            res["Open MPI (mpi4py)"] = cd._run(f"mpi, 1 host x {n}", ["mpirun", "--oversubscribe", "-np", str(n)]
                                               + worker_argv("mpi", args), menv)
        res["torch gloo"] = cd._run(f"gloo, 1 host x {n}", local + worker_argv("gloo", args), env)
        out[n] = res
    return out


def cluster(args) -> dict[str, list[dict]]:
    """The dev cluster, --nodes x --per-node ranks: ring, Open MPI (srun --mpi=pmix), Gloo."""
    env = cd._env()
    res = {"hpcring ring": cd._run("ring, dev cluster", cd.salloc(args) + cd.hpcring_run(args)
                                   + worker_argv("ring", args), env)}
    res["Open MPI (mpi4py)"] = cd._run("mpi, dev cluster", cd.salloc(args) + ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"]
                                       + worker_argv("mpi", args), dict(env, **cd.MPI_ENV))
    res["torch gloo"] = cd._run("gloo, dev cluster", cd.salloc(args) + cd.hpcring_run(args)
                                + worker_argv("gloo", args), env)
    return res


def nccl_table(title: str, rows: list[dict], coll: str, n: int) -> list[str]:
    """One implementation's rows for one collective, in nccl-tests' columns (+ host CPU)."""
    from hpcring.bench.table import format_header, format_row, make_row
    lines = [f"# {title}"]
    if rows and rows[0].get("transport"):
        lines.append(f"# transport: {rows[0]['transport']}")
    if any(r.get("emulated") for r in rows):
        lines.append(f"# emulated: {rows[0].get('emulated') or next(r['emulated'] for r in rows if r.get('emulated'))}")
    head = format_header().splitlines()
    lines += [head[0] + "  host CPU", head[1] + "    (busy)"]
    if not rows:
        lines.append("#   (no result: see the FAILED line above)")
    for r in rows:
        if coll == "barrier":
            lines.append(f"{0:12d}  {0:12d}  {'none':>8s}  {'none':>6s}  {-1:6d}  {r['time'] * 1e6:7.2f}  "
                         f"{0.0:6.2f}  {0.0:6.2f}  {r['wrong']:5d}  {_pct(r.get('cpu')):>8}")
            continue
        row = make_row(coll, "float32", "sum", 0, n, r["size"], r["count"], r["time"], r["wrong"])
        lines.append(format_row(row) + f"  {_pct(r.get('cpu')):>8}")
    return lines


def _pct(v) -> str:
    return "" if v is None else format(v, ".0%")


def _time_us(t: float | None) -> str:
    if t is None:
        return "-"
    us = t * 1e6
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def ratio_table(layout: str, res: dict[str, list[dict]], collectives: list[str]) -> list[str]:
    """time per call of each implementation and the ratios (other's time / the ring's)."""
    lines = [f"# {layout}: time per call (us), slowest rank; ratio = other's time / ring's (> 1: ring faster)",
             f"# {'collective':<15} {'size':>9} {'ring':>9} {'Open MPI':>9} {'Gloo':>9} {'MPI/ring':>9} {'Gloo/ring':>9}"]

    def at(impl: str, coll: str, size: int):
        r = next((r for r in res.get(impl, []) if r["collective"] == coll and _nominal(r) == size), None)
        return r["time"] if r else None
    for coll in collectives:
        sizes = sorted({_nominal(r) for rows in res.values() for r in rows if r["collective"] == coll})
        for s in sizes:
            ring, mpi, gloo = (at(i, coll, s) for i in IMPLS)
            rm = f"{mpi / ring:.2f}x" if ring and mpi else "-"
            rg = f"{gloo / ring:.2f}x" if ring and gloo else "-"
            lines.append(f"  {coll:<15} {_size(s):>9} {_time_us(ring):>9} {_time_us(mpi):>9} {_time_us(gloo):>9} "
                         f"{rm:>9} {rg:>9}")
    return lines


def markdown(layouts, collectives: list[str]) -> list[str]:
    """One Markdown table per collective: every layout and size, the three times and the ratios."""
    out = []
    for coll in collectives:
        out += ["", f"**{coll}** (us per call, slowest rank; ratio = other's time / ring's, > 1: ring faster)", "",
                "| layout | size | ring | Open MPI | Gloo | MPI/ring | Gloo/ring |", "|---|---|---|---|---|---|---|"]
        for layout, res, _ in layouts:
            sizes = sorted({_nominal(r) for rows in res.values() for r in rows if r["collective"] == coll})
            for s in sizes:
                t = [next((r["time"] for r in res.get(i, []) if r["collective"] == coll and _nominal(r) == s), None)
                     for i in IMPLS]
                rm = f"{t[1] / t[0]:.2f}x" if t[0] and t[1] else "-"
                rg = f"{t[2] / t[0]:.2f}x" if t[0] and t[2] else "-"
                out.append(f"| {layout} | {_size(s)} | {_time_us(t[0])} | {_time_us(t[1])} | {_time_us(t[2])} | "
                           f"{rm} | {rg} |")
    return out


def merge_rounds(rounds: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """One row per implementation and point from several rounds' results: the median time (every
    round's kept in ``times``), the wrong elements summed; rows in the first round's order."""
    out: dict[str, list[dict]] = {}
    for impl in dict.fromkeys(i for res in rounds for i in res):
        seen: dict[tuple, dict] = {}
        for res in rounds:
            for r in res.get(impl, []):
                key = (r["collective"], _nominal(r))
                m = seen.get(key)
                if m is None:
                    seen[key] = dict(r, times=[r["time"]])
                else:
                    m["times"].append(r["time"])
                    m["wrong"] += r["wrong"]
        for m in seen.values():
            m["time"] = statistics.median(m["times"])
        out[impl] = list(seen.values())
    return out


def _nominal(r: dict) -> int:
    """The size asked for (the table's size is rounded down to a multiple of the ranks)."""
    return r.get("nominal", r["size"])


def _size(s: int) -> str:
    if s == 0:
        return "-"
    if s >= 1 << 20 and s % (1 << 20) == 0:
        return f"{s >> 20} MiB"
    if s >= 1 << 10:
        return f"{s / 1024:.0f} KiB" if s % 1024 == 0 else f"{s / 1024:.1f} KiB"
    return f"{s} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a fifth of the calls per point")
    ap.add_argument("--skip", default="", help="comma list of: cluster,onehost")
    ap.add_argument("--one-host-ranks", default=[2, 4, 8], type=lambda t: [int(x) for x in t.split(",") if x])
    ap.add_argument("--collectives", default=list(COLLECTIVES),
                    type=lambda t: [c for c in t.split(",") if c])
    ap.add_argument("--sizes", default=SIZES, type=parse_sizes, help="e.g. 4K,64K,1M,16M,64M")
    ap.add_argument("--rounds", type=int, default=1, help="run the implementations in turn this many times; "
                    "each point's median is kept")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--markdown", action="store_true", help="also print one Markdown table per collective")
    ap.add_argument("--from-json", default=None, help=argparse.SUPPRESS)   # reprint a --json file
    ap.add_argument("--worker", choices=["ring", "mpi", "gloo"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [c for c in args.collectives if c not in COLLECTIVES]
    if bad:
        ap.error(f"unknown collective(s) {', '.join(bad)}; choose from {', '.join(COLLECTIVES)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.worker:
        worker(args.worker, args.collectives, args.sizes, args.quick)
        return 0
    skip = set(filter(None, args.skip.split(",")))
    if "cluster" not in skip and not args.from_json and shutil.which("salloc") is None:
        print("error: salloc not found: the dev cluster is needed (hpcring devcluster up), or --skip cluster",
              file=sys.stderr)
        return 1
    t0 = time.monotonic()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        hosts1 = {int(k): v for k, v in saved["one_host"].items()}
        dev = saved["dev_cluster"]
    else:
        hosts1, dev = {}, {}
        rounds1, rounds_dev = [], []
        for _ in range(args.rounds):      # in turn: a drift of the host's speed hits all three alike
            if "onehost" not in skip:
                rounds1.append(one_host(args))
            if "cluster" not in skip:
                rounds_dev.append(cluster(args))
        if rounds1:
            hosts1 = {n: merge_rounds([r[n] for r in rounds1]) for n in rounds1[0]}
        if rounds_dev:
            dev = merge_rounds(rounds_dev)
    n_dev = args.nodes * args.per_node
    layouts = [(f"1 host x {n1}", res, n1) for n1, res in hosts1.items()]
    if dev:
        layouts.append((f"dev cluster {args.nodes}x{args.per_node}", dev, n_dev))
    for layout, res, n in layouts:
        for coll in args.collectives:
            for impl in IMPLS:
                if impl not in res:
                    continue
                print()
                title = f"{impl}: {layout}, {coll}" + ("" if coll == "barrier" else " float32") + \
                    (" sum" if coll in ("allreduce", "reduce_scatter") else "")
                for line in nccl_table(title, [r for r in res[impl] if r["collective"] == coll], coll, n):
                    print(line)
    for layout, res, n in layouts:
        print()
        if args.rounds > 1:
            print(f"# {layout}: the median of {args.rounds} rounds, the implementations in turn")
        for line in ratio_table(layout, res, args.collectives):
            print(line)
    if args.markdown:
        for line in markdown(layouts, args.collectives):
            print(line)
    wrong = sum(r["wrong"] for _, res, _ in layouts for rows in res.values() for r in rows)
    print(f"\n# wrong elements in all runs: {wrong}; host: {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end; {time.monotonic() - t0:.0f} s in all")
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"one_host": {str(k): v for k, v in hosts1.items()}, "dev_cluster": dev,
                                               "nodes": args.nodes, "per_node": args.per_node,
                                               "sizes": args.sizes, "quick": args.quick, "rounds": args.rounds},
                                              indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
