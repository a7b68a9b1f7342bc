"""Many short multi-node jobs at once: counts the jobs that fail for no reason of their own.

    python benchmarks/short_jobs.py [--jobs 200] [--concurrent 20] [--site devcluster] [--nodes 3] [--tasks-per-node 2]

Each job is ``tests/data/secret_skew.py``: rank 0 ends at once, the other ranks seconds later
still need the job (its secret, a collective) -- the pattern that exposed the secret race. Jobs are
submitted ``--concurrent`` at a time with ``--wait``; the scheduler queues what does not fit. Prints
the count of COMPLETED and of failed jobs with each failure's verdict line, and exits 1 if any
failed. A healthy job must never fail here; the figure is a count, not a time.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "secret_skew.py"


def one(i: int, a) -> tuple[int, int, str]:
    env = dict(os.environ, SKEW_S=str(a.skew))
    argv = [str(Path(sys.executable).with_name("hpcring")), "submit", str(SCRIPT), "--site", a.site,
            "--nodes", str(a.nodes), "--tasks-per-node", str(a.tasks_per_node), "--wait"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=a.timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return i, 124, f"no end within {a.timeout} s"
    verdict = next((l for l in r.stderr.splitlines() if l.startswith("error:")), r.stderr.strip()[-300:])
    return i, r.returncode, verdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--concurrent", type=int, default=20)
    p.add_argument("--site", default="devcluster")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--tasks-per-node", type=int, default=2)
    p.add_argument("--skew", type=float, default=1.0, help="seconds between the first and the last rank's end")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job, queueing included")
    a = p.parse_args()
    os.environ.setdefault("HPCRING_JOB_DIR", "/srv/hpcring/short-jobs")
    t0 = time.monotonic()
    failed = []
    with ThreadPoolExecutor(a.concurrent) as pool:
        for i, rc, verdict in pool.map(lambda i: one(i, a), range(a.jobs)):
            if rc != 0:
                failed.append((i, rc, verdict))
                print(f"job {i}: exit {rc}: {verdict}", flush=True)
    took = time.monotonic() - t0
    print(f"{a.jobs} jobs ({a.nodes}x{a.tasks_per_node} ranks, {a.concurrent} at a time) in {took:.0f} s: "
          f"{a.jobs - len(failed)} completed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
