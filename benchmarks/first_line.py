"""Time from `hpcring submit` to the job's first output line: the start-up a user waits through.

    python benchmarks/first_line.py [--site devcluster] [--nodes 3] [--backend gloo,hpcring] [--runs 3]

Each run submits ``examples/train_ddp.py --backend B --steps 2`` with ``--wait`` and reads the
rank-tagged output as it arrives; it prints, per backend, the seconds until the first line the job
printed and until the job ended (min / median / max over the runs). Everything the job needs
(scheduler queue, interpreter start, torch import, bootstrap, the process group's own rendezvous)
is inside the figure, so it is the number to compare before and after a start-up change, on one
machine, in one sitting. The dev cluster's nodes share this machine's cores: a loaded host
stretches every figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HPCRING = str(Path(sys.executable).with_name("hpcring"))


def one_run(site: str, nodes: int, backend: str, timeout: float) -> tuple[float, float]:
    argv = [HPCRING, "submit", str(ROOT / "examples" / "train_ddp.py"), "--site", site, "--nodes", str(nodes),
            "--wait", "--", "--backend", backend, "--steps", "2", "--cpu"]
    t0 = time.monotonic()
    first = None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    try:
        for line in proc.stdout:
            if first is None and line.startswith("[0]"):      # the job's own output, rank-tagged
                first = time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{backend}: no end within {timeout} s")
        rc = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        if proc.poll() is None:
            proc.kill()
    if rc != 0 or first is None:
        raise RuntimeError(f"{backend}: job exited {rc} (first line seen: {first is not None})")
    return first, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", default="devcluster")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--backend", default="gloo,hpcring", help="comma-separated torch.distributed backends")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    a = p.parse_args()
    os.environ.setdefault("HPCRING_JOB_DIR", "/srv/hpcring/first-line-jobs")
    print(f"{'backend':8} {'first line s (min/med/max)':>28} {'job end s (min/med/max)':>26}")
    for backend in a.backend.split(","):
        firsts, ends = [], []
        for _ in range(a.runs):
            f, e = one_run(a.site, a.nodes, backend, a.timeout)
            firsts.append(f)
            ends.append(e)

        def mmm(xs):
            return f"{min(xs):6.1f} / {statistics.median(xs):6.1f} / {max(xs):6.1f}"
        print(f"{backend:8} {mmm(firsts):>28} {mmm(ends):>26}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
