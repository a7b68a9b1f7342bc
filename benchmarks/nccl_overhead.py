"""Per-call cost of hpcring's device collectives against raw NCCL on the same GPU and stream.

    python benchmarks/nccl_overhead.py                     # allreduce float32, 4 KiB .. 256 MiB
    python benchmarks/nccl_overhead.py -c allgather -e 64M --iters 200

One process, one GPU, a world of one rank (NCCL refuses two ranks on one GPU, so this is where
the per-call overhead is measured; the bytes do not cross a link). Both sides get the same CuPy
buffers and the same stream:

* raw: ``cupy.cuda.nccl.NcclCommunicator`` called directly (what the collective costs in NCCL);
* hpcring: ``Communicator.allreduce(x, out=out)`` etc. on the nccl backend (adaptation, flight
  record, deadline tracking, completion event).

Each point runs ``--iters`` calls back to back, then synchronizes the stream; the time is per
call. ``raw+ev`` is raw NCCL plus one CUDA event recorded per call: the floor of any call that
tracks its completion (hpcring's deadline needs one). ``--general`` adds hpcring's general path,
``--profile`` the top Python frames of the hpcring loop. Results are checked once per size
(#wrong must be 0). Prints

    size count type raw(us) raw+ev(us) hpcring(us) ratio overhead(us) general(us) #wrong

Needs cupy + nvidia-nccl-cu12 and an NVIDIA GPU: exits 2 with a message otherwise.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--collective", default="allreduce",
                    choices=("allreduce", "allgather", "broadcast", "reduce_scatter"))
    ap.add_argument("-b", "--minbytes", default="4K")
    ap.add_argument("-e", "--maxbytes", default="256M")
    ap.add_argument("-f", "--factor", type=int, default=4)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per size; the median is printed")
    ap.add_argument("--general", action="store_true",
                    help="also time hpcring's general path (Communicator.short_path = False)")
    ap.add_argument("--profile", action="store_true",
                    help="after the table, cProfile the hpcring loop at the smallest size and name the top "
                         "Python frames (the calling thread only; the completion poller is not in it)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()

    from hpcring.collectives.nccl_lib import gpu_count
    if gpu_count() == 0:
        print("nccl_overhead: needs cupy, NCCL and a visible NVIDIA GPU (none here)", file=sys.stderr)
        return 2
    import cupy as cp
    from cupy.cuda import nccl

    import hpcring
    if not (os.environ.get("HPCRING_SECRET_FILE") or os.environ.get("HPCRING_SECRET")):
        # started by hand, outside `hpcring run`: a world of one rank still authenticates its store
        from hpcring.bootstrap.auth import new_secret_file
        os.environ["HPCRING_SECRET_FILE"] = str(new_secret_file(tempfile.mkdtemp(prefix="hpcring-bench-")))
    session = hpcring.init(backend="nccl")
    comm = session.communicator("nccl")
    raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.Stream(non_blocking=True)
    f32 = nccl.NCCL_FLOAT32
    print(f"# nccl_overhead: {args.collective} float32, 1 rank, GPU {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"NCCL {nccl.get_version()}, CuPy {cp.__version__}, {args.iters} calls per loop, median of {args.repeats}")
    print(f"{'size':>12} {'count':>12} {'type':>6} {'raw(us)':>10} {'raw+ev(us)':>12} {'hpcring(us)':>12} {'ratio':>7} "
          f"{'overhead(us)':>13} {'general(us)':>12} {'#wrong':>7}")
    prof = None
    with stream:
        for nbytes in sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.factor):
            n = nbytes // 4
            x = cp.arange(n, dtype=cp.float32) % 97
            out = cp.empty_like(x)
            ev = cp.cuda.Event(block=False, disable_timing=True)
            if args.collective == "allreduce":
                def raw_call():
                    raw.allReduce(x.data.ptr, out.data.ptr, n, f32, nccl.NCCL_SUM, stream.ptr)

                def raw_ev_call():          # the floor of a monitored call: NCCL + one event record
                    raw.allReduce(x.data.ptr, out.data.ptr, n, f32, nccl.NCCL_SUM, stream.ptr)
                    ev.record(stream)

                def hr_call():
                    comm.allreduce(x, out=out)
            elif args.collective == "allgather":
                def raw_call():
                    raw.allGather(x.data.ptr, out.data.ptr, n, f32, stream.ptr)

                def hr_call():
                    comm.allgather(x, out=out)
            elif args.collective == "broadcast":
                def raw_call():
                    raw.broadcast(x.data.ptr, x.data.ptr, n, f32, 0, stream.ptr)

                def hr_call():
                    comm.broadcast(x)
            else:
                def raw_call():
                    raw.reduceScatter(x.data.ptr, out.data.ptr, n, f32, nccl.NCCL_SUM, stream.ptr)

                def hr_call():
                    comm.reduce_scatter(x, out=out)

            def timed(call) -> float:
                for _ in range(10):
                    call()
                comm.synchronize()
                stream.synchronize()
                runs = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        call()
                    stream.synchronize()
                    runs.append((time.perf_counter() - t0) / args.iters * 1e6)
                comm.synchronize()
                return statistics.median(runs)
            t_raw = timed(raw_call)
            t_ev = timed(raw_ev_call) if args.collective == "allreduce" else float("nan")
            t_hr = timed(hr_call)
            t_gen = float("nan")
            if args.general:
                comm.short_path = False
                t_gen = timed(hr_call)
                comm.short_path = True
            got = out if args.collective != "broadcast" else x   # one rank: every result equals x
            wrong = int(cp.count_nonzero(got != x).get())
            print(f"{nbytes:>12} {n:>12} {'float':>6} {t_raw:>10.1f} {t_ev:>12.1f} {t_hr:>12.1f} {t_hr / t_raw:>7.2f} "
                  f"{t_hr - t_raw:>13.1f} {t_gen:>12.1f} {wrong:>7}", flush=True)
            if args.profile and prof is None:
                sys.path.insert(0, str(ROOT / "benchmarks"))
                from per_call import profile        # one cProfile summary for both benchmarks
                prof = profile(hr_call, args.iters * args.repeats, args.top)
                stream.synchronize()
                comm.synchronize()
    raw.destroy()
    if prof:
        print(f"\n# cProfile of the hpcring loop at {args.minbytes} (calling thread, by own time):\n{prof}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
