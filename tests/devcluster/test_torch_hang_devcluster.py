"""A plain DDP-on-gloo script whose rank hangs, submitted to the real dev cluster
(`hpcring submit --site devcluster --wait`, 3 nodes x 1 rank): the report names the rank, its
host and where it is; Slurm marks the job FAILED."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "torch_ddp_worker.py"
from helpers.jobs import sacct_state  # noqa: E402
from helpers.jobs import job_id_of  # noqa: E402



def test_ddp_on_gloo_hang_on_the_cluster_is_reported():
    folder = Path("/srv/hpcring/pytest-torch-hang") / uuid.uuid4().hex[:8]
    folder.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_TIMEOUT="5", HPCRING_DIAG_GRACE="3",
               HPCRING_JOB_DIR=str(folder), HPCRING_STATE_DIR=str(folder / "state"))
    cmd = [sys.executable, "-m", "hpcring", "submit", str(WORKER), "--site", "devcluster", "--nodes", "3",
           "--tasks-per-node", "1", "--time", "5", "--wait", "--", "sleep", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=240,
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    job = job_id_of(p)
    rep = json.loads((folder / job / "diag" / "hang-report.json").read_text())     # one diag folder per job
    assert rep["categories"]["missing"] == [2], rep
    assert "rank 2 (node3) never joined" in rep["headline"] and rep["op"]["backend"] == "gloo"
    assert "now in load_batch at torch_ddp_worker.py" in rep["details"]["2"]
    assert "never joined" in out                                  # submit --wait ends with the headline
    assert sacct_state(job) == "FAILED"
    for r in range(3):
        assert (folder / job / "diag" / f"stacks-rank{r}.txt").is_file()
