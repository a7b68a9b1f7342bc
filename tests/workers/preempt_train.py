"""A training loop that survives preemption: checkpoints every step, stops on the scheduler's warning.

Usage: preempt_train.py OUT_DIR [--steps N] [--sleep S] [--ignore-warning] [--self-requeue N]
Each step all-reduces a gradient that depends on the step and the rank and folds it into the
weights; rank 0 saves (step, weights) atomically after every step (an unannounced requeue such as
`scontrol requeue` resumes from there) and on the warning. The final weights in OUT_DIR/result.json
do not depend on where or how often the run was interrupted.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import hpcring


def save(path, step, w):
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, step=step, w=w)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--ignore-warning", action="store_true", help="never check: run into the time limit")
    p.add_argument("--self-requeue", type=int, default=0,
                   help="rank 0 runs `scontrol requeue $SLURM_JOB_ID` a few steps into each of the first N "
                        "runs and returns 0 at once, as Lightning's auto-requeue does (the others are "
                        "mid-collective when it leaves)")
    a = p.parse_args()
    comm = hpcring.init().communicator()
    rank = comm.rank
    ckpt = os.path.join(a.out, "ckpt.npz")
    step, w = 0, np.zeros(8, np.float64)
    if os.path.exists(ckpt):
        with np.load(ckpt) as z:
            step, w = int(z["step"]), z["w"].copy()
    print(f"PREEMPT_TRAIN rank={rank} start step={step} requeues={hpcring.requeue_count()}", flush=True)
    hpcring.on_preempt(lambda sig: print(f"PREEMPT_TRAIN rank={rank} warned by {sig}", flush=True))
    while step < a.steps:
        if not a.ignore_warning and hpcring.preempted(comm):
            if rank == 0:
                save(ckpt, step, w)
            print(f"PREEMPT_TRAIN rank={rank} checkpointed step={step}", flush=True)
            raise hpcring.Preempted(f"stopped at step {step}")
        if rank == 0 and hpcring.requeue_count() < a.self_requeue and step >= 3 * (hpcring.requeue_count() + 1):
            import subprocess
            print(f"PREEMPT_TRAIN rank=0 self-requeue at step={step}", flush=True)
            # not checked: Slurm may end this step, scontrol included, before scontrol returns
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], timeout=30)
            return 0
        g = np.arange(8, dtype=np.float32) * (rank + 1) + step
        w = 0.5 * w + comm.allreduce(g).astype(np.float64)
        step += 1
        if rank == 0:
            save(ckpt, step, w)
        time.sleep(a.sleep)
    if rank == 0:
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump({"w": w.tolist(), "steps": step, "requeues": hpcring.requeue_count()}, f)
    print(f"PREEMPT_TRAIN rank={rank} done step={step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
