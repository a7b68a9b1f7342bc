"""Job arrays, sweeps and dependencies on the real Slurm dev cluster, and `status` of several real
jobs from one scheduler query."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers.jobs import job_id_of


ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "array_worker.py"
HELLO = ROOT / "examples" / "hello.py"


@pytest.fixture
def env(tmp_path):
    return {"HPCRING_STATE_DIR": str(tmp_path / "state")}


def seen(stdout: str) -> list[dict]:
    return [json.loads(l.split("ARRAY ", 1)[1]) for l in stdout.splitlines() if "<stdout>:ARRAY " in l]


def sacct(job: str, fields: str) -> list[str]:
    r = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", fields], capture_output=True, text=True,
                       timeout=30)
    return r.stdout.splitlines()


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def test_a_sweep_runs_one_two_node_task_per_value(hpcring, env):
    r = hpcring("submit", str(WORKER), "--site", "devcluster", "--nodes", "2", "--sweep", "lr=0.1,0.01",
                "--array", "%2", "--wait", "--", "--steps", "3", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    job = job_id_of(r)
    logs = hpcring("logs", job, env=env)
    got = sorted((x["task"], x["rank"], tuple(x["args"])) for x in seen(logs.stdout))
    assert got == [("0", 0, ("--steps", "3", "--lr", "0.1")), ("0", 1, ("--steps", "3", "--lr", "0.1")),
                   ("1", 0, ("--steps", "3", "--lr", "0.01")), ("1", 1, ("--steps", "3", "--lr", "0.01"))]
    for task in ("0", "1"):            # each task is the whole 2-node job (which nodes: Slurm's choice)
        assert len({x["host"] for x in seen(logs.stdout) if x["task"] == task}) == 2
    st = hpcring("status", job, env=env)
    assert st.returncode == 0 and "  2 COMPLETED\n" in st.stdout, st.stdout
    assert f"{job}_1" in st.stdout and "lr=0.01" in st.stdout
    assert json.loads((Path("/srv/hpcring/jobs") / job / "array.json").read_text())["sweep"] == \
        [{"lr": "0.1"}, {"lr": "0.01"}]
    assert sorted(sacct(job, "JobID,State")) == [f"{job}_0|COMPLETED", f"{job}_1|COMPLETED"]
    one = hpcring("status", f"{job}_1", env=env)
    assert one.returncode == 0 and f"job {job}_1  COMPLETED" in one.stdout, one.stdout


def test_an_array_task_is_cancelled_alone(hpcring, env):
    r = hpcring("submit", str(WORKER), "--site", "devcluster", "--nodes", "1", "--array", "0-2%2",
                env=dict(env, ARRAY_WORKER_SLEEP_TASK="1"))
    assert r.returncode == 0, r.stderr
    job = job_id_of(r)
    wait_for(lambda: "RUNNING" in hpcring("status", f"{job}_1", env=env).stdout, 120, f"task {job}_1 running")
    stacks = hpcring("stacks", f"{job}_1", env=env, timeout=120)    # the task's own Slurm id reaches the probe
    assert stacks.returncode == 0 and "in <module> at array_worker.py" in stacks.stdout, stacks.stdout + stacks.stderr
    c = hpcring("cancel", f"{job}_1", env=env)
    assert c.returncode == 0 and f"cancel requested for job {job}_1" in c.stderr, c.stderr
    def over():
        text = hpcring("status", job, env=env).stdout
        return text if "PENDING" not in text and "RUNNING" not in text and "UNKNOWN" not in text else None
    out = wait_for(over, 180, f"array {job} over")
    assert "  2 COMPLETED, 1 CANCELLED\n" in out, out
    assert sorted(x.split()[0] for x in sacct(job, "JobID,State")) == \
        [f"{job}_0|COMPLETED", f"{job}_1|CANCELLED", f"{job}_2|COMPLETED"]      # "CANCELLED by 0"
    tasks = {x["task"] for x in seen(hpcring("logs", job, env=env).stdout)}
    assert tasks == {"0", "1", "2"}


def test_after_starts_a_job_when_the_first_one_completed(hpcring, env):
    a = hpcring("submit", str(WORKER), "--site", "devcluster", "--nodes", "1", env=dict(env, ARRAY_WORKER_SLEEP_S="8"))
    assert a.returncode == 0, a.stderr
    first = job_id_of(a)
    b = hpcring("submit", str(HELLO), "--site", "devcluster", "--nodes", "1", "--after", first, env=env)
    assert b.returncode == 0, b.stderr
    second = job_id_of(b)
    reason = subprocess.run(["squeue", "-h", "-j", second, "-o", "%T|%r"], capture_output=True, text=True,
                            timeout=30).stdout.strip()
    assert reason == "PENDING|Dependency", reason          # Slurm holds it for the first job
    wait_for(lambda: sacct(second, "State") == ["COMPLETED"], 180, f"job {second} completed")
    (end_a,) = sacct(first, "End")
    (start_b,) = sacct(second, "Start")
    assert sacct(first, "State") == ["COMPLETED"] and start_b >= end_a, (start_b, end_a)   # ISO times


def test_status_of_several_real_jobs_is_one_scheduler_query(hpcring, env, monkeypatch):
    """Every job finished: one sacct for all of them, counted by a recording wrapper
    around the command runner, in this process, against the real cluster."""
    ids = []
    for _ in range(4):
        r = hpcring("submit", str(HELLO), "--site", "devcluster", "--nodes", "1", env=env)
        assert r.returncode == 0, r.stderr
        ids.append(job_id_of(r))
    wait_for(lambda: all(sacct(j, "State") == ["COMPLETED"] for j in ids), 180, "4 jobs completed")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from hpcring import jobstatus
    from hpcring.schedulers import slurm
    calls = []
    real = slurm.run_command

    def recording(cmd, **kw):
        calls.append(cmd)
        return real(cmd, **kw)
    monkeypatch.setattr(slurm, "run_command", recording)
    rows = jobstatus.recent(10)
    assert sorted(r.job_id for r, _, _ in rows) == sorted(ids)
    assert all(st is not None and st.state == "COMPLETED" for _, st, _ in rows), rows
    assert [c[0] for c in calls] == ["sacct"], calls


# ---- the same on LSF, through the emulation (tests/lsf_emulation: LSF cannot be installed here) ----

EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"


@pytest.fixture
def lsf_env(tmp_path):
    d = Path("/srv/hpcring") / f".lsf-emulation-arrays-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    yield {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_LSF_EMU_DIR": str(d),
           "PATH": f"{EMU_BIN}:{os.environ['PATH']}"}
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def bjobs(ref: str, env) -> list[str]:
    r = subprocess.run(["bjobs", "-o", "jobid jobindex stat", "-noheader", ref], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, **env))
    return r.stdout.splitlines()


def test_an_lsf_sweep_maps_task_i_to_index_i_plus_1(hpcring, lsf_env):
    r = hpcring("submit", str(WORKER), "--site", "devcluster-lsf", "--nodes", "2", "--sweep", "lr=0.1,0.01,0.001",
                "--array", "%2", "--wait", env=lsf_env)
    assert r.returncode == 0, r.stderr + r.stdout
    job = job_id_of(r)
    got = sorted((x["task"], x["lsf_index"], x["rank"], tuple(x["args"]))
                 for x in seen(hpcring("logs", job, env=lsf_env).stdout))
    assert got == [(str(t), str(t + 1), rank, ("--lr", lr)) for t, lr in enumerate(["0.1", "0.01", "0.001"])
                   for rank in (0, 1)]
    assert sorted(bjobs(job, lsf_env)) == [f"{job} {i} DONE" for i in (1, 2, 3)]
    st = hpcring("status", job, env=lsf_env)
    assert "  3 COMPLETED\n" in st.stdout and f"{job}_2" in st.stdout and "lr=0.001" in st.stdout, st.stdout


def test_an_lsf_job_after_another(hpcring, lsf_env):
    a = hpcring("submit", str(WORKER), "--site", "devcluster-lsf", "--nodes", "1",
                env=dict(lsf_env, ARRAY_WORKER_SLEEP_S="6"))
    assert a.returncode == 0, a.stderr
    first = job_id_of(a)
    b = hpcring("submit", str(HELLO), "--site", "devcluster-lsf", "--nodes", "1", "--after", first, env=lsf_env)
    assert b.returncode == 0, b.stderr
    second = job_id_of(b)
    wait_for(lambda: bjobs(first, lsf_env) == [f"{first} 0 RUN"], 60, f"job {first} running")
    assert bjobs(second, lsf_env) == [f"{second} 0 PEND"]          # -w "done(FIRST)" holds it
    wait_for(lambda: bjobs(second, lsf_env) == [f"{second} 0 DONE"], 120, f"job {second} done")
    assert bjobs(first, lsf_env) == [f"{first} 0 DONE"]
