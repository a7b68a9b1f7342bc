"""Step time of three parallel layouts on the ``hpcring`` torch backend vs gloo, locally and on the dev cluster.

    python benchmarks/parallel_layouts.py                        # 4 local ranks, then dev cluster 2 x 2
    python benchmarks/parallel_layouts.py --where local          # only local (hpcring run)
    python benchmarks/parallel_layouts.py --where devcluster --nodes 3 --hpcring-backends ring,mpi

Layouts (the same residual MLP, CPU, float32; every rank does about the same arithmetic):

  ddp    DistributedDataParallel over all ranks (gradient all-reduce in 25 MB buckets)
  hsdp   FSDP2 fully_shard per block on a (replicate, shard) mesh: shard = the ranks of one node
         (all-gather of parameters, reduce-scatter of gradients), replicate across nodes (all-reduce)
  pp     2-stage pipeline, Schedule1F1B, 4 microbatches (torch.distributed.pipelining: isend/irecv
         of activations and their gradients), x data parallel: a (pp, dp) mesh whose pp groups
         span nodes; the gradients all-reduced over dp after each step

One job per place runs every layout on both backends, interleaved in rounds (a load change on this
shared machine then hits both alike): hpcring is the default group (HPCRING_BACKEND picks its
transport: ring or mpi), gloo the same layout on gloo groups over the same ranks (DDP's
process_group, the mesh's backend_override, the pipeline stage's group). Warmup steps are not
timed; each timed step starts with a gloo all-reduce of one element (all ranks start together)
and its time is the slowest rank's. The table: median, min and max step time (ms) and
hpcring/gloo of the medians; the load average before and after each job.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("ddp", "hsdp", "pp")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--where", default="local,devcluster", help="local, devcluster or both")
    p.add_argument("--ranks", type=int, default=4, help="local ranks")
    p.add_argument("--nodes", type=int, default=2, help="dev-cluster nodes (2 ranks each)")
    p.add_argument("--hpcring-backends", default="ring,mpi",
                   help="HPCRING_BACKEND per job: ring, mpi or both (mpi: on the dev cluster only)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch (pp: 2x per pipeline, 4 microbatches)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per layout and backend")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per layout and backend per round")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# ---- one rank --------------------------------------------------------------------------------
def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import hpcring.distributed  # noqa: F401  (registers "hpcring"; hpcring submit did already)
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("hpcring")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    shard = local if 1 < local < size and size % local == 0 else 2
    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

    def blocks(lo, hi, head):
        torch.manual_seed(0)
        every = [Block(args.width) for _ in range(args.blocks)]
        return nn.Sequential(*every[lo:hi], *([nn.Linear(args.width, 10)] if head else []))

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    x2 = torch.randn(2 * args.batch, args.width, generator=gen)
    y2 = torch.randint(0, 10, (2 * args.batch,), generator=gen)

    def mesh(shape, names, backend):
        override = None if backend == "hpcring" else {n: "gloo" for n in names}
        return init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=override)

    def make(layout, backend):
        """One step of ``layout`` on ``backend`` (its own copy of the model and optimizer)."""
        if layout == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(blocks(0, args.blocks, True), process_group=None if backend == "hpcring" else gloo)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step():
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            return step
        if layout == "hsdp":
            from torch.distributed.fsdp import fully_shard
            m = mesh((size // shard, shard), ("replicate", "shard"), backend)
            model = blocks(0, args.blocks, True)
            for b in model:
                fully_shard(b, mesh=m)
            fully_shard(model, mesh=m)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step():
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            return step
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        m = mesh((2, size // 2), ("pp", "dp"), backend)     # pp groups {r, r + size/2}: across nodes
        pp, dp = m.get_local_rank("pp"), m.get_group("dp")
        half = args.blocks // 2
        model = blocks(0, half, False) if pp == 0 else blocks(half, args.blocks, True)
        stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=m.get_group("pp"))
        sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        params = list(model.parameters())

        def step():
            opt.zero_grad()
            sched.step(x2) if pp == 0 else sched.step(target=y2, losses=[])
            if size > 2:                                     # data parallel over the pipelines
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, group=dp)
                flat /= size // 2
                off = 0
                for p in params:
                    p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                    off += p.numel()
            opt.step()
        return step

    cells = [(lay, b) for lay in args.layouts.split(",") for b in ("hpcring", "gloo")]
    steps = {c: make(*c) for c in cells}
    sync = torch.zeros(1)
    for c in cells:
        for _ in range(args.warmup):
            steps[c]()
    times = {c: [] for c in cells}
    for _ in range(args.rounds):
        for c in cells:
            for _ in range(args.steps):
                dist.all_reduce(sync, group=gloo)           # start together
                t0 = time.perf_counter()
                steps[c]()
                times[c].append(time.perf_counter() - t0)
    comms = getattr(dist.distributed_c10d._get_default_group(), "_comms", {})
    # the c10d wrapper of a "cpu:hpcring" group hides our object: then the transport asked for
    transport = ",".join(sorted({c.backend.name for c in comms.values()})) or os.environ.get("HPCRING_BACKEND", "auto")
    out = []
    for c in cells:
        t = torch.tensor(times[c], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)   # the slowest rank's time per step
        out.append({"layout": c[0], "backend": c[1] if c[1] == "gloo" else f"hpcring/{transport}",
                    "ms": [v * 1e3 for v in t.tolist()]})
    if rank == 0:
        n = sum(p.numel() for p in Block(args.width).parameters()) * args.blocks
        print("PLRESULT " + json.dumps({"ranks": size, "params": n, "cells": out}), flush=True)
    dist.destroy_process_group()


# ---- the driver ------------------------------------------------------------------------------
def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all of this host's cores (the dev cluster's nodes share them)."""
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def worker_args(args) -> list[str]:
    return ["--worker", "--layouts", args.layouts, "--width", str(args.width), "--blocks", str(args.blocks),
            "--batch", str(args.batch), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--steps", str(args.steps)]


def run_job(args, where: str, transport: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "HPCRING_BACKEND": transport, "HPCRING_TIMEOUT": "120"}
    if where == "local":
        cmd = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(args.ranks), "--",
               sys.executable, "-W", "ignore", __file__, *worker_args(args)]
    else:
        cmd = [sys.executable, "-m", "hpcring", "submit", __file__, "--site", "devcluster", "--nodes", str(args.nodes),
               "--tasks-per-node", "2", "--time", "15", "--wait", "--", *worker_args(args)]
    before, t0, ticks = load(), time.time(), cpu_ticks()
    with tempfile.TemporaryDirectory(prefix="parallel-layouts-") as tmp:     # the ranks' files, if any
        local = where == "local"
        p = subprocess.run(cmd, env={**env, "HPCRING_JOB_DIR": tmp} if local else env, capture_output=True,
                           text=True, timeout=1200, cwd=tmp if local else str(ROOT), stdin=subprocess.DEVNULL)
    m = re.search(r"PLRESULT (\{.*\})$", p.stdout, re.M)
    if p.returncode or not m:
        sys.exit(f"{where} job failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    res = json.loads(m.group(1))
    busy = [b - a for a, b in zip(ticks, cpu_ticks())]
    res["busy"] = f"{100 * busy[0] / max(1, busy[1]):.0f}%"
    res.update(where=where if where == "local" else f"devcluster {args.nodes}x2", load=f"{before} -> {load()}",
               took=time.time() - t0)
    return res


def main() -> None:
    args = parse()
    if args.worker:
        rank_main(args)
        return
    jobs = []
    for where in args.where.split(","):
        for transport in args.hpcring_backends.split(","):
            if where == "local" and transport == "mpi":
                continue                 # hpcring run starts no MPI job; mpi needs srun/mpirun
            print(f"# {where}, hpcring on {transport} ...", file=sys.stderr, flush=True)
            jobs.append(run_job(args, where, transport))
    print(f"# parallel_layouts: residual MLP {args.blocks} x width {args.width} "
          f"({jobs[0]['params'] / 1e6:.1f} M parameters, {jobs[0]['params'] * 4 / 1e6:.0f} MB of gradients), "
          f"batch {args.batch}/rank, CPU float32, {args.warmup} warmup + {args.rounds}x{args.steps} timed steps "
          f"per cell; step time = slowest rank's")
    print(f"{'layout':<7}{'backend':<14}{'ranks':>6}  {'where':<16}{'median ms':>10}{'min':>9}{'max':>9}"
          f"{'hpcring/gloo':>14}")
    for job in jobs:
        med = {}
        for c in job["cells"]:
            med[(c["layout"], c["backend"])] = statistics.median(c["ms"])
        for c in job["cells"]:
            ref = med.get((c["layout"], "gloo"))
            ratio = f"{med[(c['layout'], c['backend'])] / ref:.2f}" if c["backend"] != "gloo" and ref else ""
            print(f"{c['layout']:<7}{c['backend']:<14}{job['ranks']:>6}  {job['where']:<16}"
                  f"{statistics.median(c['ms']):>10.1f}{min(c['ms']):>9.1f}{max(c['ms']):>9.1f}{ratio:>14}")
    for job in jobs:
        print(f"# {job['where']}: load average (1, 5, 15 min) {job['load']}; host CPU busy {job['busy']} "
              f"during the job ({os.cpu_count()} cores); job took {job['took']:.0f} s")


if __name__ == "__main__":
    main()
