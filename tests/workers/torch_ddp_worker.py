"""A plain DDP-on-gloo training script, written as torch users write it (pytorch/examples'
DDP tutorial: env:// rendezvous from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), that does not
import hpcring, with one fault for hang-report tests.

Usage: torch_ddp_worker.py SCENARIO [VICTIM] [--steps N] [--pg-timeout SECONDS] [--no-backend]
Scenarios: none; sleep (VICTIM sits in load_batch forever at step 3); kill (VICTIM SIGKILLs itself
at step 3); stop (VICTIM SIGSTOPs itself at step 3).
Prints `TORCH_WORKER rank=R step=S` lines and `... fault=SCENARIO t=T` (flushed).
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def load_batch(step, rank, scenario, victim):
    if step == 3 and rank == victim:
        print(f"TORCH_WORKER rank={rank} fault={scenario} t={time.time():.3f} pid={os.getpid()}", flush=True)
        if scenario == "sleep":
            while True:
                time.sleep(3600)         # a rank stuck in its data loader
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("victim", type=int, nargs="?", default=-1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--pg-timeout", type=float, default=None, help="seconds; default: torch's")
    p.add_argument("--no-backend", action="store_true", help="let torch pick the backend (gloo on CPU)")
    a = p.parse_args()
    if a.no_backend:
        dist.init_process_group()
    elif a.pg_timeout:
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.pg_timeout))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(a.steps):
        x, y = load_batch(step, rank, a.scenario, a.victim)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"TORCH_WORKER rank={rank} step={step}", flush=True)
    dist.destroy_process_group()
    print(f"TORCH_WORKER rank={rank} done", flush=True)


if __name__ == "__main__":
    main()
