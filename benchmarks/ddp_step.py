"""Time a data-parallel training step: no communication, DDP on gloo / nccl / hpcring, plain hpcring.

    python benchmarks/ddp_step.py -n 2 --model cnn            # <= 1 MB of gradients, CPU
    python benchmarks/ddp_step.py -n 2 --model mlp10          # ~10 MB of gradients, CPU
    python benchmarks/ddp_step.py -n 1 --model resnet18       # ResNet-18-like (11.2 M params), GPU if any
    hpcring submit benchmarks/ddp_step.py --nodes 2 -- --model resnet18

Without a job around it, the script starts ``-n`` local ranks with ``hpcring run``. Every rank
builds the same model and synthetic batch; each mode is a separate copy of the model:

  none              forward + backward + SGD step, no communication (the floor)
  ddp-gloo          DistributedDataParallel on a gloo group
  ddp-nccl          DistributedDataParallel on an nccl group (CUDA only)
  ddp-hpcring       DistributedDataParallel on the hpcring backend
  hpcring-per-grad  after backward, Communicator.allreduce on each gradient (sum, in place)
  hpcring-grouped   after backward, one Communicator.allreduce_grouped of all gradients

Modes run interleaved in rounds (so a machine whose load changes affects all alike); the table
shows the median and 10th/90th percentile step time (ms) of the slowest rank per step, and the
ratio to ``none`` and to ``ddp-gloo`` (or ``ddp-nccl`` on a GPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", type=int, default=2, help="local ranks when started outside a job")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp10", "resnet18"])
    p.add_argument("--batch", type=int, default=16, help="per-rank batch")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode before the first round")
    p.add_argument("--modes", default="none,ddp-gloo,ddp-nccl,ddp-hpcring,hpcring-per-grad,hpcring-grouped")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is visible")
    p.add_argument("--profile", default=None, metavar="MODE",
                   help="after the table, rank 0 profiles a few steps of MODE with torch.profiler and prints "
                        "the operators taking the most CPU time (where a mode's extra time goes)")
    return p.parse_args()


def build(name: str):
    import torch.nn as nn
    if name == "cnn":        # 0.39 MB of gradients
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())
        model = nn.Sequential(block(3, 32), nn.MaxPool2d(2), block(32, 64), nn.MaxPool2d(2), block(64, 128),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
        return model, (3, 32, 32)
    if name == "mlp10":      # 11.8 MB of gradients, little compute
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(),
                              nn.Linear(768, 10))
        return model, (3, 32, 32)
    from models import resnet18          # benchmarks/models.py (the script's folder is on sys.path)
    return resnet18(), (3, 64, 64)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpcring
    import hpcring.distributed  # noqa: F401  (registers "hpcring")

    cuda = torch.cuda.is_available() and not args.cpu
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"ddp-gloo": dist.new_group(backend="gloo"), "ddp-hpcring": dist.new_group(backend="hpcring")}
    if cuda:
        groups["ddp-nccl"] = dist.new_group(backend="nccl")
    comm = hpcring.init().communicator()
    modes = [m for m in args.modes.split(",") if m in groups or not m.startswith("ddp-")]

    base, shape = build(args.model)
    base = base.to(device)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, *shape, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    grad_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 1e6

    runners = {}
    for mode in modes:
        model = _copy(base)
        if mode.startswith("ddp-"):
            model = DDP(model, device_ids=[device.index] if cuda else None, process_group=groups[mode])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        params = [p for p in model.parameters()]

        def step(model=model, opt=opt, params=params, mode=mode):
            opt.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model(x), y).backward()
            if mode == "hpcring-per-grad":
                for p in params:
                    comm.allreduce(p.grad, out=p.grad)
            elif mode == "hpcring-grouped":
                comm.allreduce_grouped([p.grad for p in params], inplace=True)
            opt.step()
            if cuda:
                torch.cuda.synchronize(device)
        runners[mode] = step

    for mode in modes:
        for _ in range(args.warmup):
            runners[mode]()
    times: dict[str, list[float]] = {m: [] for m in modes}
    sync = torch.zeros(1, device=device)
    for _ in range(args.rounds):
        for mode in modes:
            for _ in range(args.steps):
                dist.all_reduce(sync)                 # start together
                t0 = time.perf_counter()
                runners[mode]()
                times[mode].append(time.perf_counter() - t0)
    # the slowest rank's time per step
    for mode in modes:
        t = torch.tensor(times[mode], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["ddp-gloo"])
        times[mode] = t.tolist()
    if rank == 0:
        ref = "ddp-nccl" if "ddp-nccl" in times else "ddp-gloo"
        med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
        print(f"# ddp_step: {size} ranks, model {args.model} ({grad_mb:.2f} MB of gradients), batch {args.batch}/rank, "
              f"device {device}, {args.rounds}x{args.steps} steps per mode, backend of hpcring collectives: "
              f"{comm.backend.name}")
        print(f"# {'mode':<18}{'median ms':>10}{'p10':>9}{'p90':>9}{'/none':>8}{'/' + ref:>12}")
        for m, v in times.items():
            q = statistics.quantiles([s * 1e3 for s in v], n=10)
            ratio = f"{med[m] / med[ref]:.2f}" if ref in med else "-"
            print(f"  {m:<18}{med[m]:>10.2f}{q[0]:>9.2f}{q[-1]:>9.2f}{med[m] / med['none']:>8.2f}{ratio:>12}"
                  if "none" in med else f"  {m:<18}{med[m]:>10.2f}", flush=True)
    if args.profile in runners:
        _profile(runners[args.profile], args.profile, cuda, rank)
    dist.destroy_process_group()


def _profile(step, mode: str, cuda: bool, rank: int) -> None:
    """torch.profiler over 5 steps of one mode (every rank steps: collectives must match)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
    if rank == 0:
        print(f"\n# torch.profiler, 5 steps of {mode} (rank 0), by CPU time including children:")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))


def _copy(model):
    import copy
    return copy.deepcopy(model)


def main() -> None:
    args = parse()
    if "RANK" in os.environ or "HPCRING_SESSION" in os.environ:
        rank_main(args)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(args.ranks), "--",
           sys.executable, "-W", "ignore", __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
