"""Point-to-point ping-pong: torch send/recv on the ``hpcring`` backend vs gloo, 2 ranks.

    python benchmarks/p2p_pingpong.py [--reps 20] [--sizes 4,4K,256K,4M,64M]
        starts itself under `hpcring run` (one host, loopback TCP) and prints, per size, the
        median round-trip time of send+recv on each backend, the bandwidth (2 x size / time) and
        the ratio; every received byte is checked (#wrong). Up to 256 KiB a sample is 10 round
        trips in a row, averaged (a lone round trip after the barrier would time the barrier's
        exit skew too). The last line counts the messages that went by direct read (one host,
        HPCRING_P2P_DIRECT, native/p2p_direct.c).
    python benchmarks/p2p_pingpong.py --layers
        the 4-byte round trip through each layer of the hpcring backend: the native queue alone
        (hpcring._native.P2P called from Python), Communicator.send/recv on its short path and on
        its general path (short_path = False), torch dist.send/recv; and gloo's, for scale.

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
# Round trips timed in a row per sample up to 256 KiB (as osu_latency times a loop): one round trip
# alone after the barrier also times the barrier's exit skew between the two ranks.
INNER = 10


def parse_sizes(text: str) -> list[int]:
    from hpcring.bench.options import parse_size
    return [parse_size(x, "--sizes") for x in text.split(",") if x]


def direct_counts() -> str:
    """Messages offered / read directly by this rank's hpcring mailbox, as text ('' if none)."""
    import torch.distributed as dist
    try:
        box = dist.group.WORLD._comm_for("cpu").backend._mailbox
        sent, read = box.direct_counts()
    except (AttributeError, RuntimeError):
        return ""
    return f"# direct reads (rank 0): {sent} messages offered, {read} read"


def worker(reps: int, sizes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from hpcring.distributed import init_process_group
    init_process_group("cpu:hpcring")
    rank = dist.get_rank()
    groups = {"hpcring": None, "gloo": dist.new_group(backend="gloo")}
    rows = []
    for size in sizes:
        n = size // 4
        x = torch.arange(n, dtype=torch.float32) + rank
        y = torch.empty(n, dtype=torch.float32)
        res = {}
        for name, grp in groups.items():
            times, wrong = [], 0
            k = reps if size < (16 << 20) else max(3, reps // 4)
            inner = INNER if size <= (256 << 10) else 1
            for i in range(k + 2):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    if rank == 0:
                        dist.send(x, 1, group=grp)
                        dist.recv(y, 1, group=grp)
                    else:
                        dist.recv(y, 0, group=grp)
                        dist.send(x, 0, group=grp)
                dt = (time.perf_counter() - t0) / inner
                wrong += int((y != torch.arange(n, dtype=torch.float32) + (1 - rank)).sum())
                if i >= 2:
                    times.append(dt)
            res[name] = (statistics.median(times), wrong)
        rows.append((size, res))
    if rank == 0:
        print(f"# send+recv round trip, 2 ranks, median of {reps} (up to 256 KiB: each {INNER} round trips in a row, averaged); bandwidth = 2 x size / time")
        print(f"#{'size':>10} {'hpcring us':>12} {'GB/s':>7} {'gloo us':>12} {'GB/s':>7} {'hpcring/gloo':>13} #wrong")
        for size, res in rows:
            (th, wh), (tg, wg) = res["hpcring"], res["gloo"]
            print(f"{size:>11} {th * 1e6:>12.1f} {2 * size / th / 1e9:>7.3f} {tg * 1e6:>12.1f} "
                  f"{2 * size / tg / 1e9:>7.3f} {th / tg:>13.2f} {wh + wg}", flush=True)
        print(direct_counts(), flush=True)
    dist.destroy_process_group()


def layers(reps: int) -> None:
    """Median 4-byte round trip per layer (see the module docstring), 2 ranks."""
    import itertools

    import numpy as np
    import torch
    import torch.distributed as dist

    from hpcring.distributed import init_process_group
    from hpcring.distributed.process_group import ProcessGroupHpcring
    init_process_group()                      # extended API: the world group is the ProcessGroupHpcring
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    x, y = torch.zeros(1), torch.empty(1)
    xn, yn = x.numpy(), y.numpy()
    dist.send(x, peer) if rank == 0 else dist.recv(y, peer)      # connections made, both ways
    dist.recv(y, peer) if rank == 0 else dist.send(x, peer)
    pg = dist.group.WORLD
    if not isinstance(pg, ProcessGroupHpcring):
        raise SystemExit("p2p_pingpong --layers: the default group is not on the hpcring backend")
    comm = pg._comm_for("cpu")
    xb, yb = xn.view(np.uint8), yn.view(np.uint8)
    mailbox = getattr(comm.backend, "_mailbox", None)
    if mailbox is not None:                   # the ring: the native queue under the Communicator
        box, ids = mailbox._box, itertools.count(1 << 40)   # ids far from the mailbox's own
        lowest = "native queue"

        def native(kind):
            r = (box.isend if kind == "send" else box.irecv)(next(ids), xb if kind == "send" else yb, peer, 0, 30.0)
            while r.result() is None:
                r.wait(1.0)
    else:                                     # the MPI backend: raw mpi4py on its communicator
        comm.send(xn, peer) if rank == 0 else comm.recv(yn, peer)   # its communicator exists
        comm.recv(yn, peer) if rank == 0 else comm.send(xn, peer)
        mcomm, lowest = comm.backend._comm, "raw mpi4py Send/Recv"

        def native(kind):
            mcomm.Send(xb, peer, 77) if kind == "send" else mcomm.Recv(yb, peer, 77)

    def comm_path(short):
        def run(kind):
            comm.short_path = short
            comm.send(xn, peer) if kind == "send" else comm.recv(yn, peer)
        return run
    g = dist.new_group(backend="gloo")
    paths = [(lowest, native), ("Communicator short path", comm_path(True)),
             ("Communicator general path", comm_path(False)),
             ("torch dist.send/recv", lambda k: dist.send(x, peer) if k == "send" else dist.recv(y, peer)),
             ("gloo dist.send/recv", lambda k: dist.send(x, peer, group=g) if k == "send" else dist.recv(y, peer, group=g))]
    out = []
    for name, fn in paths:
        comm.short_path = True                # the general path's row turns it off for itself
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(INNER):
                for kind in (("send", "recv") if rank == 0 else ("recv", "send")):
                    fn(kind)
            times.append((time.perf_counter() - t0) / INNER)
        out.append((name, statistics.median(times)))
    comm.short_path = True
    if rank == 0:
        print(f"# 4-byte send+recv round trip per layer, 2 ranks, median of {reps} (each {INNER} round trips in a row, averaged)")
        for name, t in out:
            print(f"{name:>28} {t * 1e6:9.1f} us", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--worker", action="store_true", help="run as a rank (under hpcring run / submit)")
    ap.add_argument("--layers", action="store_true", help="4-byte round trip per layer of the hpcring backend")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per message, e.g. 4,4K,256K,4M,64M")
    a = ap.parse_args()
    if a.worker:
        layers(a.reps) if a.layers else worker(a.reps, parse_sizes(a.sizes))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "2", "--",
                             sys.executable, "-W", "ignore", os.path.abspath(__file__), "--worker", "--reps",
                             str(a.reps), "--sizes", a.sizes] + (["--layers"] if a.layers else []), env=env, timeout=900, stdin=subprocess.DEVNULL).returncode)


if __name__ == "__main__":
    main()
