"""`hpcring run --timeout` reaches real ranks: their communicators and a hang report (one local
job of 2 ranks, one of which never joins)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.jobs import hang_report

ROOT = Path(__file__).resolve().parents[2]

HANG = textwrap.dedent("""
    import os, time
    import numpy as np
    import hpcring
    s = hpcring.init()
    print(f"rank {s.rank} deadline env={os.environ['HPCRING_TIMEOUT']} comm={s.communicator().timeout}", flush=True)
    if s.rank == 1:
        time.sleep(120)
    s.allreduce(np.ones(4))
""")


def test_run_timeout_reaches_a_rank_and_its_hang_report(tmp_path):
    """`hpcring run --timeout 3` beats HPCRING_TIMEOUT=900: each rank's communicator has 3 s and
    the hang report of a rank that never joins names that deadline."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    env = {**os.environ, "HPCRING_TIMEOUT": "900", "HPCRING_DIAG_GRACE": "2", "HPCRING_JOB_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "2",
                        "--timeout", "3", "--", sys.executable, str(script)], env=env, capture_output=True,
                       text=True, timeout=240, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    for r in (0, 1):
        assert f"rank {r} deadline env=3 comm=3.0" in out, out
    rep = hang_report(tmp_path)
    assert rep["op"]["timeout"] == 3.0, rep
    assert "never joined" in rep["headline"] and "rank 1" in rep["headline"], rep["headline"]
    assert "deadline=3 s" in out, out


def test_submit_timeout_reaches_the_job_script_ranks_and_report(tmp_path):
    """The same through `hpcring submit --wait` on the local backend: the flag goes into the job
    script's environment, and from there into every rank's communicator and the report."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    jobs = tmp_path / "jobs"
    env = {**os.environ, "HPCRING_TIMEOUT": "900", "HPCRING_DIAG_GRACE": "2", "HPCRING_JOB_DIR": str(jobs),
           "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-m", "hpcring", "submit", str(script), "--site", "local",
                        "--tasks-per-node", "2", "--timeout", "3", "--wait"], env=env, capture_output=True,
                       text=True, timeout=240, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    for r in (0, 1):
        assert f"rank {r} deadline env=3 comm=3.0" in out, out
    rep = hang_report(jobs)
    assert rep["op"]["timeout"] == 3.0 and "rank 1" in rep["headline"], rep
    assert "within the 3 s deadline" in out and "deadline=3 s" in out, out
