"""Allreduce: hpcring ring vs Open MPI (mpi4py) vs torch Gloo, on one host and on the dev cluster,
with the physical yardsticks measured in the same run. One command prints everything:

    python benchmarks/compare_devcluster.py                 # all of it (about 10 minutes on 2 cores)
    python benchmarks/compare_devcluster.py --quick         # fewer iterations
    python benchmarks/compare_devcluster.py --skip onehost  # parts: ring,mpi,gloo,link,onehost,yard
    python benchmarks/compare_devcluster.py --skip ring,mpi,gloo,link --one-host-sizes 16M,64M,256M
                                                            # a multi-core host without the dev cluster

Needs the dev cluster up (`hpcring devcluster up`), Open MPI + mpi4py, CPU torch and iperf3.

  * dev cluster, 3 nodes x 1 rank (--nodes/--per-node): ring (hpcring run --site devcluster),
    Open MPI (srun --mpi=pmix, btl tcp,self,vader on eth0), torch gloo (env://);
  * link: iperf3 node2 -> node1 (hpcring devcluster exec), one stream, 3 s; and the ring's own
    pattern, node i -> node i+1 on every link at once (the namespaces share this host's cores);
  * one host, 2/4/8 ranks (--one-host-ranks), 4 KiB, 16 and 64 MiB: ring (hpcring run --nodes 1, so
    the ranks share memory), mpirun -np n (Open MPI's own shared memory), torch gloo;
  * yardsticks on this host: one loopback TCP stream (iperf3 -P 1), memcpy and float32 add
    (numpy, 64 MiB; GB/s of output).

Tables use nccl-tests' columns: busbw = size / time * 2(n-1)/n; time = mean per call on the
slowest rank; #wrong = elements differing from the exact expected sum, checked on every rank in
every run (small integers); host CPU = the share of this host's cores busy during the timed loop
(/proc/stat, 10 ms ticks: coarse for short loops), printed for iperf3 too, since the dev cluster's
nodes share these cores: a yardstick that keeps them busy is bounded by CPU, not by the wire. The ratios against the issue's targets are printed as measured, and
where a dev-cluster target is missed a timing breakdown of the ring says where the time goes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]
# 4 KiB: a latency, compared with Open MPI's: enough calls (a few ms to a few 10 ms) that the
# loop is not one scheduler tick's noise
ITERS = {4 << 10: 2000, 1 << 20: 20, 16 << 20: 5, 64 << 20: 3, 256 << 20: 3}
# the dev cluster's shared folder; elsewhere (a GPU machine, one host) the runs start from the root
SHARED = Path("/srv/hpcring") if Path("/srv/hpcring").is_dir() else ROOT
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_tcp_if_include": "eth0", "OMPI_MCA_oob_tcp_if_include": "eth0",
           "OMPI_MCA_btl": "tcp,self,vader", "OMPI_MCA_mpi_yield_when_idle": "1"}


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all of this host's cores (/proc/stat is not per namespace, so the
    dev cluster's nodes and this process read the same counters)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)          # idle + iowait
    return sum(v) - idle, sum(v)


def cpu_busy(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Fraction of the host's cores busy between two :func:`cpu_ticks` samples."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds / 1e9 * 2 * (n - 1) / n if seconds > 0 else 0.0


def iters_for(nbytes: int, quick: bool) -> int:
    it = ITERS.get(nbytes, 5)
    return max(2, it // 4) if quick else it


# ---------------------------------------------------------------------------------------------
# workers (one per rank)
# ---------------------------------------------------------------------------------------------
def worker(kind: str, sizes: list[int], quick: bool, breakdown: bool) -> None:
    if kind == "mpi":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()
        call = lambda x, out: comm.Allreduce(x, out, op=MPI.SUM)  # noqa: E731
        barrier, tmax = comm.Barrier, lambda v: comm.allreduce(v, op=MPI.MAX)
        isum = lambda v: comm.allreduce(v, op=MPI.SUM)  # noqa: E731
    elif kind == "gloo":
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        rank, n = dist.get_rank(), dist.get_world_size()

        def call(x, out):
            t = torch.from_numpy(out)
            t.copy_(torch.from_numpy(x))
            dist.all_reduce(t)
        barrier = dist.barrier

        def tmax(v):
            t = torch.tensor([v], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t[0])

        def isum(v):
            t = torch.tensor([v], dtype=torch.int64)
            dist.all_reduce(t)
            return int(t[0])
    else:
        import hpcring
        c = hpcring.init().communicator("ring")
        rank, n = c.rank, c.size
        call = lambda x, out: c.allreduce(x, out=out)  # noqa: E731
        barrier = c.barrier
        tmax = lambda v: float(c.allreduce(np.array([v]), op="max")[0])  # noqa: E731
        isum = lambda v: int(c.allreduce(np.array([v], np.int64))[0])  # noqa: E731
    for nbytes in sizes:
        count = nbytes // 4
        x = np.full(count, rank + 1, np.float32)
        out = np.zeros_like(x)
        it = iters_for(nbytes, quick)
        for _ in range(1 if nbytes >= (16 << 20) else 3 if nbytes >= (1 << 20) else 100):
            call(x, out)
        barrier()
        c0, t0 = cpu_ticks(), time.perf_counter()
        for _ in range(it):
            call(x, out)
        t = tmax((time.perf_counter() - t0) / it)
        cpu = cpu_busy(c0, cpu_ticks())
        wrong = isum(int(np.count_nonzero(out != n * (n + 1) / 2)))
        rec = {"kind": kind, "n": n, "size": nbytes, "time": t, "busbw": busbw(nbytes, t, n), "wrong": wrong,
               "cpu": cpu}
        if kind == "ring" and hasattr(c.backend, "describe"):
            rec["transport"] = c.backend.describe()
        if breakdown and kind == "ring":
            rec.update(_ring_breakdown(c, x, out, it))
        if rank == 0:
            print("CMPROW " + json.dumps(rec), flush=True)
    if kind == "gloo":
        import torch.distributed as dist
        dist.destroy_process_group()


def _ring_breakdown(c, x, out, it: int) -> dict:
    """Native call alone (no Python API layer), and this host's numpy add rate for the same size."""
    be = c.backend
    c.barrier()
    t0 = time.perf_counter()
    for _ in range(it):
        be.allreduce(x, out, "float32", "sum", 300.0)
    native = float(c.allreduce(np.array([(time.perf_counter() - t0) / it]), op="max")[0])
    y = np.empty_like(x)
    t0 = time.perf_counter()
    for _ in range(3):
        np.add(x, out, out=y)
    add = (time.perf_counter() - t0) / 3
    return {"native_time": native, "add_time": add}


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _rows(stdout: str) -> list[dict]:
    return [json.loads(l.split("CMPROW ", 1)[1]) for l in stdout.splitlines() if "CMPROW " in l]


def _run(label: str, argv: list[str], env: dict, timeout: int = 900) -> list[dict]:
    t0 = time.monotonic()
    print(f"# {label}: {' '.join(argv[:12])}{' ...' if len(argv) > 12 else ''}", flush=True)
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(SHARED),
                       stdin=subprocess.DEVNULL)
    rows = _rows(p.stdout)
    if p.returncode or not rows:
        print(f"#   FAILED (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-1500:]}", flush=True)
    print(f"#   {time.monotonic() - t0:.1f} s", flush=True)
    return rows


def worker_argv(kind: str, args, sizes: list[int], breakdown: bool = True) -> list[str]:
    a = [sys.executable, str(THIS), "--worker", kind, "--sizes", ",".join(map(str, sizes))]
    return a + (["--quick"] if args.quick else []) + (["--breakdown"] if breakdown else [])


def salloc(args) -> list[str]:
    return ["salloc", "-N", str(args.nodes), f"--ntasks-per-node={args.per_node}", "--time=10", "-Q"]


def hpcring_run(args) -> list[str]:
    return [sys.executable, "-m", "hpcring", "run", "--site", "devcluster", "--tasks-per-node", str(args.per_node), "--"]


CPU_BUSY: dict[str, float | None] = {}   # yardstick -> host cores busy while it ran


def iperf_pairs(pairs: list[tuple[int, int]], seconds: int = 3, label: str = "") -> float | None:
    """iperf3 from node a to node b for every (a, b) in ``pairs``, all at once (one stream each);
    the mean rate in GB/s (1e9 bytes/s), or None. The clients enter their namespaces through
    nsenter directly, so concurrent ones start together. The host's CPU use while they run goes
    to ``CPU_BUSY[label]``."""
    if shutil.which("iperf3") is None:
        print("# iperf3 not installed: no link rate")
        return None
    sys.path.insert(0, str(ROOT / "src"))
    from hpcring.devcluster.cluster import node_exec_argv

    def ex(i: int) -> list[str]:
        return node_exec_argv(f"node{i}")
    servers = [subprocess.Popen(ex(b) + ["iperf3", "-s", "-1", "-p", str(5300 + b)], env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
               for _, b in pairs]
    try:
        time.sleep(1.0)
        c0 = cpu_ticks()
        clients = [subprocess.Popen(ex(a) + ["iperf3", "-c", f"10.99.0.{b}", "-p", str(5300 + b), "-t", str(seconds), "-J"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                    stdin=subprocess.DEVNULL)
                   for a, b in pairs]
        rates = []
        for c in clients:
            out, err = c.communicate(timeout=seconds + 30)
            if c.returncode:
                print(f"# iperf3 failed: {err.strip()[-500:]}")
                return None
            rates.append(json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9)
        CPU_BUSY[label] = cpu_busy(c0, cpu_ticks())
        return sum(rates) / len(rates)
    finally:
        for sv in servers:
            try:
                sv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sv.kill()


def iperf() -> float | None:
    """One link alone: node2 -> node1."""
    return iperf_pairs([(2, 1)], label="link")


def iperf_ring(nodes: int) -> float | None:
    """The ring's own traffic pattern as a yardstick: node i -> node i+1 on every link at once (as
    the ring sends while it receives), per link. On one host the namespaces' veths share its
    cores, so concurrent links are slower than one."""
    return iperf_pairs([(i, i % nodes + 1) for i in range(1, nodes + 1)], label="pattern") if nodes >= 2 else None


ONE_HOST_SIZES = [4 << 10, 16 << 20, 64 << 20]       # --one-host-sizes (4 KiB: issue 23's latency target)


def one_host(args) -> dict[int, dict[str, list[dict]]]:
    """n ranks on this host (outside Slurm), for n in --one-host-ranks: ring, Open MPI, gloo."""
    env = {k: v for k, v in _env().items() if not k.startswith(("SLURM_", "OMPI_MCA_btl_tcp", "OMPI_MCA_oob"))}
    out: dict[int, dict[str, list[dict]]] = {}
    for n in args.one_host_ranks:
        local = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(n), "--"]
        res = {"hpcring ring": _run(f"ring, 1 host x {n}", local + worker_argv("ring", args, args.one_host_sizes, False), env)}
        if shutil.which("mpirun"):
            menv = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        OMPI_MCA_mpi_yield_when_idle="1")
            res["Open MPI (mpi4py)"] = _run(f"mpi, 1 host x {n}", ["mpirun", "--oversubscribe", "-np", str(n)]
                                            + worker_argv("mpi", args, args.one_host_sizes, False), menv)
        res["torch gloo"] = _run(f"gloo, 1 host x {n}", local + worker_argv("gloo", args, args.one_host_sizes, False), env)
        out[n] = res
    return out


def yardsticks() -> dict[str, float | None]:
    """GB/s on this host: one loopback TCP stream (iperf3), memcpy and float32 add (numpy, 64 MiB)."""
    out: dict[str, float | None] = {"tcp1": None}
    if shutil.which("iperf3"):
        server = subprocess.Popen(["iperf3", "-s", "-1", "-p", "5298"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            p = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", "5298", "-t", "3", "-P", "1", "-J"],
                               capture_output=True, text=True, timeout=40, stdin=subprocess.DEVNULL)
            if p.returncode == 0:
                out["tcp1"] = json.loads(p.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
        finally:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    a = np.ones(16 << 20, np.float32)
    b, c = np.ones_like(a), np.empty_like(a)

    def best(fn) -> float:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return a.nbytes / min(ts) / 1e9
    out["memcpy"] = best(lambda: np.copyto(c, a))
    out["add"] = best(lambda: np.add(a, b, out=c))
    return out


def nccl_table(title: str, rows: list[dict], n: int) -> list[str]:
    """nccl-tests columns for one implementation and layout."""
    lines = [f"# {title}"]
    if rows and rows[0].get("transport"):
        lines.append(f"# transport: {rows[0]['transport']}")
    lines += [f"#{'size':>11} {'count':>11} {'type':>6} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"
              f" {'host CPU':>9}",
              f"#{'(B)':>11} {'(elements)':>11} {'':>6} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"
              f" {'(busy)':>9}"]
    if not rows:
        lines.append("#   (no result: see the FAILED line above)")
    for r in rows:
        lines.append(f" {r['size']:>11} {r['size'] // 4:>11} {'float':>6} {'sum':>6} {r['time'] * 1e6:>10.1f} "
                     f"{r['size'] / r['time'] / 1e9:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7}"
                     f" {'' if r.get('cpu') is None else format(r['cpu'], '.0%'):>9}")
    return lines


def verdict(name: str, value: float | None, target: float, fmt: str = "{:.2f}x") -> tuple[str, bool | None]:
    if value is None:
        return f"  {name}: not measured", None
    ok = value >= target
    return f"  {name}: {fmt.format(value)} (target >= {fmt.format(target)}) {'MET' if ok else 'MISSED'}", ok


def breakdown(rows: list[dict], link: float | None, n: int) -> list[str]:
    """Where the ring's time goes, per size."""
    out = ["# ring timing breakdown (per call, slowest rank):",
           f"#{'size':>11} {'total us':>10} {'python API':>11} {'native':>10} {'wire@iperf':>11} {'reduce@np.add':>14} {'other':>10}"]
    for r in rows:
        if "native_time" not in r:
            continue
        s = r["size"]
        wire = 2 * (n - 1) / n * s / (link * 1e9) if link else 0.0
        red = (n - 1) / n * r["add_time"]          # reduce-scatter phase adds (n-1)/n of the buffer
        other = r["native_time"] - wire - red
        out.append(f"{s:>12} {r['time'] * 1e6:>10.0f} {(r['time'] - r['native_time']) * 1e6:>11.0f} "
                   f"{r['native_time'] * 1e6:>10.0f} {wire * 1e6:>11.0f} {red * 1e6:>14.0f} {other * 1e6:>10.0f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--per-node", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of: ring,mpi,gloo,link,onehost,yard")
    ap.add_argument("--one-host-ranks", default="2,4,8", type=lambda t: [int(x) for x in t.split(",") if x],
                    help="rank counts for the one-host comparison")
    ap.add_argument("--one-host-sizes", default=ONE_HOST_SIZES,
                    type=lambda t: [int(float(x[:-1]) * (1 << {"K": 10, "M": 20}[x[-1].upper()])) if x[-1:] in "KkMm"
                                    else int(x) for x in t.split(",") if x],
                    help="sizes for the one-host comparison, e.g. 4K,16M,64M,256M (default 16M,64M)")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--worker", choices=["ring", "mpi", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES, args.quick, args.breakdown)
        return 0
    skip = set(filter(None, args.skip.split(",")))
    n = args.nodes * args.per_node
    cluster = not {"ring", "mpi", "gloo"} <= skip
    if cluster and shutil.which("salloc") is None:
        print("error: salloc not found: the dev cluster is needed (hpcring devcluster up), or --skip ring,mpi,gloo,link",
              file=sys.stderr)
        return 1
    env = _env()
    results: dict[str, list[dict]] = {}
    if "ring" not in skip:
        results["hpcring ring"] = _run("ring", salloc(args) + hpcring_run(args) + worker_argv("ring", args, SIZES), env)
    if "mpi" not in skip:
        results["Open MPI (mpi4py)"] = _run(
            "mpi", salloc(args) + ["srun", "--mpi=pmix", "--kill-on-bad-exit=1"] + worker_argv("mpi", args, SIZES, False),
            dict(env, **MPI_ENV))
    if "gloo" not in skip:
        results["torch gloo"] = _run("gloo", salloc(args) + hpcring_run(args) + worker_argv("gloo", args, SIZES, False), env)
    link = None if "link" in skip else iperf()
    link_ring = None if "link" in skip else iperf_ring(args.nodes)
    hosts1 = {} if "onehost" in skip else one_host(args)
    yard = {} if "yard" in skip else yardsticks()

    def gbs(v):
        return f"{v:.3f} GB/s" if v else "n/a"
    print()
    print(f"# yardsticks (this host, same run): one loopback TCP stream {gbs(yard.get('tcp1'))}, memcpy "
          f"{gbs(yard.get('memcpy'))}, float32 add {gbs(yard.get('add'))}; dev-cluster link (iperf3 node2->node1) "
          f"{gbs(link)}, the ring's pattern (node i -> i+1, all {args.nodes} links at once) {gbs(link_ring)} per link")
    if CPU_BUSY:
        print("# host CPU busy (all " + str(os.cpu_count()) + " cores, shared by every node) while iperf3 ran: " +
              ", ".join(f"{k} {v:.0%}" for k, v in CPU_BUSY.items() if v is not None) +
              "; a link whose iperf3 keeps the cores busy is bounded by CPU, not by the wire")
    for kind, rows in results.items():
        print()
        for line in nccl_table(f"{kind}: dev cluster, {args.nodes} nodes x {args.per_node} rank(s) = {n} ranks, "
                               f"allreduce float32 sum", rows, n):
            print(line)
    for n1, res in hosts1.items():
        for kind, rows in res.items():
            print()
            for line in nccl_table(f"{kind}: one host x {n1} ranks, allreduce float32 sum", rows, n1):
                print(line)
    wrong = sum(r["wrong"] for rows in results.values() for r in rows)
    wrong += sum(r["wrong"] for res in hosts1.values() for rows in res.values() for r in rows)
    print(f"\n# wrong elements in all runs: {wrong}")

    def at(table: dict, kind: str, s: int, key: str = "busbw"):
        r = next((r for r in table.get(kind, []) if r["size"] == s), None)
        return r[key] if r else None

    def ratio(a, b):
        return a / b if a is not None and b else None

    ring, mpi, gloo = "hpcring ring", "Open MPI (mpi4py)", "torch gloo"
    print("\n# ratios (busbw) against the issue's targets, from this run")
    missed, checks = [], []
    if 2 in hosts1:
        h = hosts1[2]
        checks.append(verdict("1 host x 2 ranks @ 64 MiB ring/gloo", ratio(at(h, ring, 64 << 20), at(h, gloo, 64 << 20)), 2.0))
        checks.append(verdict("1 host x 2 ranks @ 64 MiB ring/Open MPI", ratio(at(h, ring, 64 << 20), at(h, mpi, 64 << 20)), 1.5))
    for s in (16 << 20, 64 << 20):
        tag = f"{s >> 20} MiB"
        checks.append(verdict(f"dev cluster ring busbw / iperf3 link @ {tag}", ratio(at(results, ring, s), link), 0.60, "{:.0%}"))
        checks.append(verdict(f"dev cluster ring busbw / iperf3 in the ring's pattern @ {tag} (info)",
                              ratio(at(results, ring, s), link_ring), 0.60, "{:.0%}"))
        checks.append(verdict(f"dev cluster ring/Open MPI @ {tag}", ratio(at(results, ring, s), at(results, mpi, s)), 2.0))
        checks.append(verdict(f"dev cluster ring/gloo @ {tag}", ratio(at(results, ring, s), at(results, gloo, s)), 2.0))
    checks.append(verdict("dev cluster 4 KiB latency Open MPI time / ring time (>= 1: ring no worse)",
                          ratio(at(results, mpi, 4 << 10, "time"), at(results, ring, 4 << 10, "time")), 1.0))
    if 2 in hosts1 and 4 << 10 in args.one_host_sizes:     # issue 23: ring <= 1.2x Open MPI's time
        checks.append(verdict("1 host x 2 ranks 4 KiB latency Open MPI time x 1.2 / ring time (>= 1: "
                              "ring within 1.2x of Open MPI's shared memory)",
                              ratio(at(hosts1[2], mpi, 4 << 10, "time"), at(hosts1[2], ring, 4 << 10, "time")) and
                              1.2 * ratio(at(hosts1[2], mpi, 4 << 10, "time"), at(hosts1[2], ring, 4 << 10, "time")),
                              1.0))
    for n1, h in hosts1.items():          # the 16-core target (>= 1.5x gloo everywhere), for the record
        for s in args.one_host_sizes:
            if s < 1 << 20:
                continue                  # a bandwidth target: the MiB sizes
            checks.append(verdict(f"1 host x {n1} ranks @ {s >> 20} MiB ring/gloo (16-core target)",
                                  ratio(at(h, ring, s), at(h, gloo, s)), 1.5))
            checks.append(verdict(f"1 host x {n1} ranks @ {s >> 20} MiB ring/Open MPI (info)",
                                  ratio(at(h, ring, s), at(h, mpi, s)), 1.0))
    for line, ok in checks:
        print(line)
        if ok is False:
            missed.append(line)
    if yard.get("tcp1") or yard.get("memcpy"):
        print("# ring busbw against the yardsticks: " + ", ".join(
            f"{n1} ranks @ {s >> 20} MiB {at(h, ring, s) / yard['memcpy']:.0%} of memcpy"
            for n1, h in hosts1.items() for s in args.one_host_sizes if at(h, ring, s) and yard.get("memcpy")))
    rows = results.get(ring, [])
    if missed and rows:
        print()
        for line in breakdown(rows, link, n):
            print(line)
        print("# python API = Communicator.allreduce minus the backend's native call; wire = 2(n-1)/n*S at the iperf3 "
              "rate;\n# reduce = (n-1)/n*S of numpy float32 adds on this host; other = native - wire - reduce "
              "(copies, waiting on\n# the slowest rank: all ranks share 2 cores, syscalls, pipeline fill).")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "link_GBps": link, "link_ring_GBps": link_ring,
                                               "yardsticks": yard,
                                               "one_host": {str(k): v for k, v in hosts1.items()}}, indent=1))
    return 1 if wrong else 0

if __name__ == "__main__":
    sys.exit(main())
