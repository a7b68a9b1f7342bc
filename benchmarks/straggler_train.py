"""The job benchmarks/stragglers.py runs on every rank: steps of "compute" then collectives.

    STEPS=300 SLOW_RANK=5 SLOW_FACTOR=1.3 MODE=sleep python benchmarks/straggler_train.py

MODE ``sleep``: compute is a sleep of WORK_MS (a GPU computing while the host waits, so that 8
ranks on 2 cores do not fight for them), then a NBYTES (default 256 KiB) float32 allreduce on
the ring.
MODE ``ddp``: torch DDP on the ``hpcring`` backend, a small MLP on CPU (the overhead figure).
GROUP=1,2,3: the allreduces run on a group of those global ranks (the others only compute).
The slow rank's compute takes SLOW_FACTOR times as long. Rank 0 prints one ``RESULT {json}``
line: steps, median step seconds, the step at which the first straggler verdict was in force
(None: never), every verdict line and the most CPU any rank's watcher thread used, as a share of
the steps' wall time (an upper bound on what it can take from a step).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

import hpcring


def main() -> None:
    steps = int(os.environ.get("STEPS", "300"))
    slow = int(os.environ.get("SLOW_RANK", "-1"))
    factor = float(os.environ.get("SLOW_FACTOR", "1.3"))
    work = float(os.environ.get("WORK_MS", "20")) / 1e3
    mode = os.environ.get("MODE", "sleep")
    session = hpcring.init(backend=os.environ.get("BACKEND", "ring"))
    mine = work * (factor if session.rank == slow else 1.0)
    times, first = [], None
    if mode == "ddp":
        step = _ddp_step(session, mine)
    else:
        x = np.ones(int(os.environ.get("NBYTES", 256 * 1024)) // 4, np.float32)
        comm = session
        if os.environ.get("GROUP"):     # the collectives on a group of these global ranks (HSDP-like)
            g = session.group([int(r) for r in os.environ["GROUP"].split(",")])
            comm = g.communicator(os.environ.get("BACKEND", "ring")) if g is not None else None

        def step():
            time.sleep(mine)
            if comm is not None:
                comm.allreduce(x)
    t_start = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        watch = session.stragglers.get(os.environ.get("BACKEND", "ring"))
        if first is None and watch is not None and watch.history:
            first = i + 1
    wall = time.perf_counter() - t_start
    session.barrier()
    time.sleep(3 * (watch.period if watch is not None else 0))      # the last window's verdict
    cpu = session.allreduce(np.array([watch.cpu_s if watch is not None else 0.0]), op="max")[0]
    if session.rank == 0:
        lines = [e["line"] for e in watch.history] if watch is not None else []
        print("RESULT " + json.dumps({"steps": steps, "size": session.size, "median_step_s": float(np.median(times)),
                                      "first_verdict_step": first, "lines": lines,
                                      "windows": watch.windows if watch is not None else 0,
                                      "watcher_cpu_share": float(cpu) / wall,
                                      "on": watch is not None}), flush=True)


def _ddp_step(session, compute_s: float):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hpcring.distributed  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("hpcring")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(32, 256)

    def step():
        time.sleep(compute_s)
        opt.zero_grad()
        model(data).square().mean().backward()
        opt.step()
    return step


if __name__ == "__main__":
    main()
