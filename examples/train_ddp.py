"""Train a small CNN with PyTorch DDP on the ``hpcring`` torch.distributed backend (synthetic data).

    hpcring submit examples/train_ddp.py --nodes 2 --wait             # Slurm / LSF
    hpcring run --nodes 1 --tasks-per-node 2 -- python examples/train_ddp.py --steps 20
    python examples/train_ddp.py --backend gloo ...                   # compare: gloo, nccl

The only hpcring-specific line is the backend name: under ``hpcring submit`` the backend is
registered before this script runs; anywhere else (``hpcring run``, srun, torchrun) the
``import hpcring.distributed`` below registers it. Rank 0 prints the loss, identical whatever
the backend (same seed, same data).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def model_for(name: str) -> nn.Module:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
    width = {"small": 16, "medium": 64}[name]
    return nn.Sequential(block(3, width), nn.MaxPool2d(2), block(width, 2 * width), nn.MaxPool2d(2),
                         block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="hpcring", help="hpcring (default), gloo or nccl")
    p.add_argument("--model", default="small", choices=["small", "medium"])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is visible")
    args = p.parse_args()

    if args.backend == "hpcring" and "hpcring" not in dist.Backend.backend_list:
        import hpcring.distributed  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend)    # RANK, WORLD_SIZE, MASTER_ADDR: exported by hpcring
    rank, size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available() and not args.cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)                      # same initial weights everywhere (DDP broadcasts anyway)
    model = DDP(model_for(args.model).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)   # each rank its own shard of the synthetic data
    data = [(torch.randn(args.batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen))
            for _ in range(8)]
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{size} ranks, backend {dist.get_backend()}, device {device}, model {args.model} "
              f"({n} parameters, {n * 4 / 1e6:.2f} MB of gradients)", flush=True)

    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in data[step % len(data)])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            avg = loss.detach().clone()
            dist.all_reduce(avg)             # the mean over ranks, on the same backend
            if rank == 0:
                print(f"step {step:4d} loss {avg.item() / size:.6f}", flush=True)
    took = time.perf_counter() - t0
    if rank == 0:
        print(f"{args.steps} steps in {took:.2f} s ({args.steps * args.batch * size / took:.0f} samples/s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
