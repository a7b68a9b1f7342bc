"""A failing, requeued or cancelled job on the real Slurm dev cluster as the user sees it: the
rank's own exit code (not the SIGKILL of hpcring's teardown) from --wait, status and logs -f;
the script's traceback once with only its frames; srun's lines tagged as Slurm's, not rank 0's;
no submitit log lines on a requeue; a cancel after a requeue not blamed on the earlier run's report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


FAIL_ONE = """import os, sys, time
def inner():
    raise ValueError("boom on rank " + os.environ["RANK"])
if os.environ["RANK"] == "1":
    inner() if sys.argv[1] == "raise" else sys.exit(3)
time.sleep(60)
"""
SLEEP = """import time
print("started", flush=True)
time.sleep(120)
"""


@pytest.fixture
def work(tmp_path):
    """A folder every node sees (scripts, job folders) and this test's own job registry."""
    d = Path("/srv/hpcring/pytest-user-output") / uuid.uuid4().hex[:8]
    d.mkdir(parents=True)
    return d, {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_JOB_DIR": str(d / "jobs")}


def job_of(r) -> str:
    return r.stderr.split("Submitted job ")[1].split()[0]


def verdicts(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")]


def no_internals(out: str) -> None:
    for word in ("submitit", "RankFailed", "runpy", "hpcring/job.py", "site-packages", "[0]<stderr>:srun:"):
        assert word not in out, f"{word!r} in the output:\n{out}"


def test_sys_exit_3_is_exit_code_3_in_wait_status_and_logs(hpcring, work):
    d, env = work
    script = d / "fail_one.py"
    script.write_text(FAIL_ONE)
    r = hpcring("submit", str(script), "--site", "devcluster", "--nodes", "2", "--wait", "--", "exit", env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    no_internals(r.stdout)
    assert "Traceback" not in r.stdout
    assert "[slurm]<stderr>:srun: error: " in r.stdout, r.stdout        # srun's kill lines, as srun's
    assert len(verdicts(r.stderr)) == 1 and "rank 1 on node2: exited with code 3" in r.stderr, r.stderr
    job = job_of(r)
    st = hpcring("status", job, env=env)
    assert st.returncode == 0 and st.stdout.splitlines()[0] == f"job {job}  FAILED  exit 3", st.stdout
    logs = hpcring("logs", job, "--follow", env=env)
    assert logs.returncode == 3 and len(verdicts(logs.stderr)) == 1, logs.stderr


def test_an_exception_shows_the_scripts_traceback_once(hpcring, work):
    d, env = work
    script = d / "fail_one.py"
    script.write_text(FAIL_ONE)
    r = hpcring("submit", str(script), "--site", "devcluster", "--nodes", "2", "--wait", "--", "raise", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    no_internals(r.stdout)
    assert r.stdout.count("Traceback (most recent call last):") == 1, r.stdout
    frames = [ln for ln in r.stdout.splitlines() if "File " in ln]
    assert [f.rsplit(", in ", 1)[1] for f in frames] == ["<module>", "inner"], r.stdout
    assert all(f.startswith("[1]<stderr>:") and str(script) in f for f in frames), r.stdout
    assert verdicts(r.stderr) == [f"error: job {job_of(r)} (fail_one) FAILED: rank 1 on node2: "
                                  "ValueError: boom on rank 1; rank 0 did not finish"], r.stderr


def _wait_for(pred, timeout: float = 120, what: str = ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _squeue_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_requeue_then_cancel_is_quiet_and_not_blamed_on_the_earlier_run(hpcring, work):
    """A running job (status: no exit code) gets a hang report (as its watchdog would write
    one), is requeued (no submitit lines in any rank's output), then cancelled while pending:
    the verdict says CANCELLED and does not cite that earlier run's report."""
    d, env = work
    script = d / "sleep.py"
    script.write_text(SLEEP)
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **env)
    p = subprocess.Popen([sys.executable, "-m", "hpcring", "submit", str(script), "--site", "devcluster",
                          "--nodes", "2", "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=e, stdin=subprocess.DEVNULL, cwd=str(ROOT))
    try:
        job = p.stderr.readline().split("Submitted job ")[1].split()[0]
        folder = d / "jobs" / job
        _wait_for(lambda: (folder / f"{job}_requeues.json").exists() and
                  "started" in (folder / f"{job}_1_log.out").read_text(), what="both ranks to start")
        st = hpcring("status", job, env=env)
        assert st.stdout.splitlines()[0] == f"job {job}  RUNNING", st.stdout
        (folder / "diag").mkdir(exist_ok=True)
        (folder / "diag" / "hang-report.json").write_text(json.dumps({"headline": "allreduce#7: rank 1 never joined"}))
        time.sleep(1.1)                     # sacct's Submit has whole seconds
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        _wait_for(lambda: _squeue_state(job) == "PENDING", what="the requeued job to be pending")
        time.sleep(2)                       # the killed ranks' last lines reach the follower
        c = hpcring("cancel", job, env=env)
        assert c.returncode == 0, c.stderr
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert "submitit" not in out and "Bypassing" not in out, out
    v = verdicts(err)
    assert len(v) == 1 and v[0].startswith(f"error: job {job} (sleep) CANCELLED"), err
    assert "allreduce" not in err and "collective" not in err, err
