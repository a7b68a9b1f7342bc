"""Data-parallel training of a 2-layer MLP (numpy only) on hpcring collectives.

    python examples/train.py --steps 20                                   # one process
    hpcring submit examples/train.py --nodes 2 --tasks-per-node 2 --wait -- --steps 20
    salloc -N3 hpcring run --site devcluster -- python examples/train.py --steps 20

What each rank does:
  * parameters are initialised on rank 0 from --seed and broadcast to every rank (the other ranks
    start from different values on purpose, so a broken broadcast shows in the loss);
  * each step the global batch (--global-batch rows, generated from (seed, step) so every rank
    can make it without communication) is split into contiguous shards, one per rank; a rank
    computes the gradient *sum* over its shard divided by the global batch size;
  * the gradients and the loss sum go through ONE fused allreduce (``allreduce_grouped``), which
    gives exactly the full-batch mean gradient, then plain SGD;
  * rank 0 prints ``step N loss L`` and writes checkpoints (npz, atomically) to --ckpt-dir
    (default: ``<job folder>/checkpoints`` under ``hpcring submit``, else ``./checkpoints``).

So the loss curve equals single-process training with the same global batch up to float64
summation order (~1e-15 relative), whatever the number of ranks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


class _Solo:
    """The communicator of a one-process run without any launcher (identity collectives)."""

    rank, size = 0, 1

    def broadcast(self, x, root=0, **_):
        return x

    def allreduce_grouped(self, arrays, op="sum", inplace=False, **_):
        return list(arrays) if inplace else [np.array(a) for a in arrays]

    def barrier(self, **_):
        pass


def _in_launcher() -> bool:
    if os.environ.get("HPCRING_SESSION") or os.environ.get("WORLD_SIZE"):
        return True
    try:
        from hpcring.bootstrap.launchers import detect
        return detect().launcher != "single"
    except Exception:
        return False


def communicator(backend: str):
    """hpcring's communicator inside a job (any launcher); identity collectives when run alone."""
    if not _in_launcher():
        return _Solo()
    import hpcring
    return hpcring.init().communicator(backend)


def default_ckpt_dir() -> str:
    folder = os.environ.get("SUBMITIT_FOLDER")
    if folder:
        job = next((os.environ[v] for v in ("SLURM_JOB_ID", "LSB_JOBID", "SUBMITIT_LOCAL_JOB_ID", "HPCRING_JOB_ID")
                    if os.environ.get(v)), "")
        return os.path.join(folder.replace("%j", job), "checkpoints")
    return os.path.join(os.getcwd(), "checkpoints")


# -- the model: y = W2 tanh(W1 x + b1) + b2, mean squared error ----------------------------------
def init_params(seed: int, d_in: int, hidden: int, d_out: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W1": rng.standard_normal((d_in, hidden)) / np.sqrt(d_in), "b1": np.zeros(hidden),
            "W2": rng.standard_normal((hidden, d_out)) / np.sqrt(hidden), "b2": np.zeros(d_out)}


def batch(seed: int, step: int, n: int, d_in: int, d_out: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: the same on every rank, from (seed, step) alone."""
    teacher = np.random.default_rng([seed, 0xC0FFEE])
    A = teacher.standard_normal((d_in, d_out))
    B = teacher.standard_normal((d_in, d_out)) / d_in
    rng = np.random.default_rng([seed, step])
    X = rng.standard_normal((n, d_in))
    Y = np.sin(X @ A) + (X ** 2) @ B + 0.01 * rng.standard_normal((n, d_out))
    return X, Y


def grads(p: dict, X: np.ndarray, Y: np.ndarray, global_n: int) -> tuple[dict, float]:
    """Gradient of (sum of squared errors over this shard) / global_n, and that shard's loss sum / global_n."""
    H = np.tanh(X @ p["W1"] + p["b1"])
    err = H @ p["W2"] + p["b2"] - Y
    loss = float(np.sum(err ** 2)) / global_n
    dout = 2.0 * err / global_n
    dH = (dout @ p["W2"].T) * (1.0 - H ** 2)
    return {"W1": X.T @ dH, "b1": dH.sum(0), "W2": H.T @ dout, "b2": dout.sum(0)}, loss


def shard(global_n: int, size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(global_n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def save_checkpoint(ckpt_dir: str, step: int, params: dict, loss: float) -> str:
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"step_{step:06d}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, step=step, loss=loss, **params)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--d-in", type=int, default=16)
    ap.add_argument("--d-out", type=int, default=4)
    ap.add_argument("--ckpt-dir", default=None, help="default: <job folder>/checkpoints, else ./checkpoints")
    ap.add_argument("--ckpt-every", type=int, default=0, help="steps between checkpoints (0: only the last)")
    ap.add_argument("--backend", default="auto", help="hpcring communicator backend (auto, ring, mpi, nccl)")
    args = ap.parse_args(argv)

    comm = communicator(args.backend)
    rank, size = comm.rank, comm.size
    if args.global_batch < size:
        raise SystemExit(f"--global-batch {args.global_batch} is smaller than the {size} ranks")
    # rank 0's initial parameters win; the others start elsewhere so the broadcast matters
    params = init_params(args.seed if rank == 0 else args.seed + 1000 + rank, args.d_in, args.hidden, args.d_out)
    for name in sorted(params):
        comm.broadcast(params[name], root=0)
    lo, hi = shard(args.global_batch, size, rank)
    ckpt_dir = args.ckpt_dir or default_ckpt_dir()
    names = sorted(params)
    t0 = time.perf_counter()
    for step in range(args.steps):
        X, Y = batch(args.seed, step, args.global_batch, args.d_in, args.d_out)
        g, loss = grads(params, X[lo:hi], Y[lo:hi], args.global_batch)
        bufs = [g[k] for k in names] + [np.array([loss])]
        comm.allreduce_grouped(bufs, op="sum", inplace=True)       # one fused allreduce per step
        loss = float(bufs[-1][0])
        for k, gk in zip(names, bufs):
            params[k] -= args.lr * gk
        if rank == 0:
            print(f"step {step:5d} loss {loss:.12e}", flush=True)
        last = step == args.steps - 1
        if rank == 0 and (last or (args.ckpt_every and (step + 1) % args.ckpt_every == 0)):
            path = save_checkpoint(ckpt_dir, step + 1, params, loss)
            if last:
                print(f"checkpoint {path}", flush=True)
    if rank == 0:
        print(f"done: {args.steps} steps on {size} rank(s) in {time.perf_counter() - t0:.2f} s", flush=True)
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
