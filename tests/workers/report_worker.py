"""A training loop with a known time split, for ``hpcring report`` (tests/integration/test_report_local.py).

Usage: report_worker.py [--steps N] [--compute S] [--slow-rank R --slow S] [--checkpoint-every K]
Each step every rank sleeps ``--compute`` seconds (its "compute"), the slow rank ``--slow`` more,
then all-reduce a small array; rank 0 notes a checkpoint (``hpcring.checkpoint_saved``) every K
steps. The slow rank's extra sleep is the others' waiting: the report must show both.
"""
import argparse
import time

import numpy as np

import hpcring


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compute", type=float, default=0.02)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--checkpoint-every", type=int, default=0)
    a = p.parse_args()
    comm = hpcring.init().communicator()
    rank = comm.rank
    x = np.ones(1024, np.float32)
    for step in range(a.steps):
        time.sleep(a.compute + (a.slow if rank == a.slow_rank else 0.0))
        y = comm.allreduce(x)
        assert y[0] == comm.size
        if rank == 0 and a.checkpoint_every and (step + 1) % a.checkpoint_every == 0:
            hpcring.checkpoint_saved(step + 1)
    print(f"REPORT_WORKER rank={rank} steps={a.steps}", flush=True)


if __name__ == "__main__":
    main()
