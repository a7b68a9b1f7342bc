"""Train a small MLP with pipeline parallelism (torch.distributed.pipelining) on the ``hpcring`` backend.

One stage per rank: the model's blocks are split into as many contiguous stages as there are
ranks; rank 0 feeds the (synthetic) batch, the last rank computes the loss, and the activations
and their gradients travel between neighbouring ranks by point-to-point (isend/irecv).

    hpcring run --nodes 1 --tasks-per-node 2 -- python examples/train_pipeline.py --steps 3 --cpu
    hpcring submit examples/train_pipeline.py --site devcluster --nodes 2 --wait -- --steps 2 --cpu
    python examples/train_pipeline.py --backend gloo ...              # compare: gloo, nccl

``--schedule gpipe``: all forwards of the microbatches, then all backwards; ``1f1b``: one forward,
one backward in turn once the pipeline is full (fewer activations kept alive). Each stage steps
its own optimizer on its own parameters: nothing is all-reduced. The last stage prints the loss
(the mean over the microbatches), the same digits on any backend (same seed, same data).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def blocks(n: int, width: int) -> list[nn.Module]:
    """``n`` residual MLP blocks; built whole on every rank from the same seed, so each stage's
    weights are what a single process would have (then each rank keeps only its own)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(self.norm(x))))
    return [Block() for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="hpcring", help="hpcring (default), gloo or nccl")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=0, help="per step (default: 4, or the stage count if more)")
    p.add_argument("--microbatch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--blocks", type=int, default=0, help="blocks in all (default: 2 per stage)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is visible")
    args = p.parse_args()

    if args.backend == "hpcring" and "hpcring" not in dist.Backend.backend_list:
        import hpcring.distributed  # noqa: F401  (registers the backend; hpcring submit did already)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group(args.backend)    # RANK, WORLD_SIZE, MASTER_ADDR: exported by hpcring
    rank, size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available() and not args.cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    micro = args.microbatches or max(4, size)
    if args.schedule == "1f1b" and micro < size:   # 1F1B fills the pipeline first: one microbatch per stage
        p.error(f"1f1b needs at least as many microbatches as stages ({size}), not {micro}")
    batch = micro * args.microbatch_size       # a step's batch, split into the microbatches
    n = args.blocks or 2 * size
    if n < size:
        p.error(f"{n} blocks cannot fill {size} stages")

    torch.manual_seed(0)                      # the same whole model on every rank ...
    every = blocks(n, args.width)
    lo, hi = rank * n // size, (rank + 1) * n // size
    stage_mod = nn.Sequential(*every[lo:hi])  # ... of which this rank keeps blocks [lo, hi)
    if rank == size - 1:
        # the head: the loss is computed on the last stage
        stage_mod.append(nn.Sequential(nn.LayerNorm(args.width), nn.Linear(args.width, 10)))
    stage_mod.to(device)
    del every
    stage = PipelineStage(stage_mod, rank, size, device)   # neighbours: rank - 1 and rank + 1
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    pipe = schedule(stage, n_microbatches=micro, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=args.lr)

    gen = torch.Generator().manual_seed(1000)  # one data stream: rank 0 reads the inputs, the last rank the labels
    data = [(torch.randn(batch, args.width, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
            for _ in range(8)]
    params = torch.tensor([sum(q.numel() for q in stage_mod.parameters())], device=device)
    counts = [torch.zeros_like(params) for _ in range(size)]
    dist.all_gather(counts, params)           # only to print the split
    if rank == 0:
        print(f"{size} stages, schedule {args.schedule}, {micro} microbatches of "
              f"{args.microbatch_size}, backend {dist.get_backend()}, device {device}, "
              f"parameters per stage {[int(c.item()) for c in counts]}", flush=True)

    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in data[step % len(data)])
        opt.zero_grad()
        losses = []                            # filled on the last stage: one loss per microbatch
        if rank == 0 and size > 1:
            pipe.step(x)
        elif rank == size - 1:
            pipe.step(x, target=y, losses=losses) if size == 1 else pipe.step(target=y, losses=losses)
        else:
            pipe.step()                        # a middle stage: input and gradient come from its neighbours
        opt.step()                             # every stage updates its own parameters
        if rank == size - 1 and (args.steps <= 20 or step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {torch.stack(losses).double().mean().item():.8f}", flush=True)
    took = time.perf_counter() - t0
    if rank == size - 1:
        print(f"{args.steps} steps in {took:.2f} s ({took / max(1, args.steps) * 1e3:.1f} ms/step)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
