"""A deterministic training loop for restarts after a node fault (hpcring.restarts).

Usage: restart_train.py OUT_DIR [--steps N] [--sleep S] [--freeze-rank R --freeze-step K] [--kill-rank R]
       [--fail-step K] [--slow-rank R --slow S]
Each step all-reduces a gradient that depends on the step and the rank and folds it into the
weights; rank 0 checkpoints (step, weights) to OUT_DIR after every step, so a restart resumes
from the last one. On the first attempt only (HPCRING_RESTART_COUNT unset or 0), ``--freeze-rank``
stops that rank with SIGSTOP before step K (a node gone silent), ``--kill-rank`` SIGKILLs it
there instead (its node lost); ``--fail-step`` raises on every
rank at step K, on every attempt (a code error); ``--slow-rank`` sleeps ``--slow`` s longer each
step (a straggler, on every attempt). Every rank notes its host per attempt in
OUT_DIR/hosts-<attempt>-<rank>; rank 0 writes the final weights to OUT_DIR/result.json.
"""
import argparse
import json
import os
import signal
import socket
import sys
import time

import numpy as np

import hpcring


def expected(steps: int, size: int) -> list[float]:
    """The weights of an uninterrupted run (what every restarted run must end with)."""
    w = np.zeros(8, np.float64)
    for step in range(steps):
        g = sum(np.arange(8, dtype=np.float32) * (r + 1) + step for r in range(size))
        w = 0.5 * w + g.astype(np.float64)
    return w.tolist()


def save(path, step, w):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, step=step, w=w)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sleep", type=float, default=0.2)
    p.add_argument("--freeze-rank", type=int, default=-1)
    p.add_argument("--freeze-step", type=int, default=3)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    a = p.parse_args()
    comm = hpcring.init().communicator()
    rank = comm.rank
    attempt = int(os.environ.get("HPCRING_RESTART_COUNT") or 0)
    host = os.environ.get("HPCRING_HOSTNAME") or socket.gethostname()
    with open(os.path.join(a.out, f"hosts-{attempt}-{rank}"), "w") as f:
        f.write(host)
    ckpt = os.path.join(a.out, "ckpt.npz")
    step, w = 0, np.zeros(8, np.float64)
    if hpcring.requeue_count() and os.path.exists(ckpt):
        with np.load(ckpt) as z:
            step, w = int(z["step"]), z["w"].copy()
    print(f"RESTART_TRAIN rank={rank} host={host} attempt={attempt} start step={step} "
          f"requeue_count={hpcring.requeue_count()} size={comm.size} t={time.time():.3f}", flush=True)
    while step < a.steps:
        if step == a.fail_step:
            raise ValueError(f"bad batch at step {step}")
        if attempt == 0 and rank == a.freeze_rank and step == a.freeze_step:
            print(f"RESTART_TRAIN rank={rank} host={host} freezing at step={step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if attempt == 0 and rank == a.kill_rank and step == a.freeze_step:
            print(f"RESTART_TRAIN rank={rank} host={host} killed at step={step} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = np.arange(8, dtype=np.float32) * (rank + 1) + step
        w = 0.5 * w + comm.allreduce(g).astype(np.float64)
        step += 1
        if rank == 0:
            save(ckpt, step, w)
            hpcring.checkpoint_saved(step)
        time.sleep(a.sleep + (a.slow if rank == a.slow_rank else 0.0))
    if rank == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"w": w.tolist(), "steps": step, "attempt": attempt,
                       "requeue_count": hpcring.requeue_count(), "expected": expected(a.steps, comm.size)}, f)
    print(f"RESTART_TRAIN rank={rank} done step={step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
