"""`hpcring submit` on the real Slurm dev cluster (hpcring devcluster up)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers.jobs import job_id_of

ROOT = Path(__file__).resolve().parents[2]
HELLO = ROOT / "examples" / "hello.py"


@pytest.fixture
def env(tmp_path):
    return {"HPCRING_STATE_DIR": str(tmp_path / "state")}


def hellos(stdout: str) -> list[dict]:
    return [json.loads(l.split("HELLO ", 1)[1]) for l in stdout.splitlines() if "<stdout>:HELLO " in l]


def test_sbatch_test_only_accepts_rendered_script(hpcring, tmp_path):
    r = hpcring("render", str(HELLO), "--site", "devcluster", "--nodes", "3", "--tasks-per-node", "2")
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sh"
    script.write_text(r.stdout)
    t = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=30)
    assert t.returncode == 0, t.stderr
    assert "to start at" in t.stderr


def test_hello_3_nodes_x_2_ranks(hpcring, env):
    r = hpcring("submit", str(HELLO), "--nodes", "3", "--tasks-per-node", "2", "--site", "devcluster",
                "--wait", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    recs = hellos(r.stdout)
    assert sorted(x["rank"] for x in recs) == list(range(6))
    assert len({(x["rank"], x["local_rank"], x["host"], x["address"]) for x in recs}) == 6
    by_host = {}
    for x in recs:
        by_host.setdefault(x["host"], set()).add((x["local_rank"], x["address"]))
    assert sorted(by_host) == ["node1", "node2", "node3"]
    for host, items in by_host.items():  # two local ranks per node, one address per node
        assert {lr for lr, _ in items} == {0, 1}
        (addr,) = {a for _, a in items}
        assert addr == f"10.99.0.{host[-1]}"
    st = hpcring("status", job_id_of(r), env=env)
    assert st.returncode == 0 and "COMPLETED" in st.stdout, st.stdout
    sacct = subprocess.run(["sacct", "-j", job_id_of(r), "-X", "-n", "-P", "-o", "State"],
                           capture_output=True, text=True, timeout=30)
    assert sacct.stdout.strip() == "COMPLETED"


def test_failing_rank_named(hpcring, env):
    r = hpcring("submit", str(HELLO), "--nodes", "3", "--tasks-per-node", "2", "--site", "devcluster", "--wait",
                env=dict(env, HELLO_FAIL_RANK="1"))
    assert r.returncode != 0
    assert "rank 1 on node1: exited with code 3" in r.stderr, r.stderr
    st = hpcring("status", job_id_of(r), env=env)
    assert "FAILED" in st.stdout and "rank 1 on node1" in st.stdout


def test_submit_from_a_node_local_directory_is_named(env):
    """/tmp is private to each dev-cluster node (as on most clusters): a job submitted from there
    fails at once on every rank with the directory and the node named, not a chdir traceback.
    (Not pytest's tmp_path: scripts/test.sh puts that on the shared /srv/hpcring.)"""
    here = Path(tempfile.mkdtemp(prefix="hpcring-node-local-", dir="/tmp"))
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env)
    try:
        r = subprocess.run([sys.executable, "-m", "hpcring", "submit", str(HELLO), "--nodes", "2", "--site",
                            "devcluster", "--wait"], capture_output=True, text=True, env=e, timeout=300,
                           stdin=subprocess.DEVNULL, cwd=str(here))
    finally:
        shutil.rmtree(here, ignore_errors=True)
    assert r.returncode != 0
    assert f"the job's working directory {here} (where it was submitted) does not exist on node" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr.split("error: job")[-1] and "killed first" not in r.stderr, r.stderr


def test_cancel_sleeping_job(hpcring, env, tmp_path):
    sleeper = Path("/srv/hpcring") / f"sleep_{os.getpid()}.py"
    sleeper.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    r = hpcring("submit", str(sleeper), "--nodes", "2", "--site", "devcluster", env=env)
    assert r.returncode == 0, r.stderr
    jid = job_id_of(r)
    deadline = time.time() + 60
    while "RUNNING" not in hpcring("status", jid, env=env).stdout:
        assert time.time() < deadline, "job never started"
        time.sleep(1)
    assert hpcring("cancel", jid, env=env).returncode == 0
    deadline = time.time() + 60
    while True:
        out = hpcring("status", jid, env=env).stdout
        if "CANCELLED" in out:
            break
        assert time.time() < deadline, out
        time.sleep(1)
    deadline = time.time() + 60
    while True:  # COMPLETING (CG) until slurmd has reaped the steps
        q = subprocess.run(["squeue", "-h", "-j", jid], capture_output=True, text=True, timeout=30)
        if q.stdout.strip() == "":
            break
        assert time.time() < deadline, q.stdout
        time.sleep(1)


def test_nonexistent_partition_refused_by_scheduler(hpcring, env, tmp_path):
    site = (ROOT / "site_configs" / "devcluster.yaml").read_text()
    site = site.replace("partitions:\n", "partitions:\n  gpu-a100:\n    max_nodes: 3\n")
    p = tmp_path / "dc.yaml"
    p.write_text(site)
    r = hpcring("submit", str(HELLO), "--site", str(p), "--partition", "gpu-a100", env=env)
    assert r.returncode == 1
    assert "sbatch refused the job" in r.stderr and "invalid partition" in r.stderr.lower()
    assert "sinfo" in r.stderr  # the hint says what to do
