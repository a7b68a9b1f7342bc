"""hpcring.torch on the real dev cluster: `hpcring submit --timeline` of tests/workers/horovod_worker.py on
2 nodes (DistributedOptimizer training equivalence + the timeline), then `hpcring timeline JOB`
merges both hosts' records into one Chrome trace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
from helpers.jobs import job_id_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_submit_timeline_on_two_nodes_merges_both_hosts():
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_TIMEOUT="60")
    r = subprocess.run([sys.executable, "-m", "hpcring", "submit", str(ROOT / "tests" / "workers" / "horovod_worker.py"),
                        "--site", "devcluster", "--nodes", "2", "--tasks-per-node", "1", "--time", "5",
                        "--timeline", "--wait", "--", "train:none:1", "timeline"],
                       capture_output=True, text=True, timeout=400, env=e, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    for mode in ("train:none:1", "timeline"):
        for rank in (0, 1):
            assert f"OK {mode} rank {rank}" in r.stdout, r.stdout
    job = job_id_of(r)
    m = subprocess.run([sys.executable, "-m", "hpcring", "timeline", job], capture_output=True, text=True,
                       timeout=60, env=e)
    assert m.returncode == 0, m.stderr
    doc = json.loads((Path("/srv/hpcring/jobs") / job / "timeline.json").read_text())
    names = {ev["pid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev.get("name") == "process_name"}
    assert set(names) == {0, 1}, names
    hosts = {n.split("(")[1].rstrip(")") for n in names.values()}
    assert len(hosts) == 2, names                                       # two real hosts
    for rank in (0, 1):
        assert any(ev["ph"] == "X" and ev["pid"] == rank and ev["cat"] == "backend" for ev in doc["traceEvents"])
