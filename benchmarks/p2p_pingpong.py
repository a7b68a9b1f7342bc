"""Point-to-point ping-pong: torch send/recv on the ``hpcring`` backend vs gloo, 2 ranks.

    python benchmarks/p2p_pingpong.py [--ranks-per-node 2] [--reps 20]
        starts itself under `hpcring run` (one host, loopback TCP) and prints, per size, the
        median round-trip time of send+recv on each backend, the bandwidth (2 x size / time) and
        the ratio; every received byte is checked (#wrong).

On a dev cluster allocation (`hpcring submit benchmarks/p2p_pingpong.py --site devcluster --nodes 2
-- --worker`) the ranks sit on two hosts.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SIZES = [4, 4 << 10, 256 << 10, 4 << 20, 64 << 20]


def worker(reps: int) -> None:
    import torch
    import torch.distributed as dist

    from hpcring.distributed import init_process_group
    init_process_group("cpu:hpcring")
    rank = dist.get_rank()
    groups = {"hpcring": None, "gloo": dist.new_group(backend="gloo")}
    rows = []
    for size in SIZES:
        n = size // 4
        x = torch.arange(n, dtype=torch.float32) + rank
        y = torch.empty(n, dtype=torch.float32)
        res = {}
        for name, grp in groups.items():
            times, wrong = [], 0
            k = reps if size < (16 << 20) else max(3, reps // 4)
            for i in range(k + 2):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(x, 1, group=grp)
                    dist.recv(y, 1, group=grp)
                else:
                    dist.recv(y, 0, group=grp)
                    dist.send(x, 0, group=grp)
                dt = time.perf_counter() - t0
                wrong += int((y != torch.arange(n, dtype=torch.float32) + (1 - rank)).sum())
                if i >= 2:
                    times.append(dt)
            res[name] = (statistics.median(times), wrong)
        rows.append((size, res))
    if rank == 0:
        print(f"# send+recv round trip, 2 ranks, median of {reps}; bandwidth = 2 x size / time")
        print(f"#{'size':>10} {'hpcring us':>12} {'GB/s':>7} {'gloo us':>12} {'GB/s':>7} {'hpcring/gloo':>13} #wrong")
        for size, res in rows:
            (th, wh), (tg, wg) = res["hpcring"], res["gloo"]
            print(f"{size:>11} {th * 1e6:>12.1f} {2 * size / th / 1e9:>7.3f} {tg * 1e6:>12.1f} "
                  f"{2 * size / tg / 1e9:>7.3f} {th / tg:>13.2f} {wh + wg}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help="run as a rank (under hpcring run / submit)")
    a = ap.parse_args()
    if a.worker:
        worker(a.reps)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "2", "--",
                             sys.executable, "-W", "ignore", os.path.abspath(__file__), "--worker", "--reps",
                             str(a.reps)], env=env, timeout=900, stdin=subprocess.DEVNULL).returncode)


if __name__ == "__main__":
    main()
