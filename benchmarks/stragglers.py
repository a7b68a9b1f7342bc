"""Straggler verdicts: how soon a slow rank is named, how often a clean job is, and what it costs.

    python benchmarks/stragglers.py [--where local|devcluster] [--only slow,clean,loaded,overhead]
                                    [--ranks 8] [--steps 100] [--clean-steps 2000] [--pairs 5]

Runs benchmarks/straggler_train.py with ``hpcring run`` (``--where local``: N ranks on this
machine) or ``hpcring submit --site devcluster --nodes 3 --tasks-per-node 2 --wait`` (the dev
cluster, ``hpcring devcluster up``; the job inherits this environment). One line per scenario:

* ``slow``: rank size-1 computes 1.3x as long (``--factor``); the step at which rank 0 first held
  a verdict, and whether it named that rank and its host (target: within 100 steps);
* ``clean``: ``--clean-steps`` steps with nobody slow; the verdicts (target: none);
* ``loaded``: the same with ``--busy`` busy processes on this machine (uniform load);
* ``link`` (dev cluster only): node2's ``eth0`` throttled with tc's ``tbf`` (``--rate``) while
  every rank computes alike and all-reduces 4 MiB; the verdict must name the link from node2;
* ``overhead``: DDP (torch, ``hpcring`` backend) step time with the watcher on and off, in
  ``--pairs`` alternating pairs of runs; the median of the on/off ratios (target: at most 1.005),
  and the most CPU any rank's watcher thread used as a share of the run's wall time (the most it
  can take from the steps: it holds the GIL only while it runs).

Compute is a sleep (a GPU computing while its host waits), so 8 ranks on 2 cores do not fight
for them; the allreduce is 256 KiB on the ring. Figures from one run of each; on this 2-core
machine the collectives' own jitter bounds how small a lateness can be told apart.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "benchmarks" / "straggler_train.py"
PY = sys.executable
RESULT = re.compile(r"RESULT (\{.*\})")


def run_job(args, env_extra: dict, steps: int, busy: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRING_STRAGGLER")}
    env.update(PYTHONPATH=str(ROOT / "src"), STEPS=str(steps), **env_extra)
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(busy)]
    try:
        if args.where == "local":
            cmd = [PY, "-m", "hpcring", "run", "--tasks-per-node", str(args.ranks), "--", PY, str(TRAIN)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout).stdout
        else:
            base = Path(tempfile.mkdtemp(prefix="strag-", dir="/srv/hpcring"))
            env.update(HPCRING_JOB_DIR=str(base / "jobs"), HPCRING_STATE_DIR=str(base / "state"))
            cmd = [PY, "-m", "hpcring", "submit", str(TRAIN), "--site", "devcluster", "--nodes", "3",
                   "--tasks-per-node", "2", "--wait", "--timeout", "60"]
            subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout)
            out = "\n".join(p.read_text(errors="replace") for p in sorted((base / "jobs").rglob("*.out")))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    m = RESULT.search(out)
    if not m:
        raise SystemExit(f"stragglers.py: no RESULT line from the job:\n{out[-3000:]}")
    return json.loads(m.group(1))


class throttled:
    """tc tbf on ``node``'s eth0 (its egress) for the block's duration, removed however it ends."""

    def __init__(self, node: str, rate: str) -> None:
        self.node, self.rate = node, rate

    def _tc(self, *words: str, check: bool = True) -> None:
        subprocess.run([PY, "-m", "hpcring", "devcluster", "exec", self.node, "--", "tc", *words],
                       check=check, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))

    def __enter__(self):
        self._tc("qdisc", "del", "dev", "eth0", "root", check=False)
        self._tc("qdisc", "add", "dev", "eth0", "root", "tbf", "rate", self.rate, "burst", "32kbit", "latency", "400ms")
        return self

    def __exit__(self, *exc) -> None:
        self._tc("qdisc", "del", "dev", "eth0", "root", check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--where", choices=("local", "devcluster"), default="local")
    ap.add_argument("--only", default="slow,clean,loaded,overhead")
    ap.add_argument("--rate", default="200mbit", help="tbf rate of node2's eth0 in the link scenario")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--factor", type=float, default=1.3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--clean-steps", type=int, default=2000)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--overhead-steps", type=int, default=300)
    ap.add_argument("--job-timeout", type=float, default=900)
    args = ap.parse_args()
    size = args.ranks if args.where == "local" else 6
    only = set(args.only.split(","))
    print(f"# stragglers.py --where {args.where}: {size} ranks, window "
          f"{os.environ.get('HPCRING_STRAGGLER_WINDOW', 50)} collectives, {os.cpu_count()} cores", flush=True)
    if "slow" in only:
        slow = size - 1
        r = run_job(args, {"SLOW_RANK": str(slow), "SLOW_FACTOR": str(args.factor)}, args.steps)
        named = [ln for ln in r["lines"] if f"rank {slow} (" in ln]
        print(f"slow     rank {slow} at {args.factor}x: first verdict at step {r['first_verdict_step']} of "
              f"{args.steps} (target <= 100), {'named' if named else 'NOT named'}; step {r['median_step_s'] * 1e3:.1f} ms",
              flush=True)
        for ln in r["lines"]:
            print(f"         {ln}")
    for name, busy in (("clean", 0), ("loaded", args.busy)):
        if name in only:
            t0 = time.monotonic()
            r = run_job(args, {}, args.clean_steps, busy=busy)
            print(f"{name:<8} {args.clean_steps} steps, {busy} busy processes: {len(r['lines'])} verdicts in "
                  f"{r['windows']} windows (target 0); step {r['median_step_s'] * 1e3:.1f} ms, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            for ln in r["lines"]:
                print(f"         {ln}")
    if "link" in only and args.where == "devcluster":
        with throttled("node2", args.rate):
            r = run_job(args, {"NBYTES": str(4 << 20), "WORK_MS": "20"}, args.steps)
        links = [ln for ln in r["lines"] if "the link node2 -> " in ln]
        print(f"link     node2 eth0 at {args.rate}: first verdict at step {r['first_verdict_step']} of {args.steps}, "
              f"{'named as a link' if links else 'NOT named as a link'}; step {r['median_step_s'] * 1e3:.1f} ms",
              flush=True)
        for ln in r["lines"]:
            print(f"         {ln}")
    if "overhead" in only:
        ratios, on_s, off_s, cpu = [], [], [], []
        for _ in range(args.pairs):
            res = run_job(args, {"MODE": "ddp", "WORK_MS": "5"}, args.overhead_steps)
            on = res["median_step_s"]
            cpu.append(res["watcher_cpu_share"])
            off = run_job(args, {"MODE": "ddp", "WORK_MS": "5", "HPCRING_STRAGGLERS": "0"},
                          args.overhead_steps)["median_step_s"]
            ratios.append(on / off)
            on_s.append(on)
            off_s.append(off)
        print(f"overhead DDP step on/off: median ratio {statistics.median(ratios):.4f} over {args.pairs} pairs "
              f"(target <= 1.005); on {statistics.median(on_s) * 1e3:.2f} ms, off {statistics.median(off_s) * 1e3:.2f} ms; "
              f"ratios {', '.join(f'{x:.3f}' for x in ratios)}; the busiest watcher thread's CPU: "
              f"{100 * max(cpu):.3f}% of the run's wall time", flush=True)


if __name__ == "__main__":
    main()
