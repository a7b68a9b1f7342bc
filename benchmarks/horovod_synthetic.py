"""Synthetic training throughput: hpcring.torch (Horovod API) vs torch DDP on gloo, same model and batch.

    python benchmarks/horovod_synthetic.py                    # 2 and 3 local ranks, all variants
    python benchmarks/horovod_synthetic.py -n 2 --variants hvd,ddp --batch 16
    python benchmarks/horovod_synthetic.py --devcluster -n 3     # 3 dev-cluster nodes x 1 rank

Each variant is one `hpcring run` job (ranks on this machine; ring backend over loopback TCP for
hpcring.torch, Gloo for DDP). Model: a small ResNet (stem + 4 residual stages, BatchNorm,
~0.7 M parameters, 38 gradient tensors) on 32x32 random images, SGD, ``torch.set_num_threads(1)``
per rank. Every rank times ``--iters`` iterations of ``--batches`` steps after ``--warmup`` steps;
the table shows images/s summed over ranks (mean over iterations, from rank 0's timings) and, for
hpcring.torch, collectives per step, negotiation cycles per step, negotiation time per step (mostly
waiting for the slowest rank to queue the same names: rank skew, not protocol cost), time in the
backend's collectives and in the fusion buffer copies and scaling (pack + unpack) per step.

Variants: ``hvd`` (defaults: 128 MiB fusion threshold, auto cycle, response cache on),
``hvd-nocache`` (HPCRING_CACHE_CAPACITY=0: every cycle negotiates in full), ``hvd-nofusion``
(HPCRING_FUSION_THRESHOLD=0: one collective per tensor), ``hvd-autotune`` (HPCRING_AUTOTUNE=1;
warm-up is extended until the tuner has chosen, then the same measurement), ``hvd-timeline``
(HPCRING_TIMELINE on: its cost), ``ddp`` (DistributedDataParallel, gloo, default 25 MiB buckets),
``ddp-hpcring`` (the same DDP on the ``hpcring`` torch.distributed backend: hpcring's collectives
without the Horovod engine). ``--hvd-env K=V,...`` adds environment variables to the hvd variants
(e.g. ``HPCRING_CYCLE_TIME=5``).

``--protocol`` times the negotiation itself (the controller called directly on every rank, 38
queued names, cache on and off interleaved in one job). ``--negotiation`` measures it end to end (no model, so it also runs on 8 local ranks of a
small machine): each step allreduces 38 named 16-float tensors (the model's gradient count) and
waits; variants ``negot`` (cache on) and ``negot-nocache``. The table's negotiation ms/step is
then the name matching's own cost (plus the scheduling noise of oversubscribed cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("hvd", "hvd-nocache", "hvd-nofusion", "hvd-autotune", "hvd-timeline", "ddp", "ddp-hpcring")
NEGOT_TENSORS = 38          # the small ResNet's gradient count


def make_model():
    from models import small_resnet      # benchmarks/models.py (the script's folder is on sys.path)
    return small_resnet()


def negotiation_worker(variant: str, warmup: int, batches: int, iters: int) -> None:
    import torch
    import hpcring.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    eng = hvd.state.engine()
    grads = [torch.ones(16) for _ in range(NEGOT_TENSORS)]

    def step():
        hvd.synchronize(hvd.grouped_allreduce_async_(grads, name="grad", op=hvd.Sum))

    for _ in range(warmup):
        step()
    s0 = dict(eng.stats)
    t0 = time.perf_counter()
    steps = iters * batches
    for _ in range(steps):
        step()
    dt = time.perf_counter() - t0
    if hvd.rank() == 0:
        d = lambda k: eng.stats.get(k, 0) - s0.get(k, 0)  # noqa: E731
        print("RESULT " + json.dumps({
            "variant": variant, "ranks": hvd.size(), "img_s": steps / dt, "img_s_min": float("nan"),
            "img_s_max": float("nan"), "step_ms": 1e3 * dt / steps, "cpu_ms_per_step": float("nan"),
            "coll_per_step": d("collectives") / steps, "cycles_per_step": d("cycles") / steps,
            "full_per_step": d("full_negotiations") / steps,
            "negotiate_ms_per_step": 1e3 * d("negotiate_s") / steps, "backend_ms_per_step": 1e3 * d("backend_s") / steps,
            "copy_ms_per_step": 1e3 * (d("pack_s") + d("unpack_s")) / steps}), flush=True)
    hvd.shutdown()


def protocol_worker(reps: int, calls: int) -> None:
    """The negotiation protocol alone, cache on vs off, interleaved in one job (same load for
    both): every rank runs the controller directly on the communicator (the engine thread is
    idle), ``calls`` negotiations of the same 38 queued names per block, ``reps`` blocks each."""
    import statistics

    import torch
    import hpcring.torch as hvd
    from hpcring.torch.controller import Controller
    from hpcring.torch.entry import Entry
    torch.set_num_threads(1)
    hvd.init()
    eng = hvd.state.engine()
    comm = eng.comm
    entries = [Entry(f"grad.{i}", "allreduce", torch.ones(16), torch.ones(16)) for i in range(NEGOT_TENSORS)]
    ctl = {"cache": Controller(comm, cache_capacity=1024, timeout=60), "nocache": Controller(comm, cache_capacity=0,
                                                                                          timeout=60)}
    per_call: dict[str, list[float]] = {k: [] for k in ctl}
    for rep in range(reps + 1):
        for k, c in ctl.items():
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                out = c.negotiate(entries, 0, False, eng.threshold, int(eng.cycle_s * 1e6))
                assert len(out.ready) == NEGOT_TENSORS
            if rep:                                  # the first block warms up (and fills the cache)
                per_call[k].append((time.perf_counter() - t0) / calls)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"variant": "protocol", "ranks": hvd.size(), **{
            f"{k}_us": 1e6 * statistics.median(v) for k, v in per_call.items()}, **{
            f"{k}_us_min": 1e6 * min(v) for k, v in per_call.items()}}), flush=True)
    hvd.shutdown()


def worker(variant: str, batch: int, warmup: int, batches: int, iters: int) -> None:
    if variant == "protocol":
        return protocol_worker(iters, batches)
    if variant.startswith("negot"):
        return negotiation_worker(variant, warmup, batches, iters)
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    data = torch.randn(batch, 3, 32, 32)
    target = torch.randint(0, 10, (batch,))
    if variant.startswith("ddp"):
        import torch.distributed as dist
        if variant == "ddp-hpcring":
            import hpcring.distributed  # noqa: F401  (registers the "hpcring" backend)
        dist.init_process_group("gloo" if variant == "ddp" else "hpcring")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01 * size)
        eng = None
    else:
        import hpcring.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * size),
                                       named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        eng = hvd.state.engine()

    def step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    for _ in range(warmup):
        step()
    tuner = eng.autotuner if eng is not None else None
    if tuner is not None:          # a fixed number of tuning steps, the same on every rank
        from hpcring.torch.autotune import CYCLES_MS, THRESHOLDS
        for _ in range(tuner.warmup + 4 + (len(CYCLES_MS) + len(THRESHOLDS) + 1) * (tuner.steps + 1)):
            step()
        if rank == 0 and not tuner.done:
            raise RuntimeError("autotuner did not finish in the planned number of steps")
    s0 = dict(eng.stats) if eng is not None else {}
    rates = []
    c0, w0 = time.process_time(), time.perf_counter()      # this process's CPU, all its threads
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(batches):
            step()
        rates.append(batch * batches / (time.perf_counter() - t0))
    if rank == 0:
        steps = iters * batches
        out = {"variant": variant, "ranks": size, "img_s": size * sum(rates) / len(rates),
               "step_ms": 1e3 * (time.perf_counter() - w0) / steps,
               "cpu_ms_per_step": 1e3 * (time.process_time() - c0) / steps,
               "img_s_min": size * min(rates), "img_s_max": size * max(rates)}
        if eng is not None:
            st = lambda k: eng.stats.get(k, 0.0) - s0.get(k, 0.0)  # noqa: E731
            out.update({"coll_per_step": (eng.stats["collectives"] - s0["collectives"]) / steps,
                        "cycles_per_step": (eng.stats["cycles"] - s0["cycles"]) / steps,
                        "negotiate_ms_per_step": 1e3 * (eng.stats["negotiate_s"] - s0["negotiate_s"]) / steps,
                        "backend_ms_per_step": 1e3 * st("backend_s") / steps,
                        "copy_ms_per_step": 1e3 * (st("pack_s") + st("unpack_s")) / steps,
                        "full_per_step": st("full_negotiations") / steps,
                        "threshold": eng.threshold, "cycle_ms": eng.cycle_s * 1e3})
        print("RESULT " + json.dumps(out), flush=True)


def run_variant(variant: str, ranks: int, args, tmp: str) -> dict | None:
    env = {**os.environ, "HPCRING_TIMEOUT": "120"}
    if variant.startswith("hvd") and args.hvd_env:
        env.update(kv.split("=", 1) for kv in args.hvd_env.split(","))
    if variant.endswith("-nocache"):
        env["HPCRING_CACHE_CAPACITY"] = "0"
    if variant == "hvd-nofusion":
        env["HPCRING_FUSION_THRESHOLD"] = "0"
    if variant == "hvd-autotune":
        env.update(HPCRING_AUTOTUNE="1", HPCRING_AUTOTUNE_LOG=os.path.join(tmp, f"autotune-{ranks}.csv"),
                   HPCRING_AUTOTUNE_STEPS_PER_SAMPLE=str(args.tune_steps))
    if variant == "hvd-timeline":
        env["HPCRING_TIMELINE"] = os.path.join(tmp, f"timeline-{ranks}.json")
    if args.devcluster:        # one rank per dev-cluster node, through Slurm (real TCP between namespaces)
        launch = ["salloc", "-N", str(ranks), "--ntasks-per-node=1", "--time=20", "-Q",
                  sys.executable, "-m", "hpcring", "run", "--site", "devcluster", "--tasks-per-node", "1", "--"]
    else:
        launch = [sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks), "--"]
    cmd = [*launch, sys.executable, os.path.abspath(__file__), "--worker", variant, "--batch", str(args.batch),
           "--warmup", str(args.warmup), "--batches", str(args.batches), "--iters", str(args.iters)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=tmp)
    for line in (p.stdout + p.stderr).splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    sys.stderr.write(f"{variant} on {ranks} ranks failed (exit {p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}\n")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--ranks", default="2,3", help="comma-separated rank counts (default 2,3)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=16, help="images per rank per step")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", type=int, default=5, help="steps per timed iteration")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--tune-steps", type=int, default=3, help="autotune: steps per sample")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the variants this many times, interleaved (a loaded machine drifts); "
                         "the table shows the run with the median img/s and lists all")
    ap.add_argument("--hvd-env", default="", help="K=V,... added to the hvd variants' environment")
    ap.add_argument("--devcluster", action="store_true",
                    help="run on the dev cluster (salloc, one rank per node; -n counts nodes) instead of "
                         "local ranks; needs `hpcring devcluster up --share` of this checkout")
    ap.add_argument("--negotiation", action="store_true",
                    help="measure the name matching alone (variants negot, negot-nocache; no model)")
    ap.add_argument("--protocol", action="store_true",
                    help="the negotiation protocol alone: per-negotiation time with and without the cache")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.negotiation and args.variants == ",".join(VARIANTS):
        args.variants = "negot,negot-nocache"
    if args.protocol:
        tmp = tempfile.mkdtemp(prefix="hvd-bench-")
        print(f"# negotiation protocol, {NEGOT_TENSORS} queued names, median (min) per negotiation over "
              f"{args.iters} blocks of {args.batches}, cache on/off interleaved in one job per rank count")
        for n in [int(x) for x in args.ranks.split(",")]:
            r = run_variant("protocol", n, args, tmp)
            if r:
                print(f"  {n:>3} ranks: cache {r['cache_us']:8.1f} us ({r['cache_us_min']:.1f})   "
                      f"no cache {r['nocache_us']:8.1f} us ({r['nocache_us_min']:.1f})", flush=True)
        return
    if args.worker:
        worker(args.worker, args.batch, args.warmup, args.batches, args.iters)
        return
    # dev-cluster nodes have private /tmp: the job's folder must be on the shared /srv/hpcring
    tmp = tempfile.mkdtemp(prefix="hvd-bench-", dir="/srv/hpcring" if args.devcluster else None)
    where = "dev cluster, one rank per node" if args.devcluster else "local ranks"
    print(f"# {where}; small ResNet, 32x32 images, batch {args.batch}/rank, {args.iters} x {args.batches} timed steps "
          f"after {args.warmup} warm-up; img/s summed over ranks (min-max over iterations)"
          + ("; --negotiation: the img/s column is steps/s (38 tensors per step)" if args.negotiation else ""))
    print(f"# {'ranks':>5} {'variant':<14} {'img/s':>8} {'min-max':>15} {'coll/step':>9} {'cycles/step':>11} "
          f"{'full/step':>9} {'negot ms/step':>13} {'backend ms':>10} {'pack ms':>7} {'step ms':>7} {'cpu ms':>6}  settings")
    for n in [int(x) for x in args.ranks.split(",")]:
        runs: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
        for _ in range(args.repeat):
            for v in runs:
                r = run_variant(v, n, args, tmp)
                if r is not None:
                    runs[v].append(r)
        for v, rs in runs.items():
            if not rs:
                print(f"  {n:>5} {v:<14} {'failed':>8}")
                continue
            rs.sort(key=lambda r: r["img_s"])
            r = rs[len(rs) // 2]
            extra = ""
            if "threshold" in r:
                cyc = "auto" if r["cycle_ms"] < 0 else f"{r['cycle_ms']:g} ms"
                extra = f"threshold {r['threshold'] / 2**20:g} MiB, cycle {cyc}"
            if len(rs) > 1:
                extra += "  runs: " + ", ".join(f"{x['img_s']:.0f}" for x in rs)
            print(f"  {n:>5} {v:<14} {r['img_s']:8.1f} {r['img_s_min']:7.1f}-{r['img_s_max']:<7.1f} "
                  f"{r.get('coll_per_step', float('nan')):9.1f} {r.get('cycles_per_step', float('nan')):11.1f} "
                  f"{r.get('full_per_step', float('nan')):9.2f} "
                  f"{r.get('negotiate_ms_per_step', float('nan')):13.2f} {r.get('backend_ms_per_step', float('nan')):10.2f} "
                  f"{r.get('copy_ms_per_step', float('nan')):7.2f} {r['step_ms']:7.1f} {r['cpu_ms_per_step']:6.1f}  {extra}",
                  flush=True)
    print(f"# autotune logs and timelines in {tmp}")


if __name__ == "__main__":
    main()
