"""DDP training that checkpoints and resumes: the job benchmarks/recovery.py breaks.

    recovery_train.py OUT_DIR [--steps N] [--step-s S] [--ckpt-every K] [--backend hpcring|gloo]

Deterministic (the batch of step k and rank r depends on k and r only): a run restarted from its
checkpoint ends with the same weights as one that was never interrupted and followed the same
checkpoint schedule. Rank 0 saves (step, model, optimizer) to OUT_DIR/ckpt.pt every ``--ckpt-every``
steps (atomically), and every rank resumes from it on a restart (hpcring.requeue_count() > 0 under
hpcring; TORCHELASTIC_RESTART_COUNT under torchrun). Every step prints ``STEP k rank r size n
t=<epoch s>``; ``--step-s`` pads each step to at least that long (a real step's compute). At the end
rank 0 writes OUT_DIR/result.json: the weights' checksum, steps, restarts, world size.
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def restarts() -> int:
    for var in ("HPCRING_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.25)
    p.add_argument("--ckpt-every", type=int, default=1)
    p.add_argument("--backend", default="hpcring")
    a = p.parse_args()
    if a.backend == "hpcring":
        import hpcring.distributed  # noqa: F401  (registers the backend outside `hpcring submit`)
    dist.init_process_group(a.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = os.path.join(a.out, "ckpt.pt")
    step = 0
    if restarts() and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    print(f"START rank {rank} size {size} step {step} restarts {restarts()} host {os.uname().nodename} "
          f"t={time.time():.3f}", flush=True)
    while step < a.steps:
        t0 = time.time()
        # the global batch of this step: the same samples whatever the world size
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(48, 64, generator=g), torch.randint(0, 10, (48,), generator=g)
        mine = slice(rank * 48 // size, (rank + 1) * 48 // size)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine], reduction="sum") * size / 48
        loss.backward()
        opt.step()
        step += 1
        if rank == 0 and step % a.ckpt_every == 0:
            tmp = ckpt + ".tmp"
            torch.save({"step": step, "model": model.module.state_dict(), "opt": opt.state_dict()}, tmp)
            os.replace(tmp, ckpt)
        time.sleep(max(0.0, a.step_s - (time.time() - t0)))
        print(f"STEP {step} rank {rank} size {size} t={time.time():.3f}", flush=True)
    if rank == 0:
        w = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"sha256": hashlib.sha256(w.numpy().tobytes()).hexdigest(), "steps": step, "size": size,
                       "restarts": restarts()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
