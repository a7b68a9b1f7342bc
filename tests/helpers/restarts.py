"""`hpcring submit --wait --max-restarts` of tests/workers/restart_train.py, and what its output says."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "tests" / "workers" / "restart_train.py"


def run(site: str, base: Path, restarts: str | None, *script_args: str, nodes: int = 2, timeout_s: int = 8,
        env_extra=None):
    """`hpcring submit --wait` of restart_train.py; (rc, output, env, out dir)."""
    out = base / "out"
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(base / "state"),
               HPCRING_JOB_DIR=str(base / "jobs"), HPCRING_TIMEOUT=str(timeout_s), **(env_extra or {}))
    env.pop("HPCRING_MAX_RESTARTS", None)
    cmd = [sys.executable, "-m", "hpcring", "submit", str(TRAIN), "--site", site, "--nodes", str(nodes),
           "--tasks-per-node", "1", "--time", "5", "--wait",
           *(["--max-restarts", restarts] if restarts is not None else []), "--", str(out), *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                       timeout=420)
    (base / "submit.log").write_text(p.stdout + p.stderr)      # kept for a failure's post-mortem
    return p.returncode, p.stdout + p.stderr, env, out


def jobs_of(text: str) -> list[str]:
    return re.findall(r"Submitted job (\S+)", text)


def status(env, job: str) -> str:
    return subprocess.run([sys.executable, "-m", "hpcring", "status", job], env=env, capture_output=True,
                          text=True, timeout=60).stdout
