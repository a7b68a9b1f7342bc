"""hydra/launcher=hpcring on the real Slurm dev cluster: the multirun of examples/hydra_app as one
Slurm job array, every point on 2 nodes, at most 2 points at once (conf/config.yaml); a failing
point named with its rank and node while the others complete."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("hydra")

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "hydra_app" / "app.py"



def app(tmp_path, *overrides, timeout=600):
    """The app's multirun on site devcluster, 2 nodes x 1 rank a point; the sweep under tmp_path
    (scripts/test.sh puts pytest's tmp under /srv/hpcring, which every node sees)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRING_")}
    env.update(HPCRING_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, str(APP), "-m", "hydra.launcher.site=devcluster", "hydra.launcher.nodes=2",
                           "hydra.launcher.tasks_per_node=1", f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=str(ROOT),
                          stdin=subprocess.DEVNULL)


def sacct(job: str) -> list[str]:
    r = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True,
                       timeout=30)
    return sorted(r.stdout.split())


def test_every_point_is_a_two_node_slurm_array_task(tmp_path):
    r = app(tmp_path, "x=1,2,3,4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sweep = tmp_path / "sweep"
    points = [json.loads((sweep / str(n) / "result.json").read_text()) for n in range(4)]
    array = points[0]["job_id"].split("_")[0]
    for n, got in enumerate(points):
        assert (got["x"], got["sum"], got["size"], got["job_id"]) == (n + 1, 3.0 * (n + 1), 2, f"{array}_{n}"), got
        log = (sweep / str(n) / "app.log").read_text()
        hosts = {line.split(" on ")[1].split(":")[0] for line in log.splitlines() if " of 2 on " in line}
        assert len(hosts) == 2, log                     # the point's two ranks on two nodes
    assert sacct(array) == [f"{array}_{n}|COMPLETED" for n in range(4)]
    spans = [(p["started"], p["ended"]) for p in points]       # array_parallelism 2: Slurm's %2
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 2, spans


def test_a_failing_point_names_its_rank_and_node(tmp_path):
    r = app(tmp_path, "x=1,2,3,4", "fail_on=3")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    sweep = tmp_path / "sweep"
    assert [json.loads((sweep / str(n) / "result.json").read_text())["sum"] for n in (0, 1, 3)] == [3.0, 6.0, 12.0]
    array = json.loads((sweep / "0" / "result.json").read_text())["job_id"].split("_")[0]
    assert "Error executing job with overrides: ['x=3', 'fail_on=3']" in r.stderr, r.stderr
    assert f"sweep point #2 (x=3 fail_on=3): job {array}_2 (app) FAILED: rank 1 on node" in r.stderr, r.stderr
    assert "ValueError: x=3 is refused on rank 1" in r.stderr
    assert f"{array}_2|FAILED" in sacct(array)
