"""A receive whose sender never sends, across hosts on the real dev cluster (`hpcring submit
--site devcluster --wait`, 3 nodes x 2 ranks, the pair as a subgroup): the report names the pair
(global ranks), the tag, the size and the hosts, within the deadline + 30 s; Slurm marks the job
FAILED."""
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
WORKER = ROOT / "tests" / "workers" / "torch_p2p_worker.py"
from helpers.jobs import sacct_state  # noqa: E402
from helpers.jobs import job_id_of  # noqa: E402



@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_a_recv_hang_across_hosts_in_a_subgroup_is_named(backend):
    folder = Path("/srv/hpcring/pytest-p2p-hang") / uuid.uuid4().hex[:8]
    folder.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_TIMEOUT="5", HPCRING_DIAG_GRACE="3",
               HPCRING_JOB_DIR=str(folder), HPCRING_STATE_DIR=str(folder / "state"))
    env["HPCRING_BACKEND"] = backend
    cmd = [sys.executable, "-m", "hpcring", "submit", str(WORKER), "--site", "devcluster", "--nodes", "3",
           "--tasks-per-node", "2", "--time", "5", "--wait", "--", "hang", "3", "group"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300,
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    job = job_id_of(p)
    rep = json.loads((folder / job / "diag" / "hang-report.json").read_text())
    assert rep["headline"] == "p2p#1 (rank 3 -> rank 4, tag 7): rank 3 (node2) never sent it", rep["headline"]
    assert rep["categories"]["missing"] == [3] and rep["categories"]["joined"] == [4], rep
    assert rep["op"]["backend"] == backend, rep["op"]
    err = rep["trigger"]["error"]
    assert err.startswith("rank 4 (node3) waited for recv from rank 3 (node2), tag 7, 4 MiB: "), err
    assert "torch_p2p_worker.py" in rep["details"]["3"], rep["details"]
    assert rep["trigger"]["time"] - rep["op"]["t_started"] < 5 + 30
    assert "never sent it" in out                                 # submit --wait ends with the headline
    assert sacct_state(job) == "FAILED"
