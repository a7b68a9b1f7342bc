"""Job arrays and dependencies on the local backend: bounded parallel tasks, each the whole job with
HPCRING_ARRAY_TASK and its sweep values; `cancel JOB_TASK` of a queued task; `--after` waits for
the other job's outcome."""
from __future__ import annotations

import json
import time
from pathlib import Path

from helpers.jobs import job_id_of, local_env_for  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "array_worker.py"
HELLO = ROOT / "examples" / "hello.py"


env_for = local_env_for


def local_state(tmp_path, job: str) -> dict:
    return json.loads((tmp_path / "jobs" / job / f"{job}_local.json").read_text())


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := pred()):
            return got
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def test_a_local_sweep_runs_at_most_n_tasks_at_once(hpcring, tmp_path):
    env = env_for(tmp_path, ARRAY_WORKER_SLEEP_S="1.5")
    r = hpcring("submit", str(WORKER), "--tasks-per-node", "2", "--sweep", "lr=1,2", "--sweep", "bs=8,16",
                "--array", "%2", "--wait", env=env)
    assert r.returncode == 0, r.stderr
    job = job_id_of(r)
    assert "job %s COMPLETED: 4 tasks" % job in r.stderr
    spans = [(local_state(tmp_path, f"{job}_{i}")["started"], local_state(tmp_path, f"{job}_{i}")["ended"])
             for i in range(4)]
    for t, _ in spans:                 # at no task's start were more than 2 tasks running
        assert sum(1 for s, e in spans if s <= t < e) <= 2, spans
    out = hpcring("logs", f"{job}_2", env=env).stdout
    lines = [json.loads(l.split("ARRAY ", 1)[1]) for l in out.splitlines() if "ARRAY " in l]
    assert sorted((x["task"], x["rank"], tuple(x["args"])) for x in lines) == \
        [("2", 0, ("--lr", "2", "--bs", "8")), ("2", 1, ("--lr", "2", "--bs", "8"))]
    st = hpcring("status", job, env=env)
    assert "  4 COMPLETED\n" in st.stdout and "lr=2 bs=16" in st.stdout, st.stdout


def test_cancel_one_queued_task(hpcring, tmp_path):
    env = env_for(tmp_path, ARRAY_WORKER_SLEEP_S="3")
    r = hpcring("submit", str(WORKER), "--array", "0-2%1", env=env)
    assert r.returncode == 0, r.stderr
    job = job_id_of(r)
    c = hpcring("cancel", f"{job}_2", env=env)
    assert c.returncode == 0 and f"cancel requested for job {job}_2" in c.stderr, c.stderr
    st = wait_for(lambda: (s := hpcring("status", job, env=env).stdout) and "PENDING" not in s
                  and "RUNNING" not in s and s, 60, "array over")
    assert "  2 COMPLETED, 1 CANCELLED\n" in st, st
    assert not list((tmp_path / "jobs" / f"{job}_2").glob("*_log.out"))     # it never ran
    again = hpcring("cancel", f"{job}_2", env=env)
    assert "has already ended (CANCELLED)" in again.stderr


def test_after_waits_for_the_outcome(hpcring, tmp_path):
    env = env_for(tmp_path)
    a = hpcring("submit", str(HELLO), "--nodes", "1", env=dict(env, HELLO_FAIL_RANK="0"))
    first = job_id_of(a)
    ok = hpcring("submit", str(WORKER), "--after", first, "--wait", env=env)          # afterok: never met
    assert ok.returncode != 0 and "CANCELLED" in ok.stderr, ok.stderr
    second = job_id_of(ok)
    assert f"can never be met: job {first} ended FAILED" in local_state(tmp_path, second)["reason"]
    anyway = hpcring("submit", str(WORKER), "--dependency", f"afterany:{first}", "--wait", env=env)
    assert anyway.returncode == 0, anyway.stderr
    third = job_id_of(anyway)
    assert local_state(tmp_path, third)["started"] >= local_state(tmp_path, first)["ended"]


def test_cancel_the_whole_array(hpcring, tmp_path):
    """The running task is stopped, the queued ones never start, the queue itself ends."""
    env = env_for(tmp_path, ARRAY_WORKER_SLEEP_S="30")
    r = hpcring("submit", str(WORKER), "--array", "0-3%1", env=env)
    job = job_id_of(r)
    wait_for(lambda: "RUNNING" in hpcring("status", f"{job}_0", env=env).stdout, 60, "task 0 running")
    c = hpcring("cancel", job, env=env)
    assert c.returncode == 0, c.stderr
    st = wait_for(lambda: (s := hpcring("status", job, env=env).stdout) and "PENDING" not in s
                  and "RUNNING" not in s and s, 60, "array over")
    assert "  4 CANCELLED\n" in st, st
    queue_pid = local_state(tmp_path, f"{job}_3")["pid"]          # the queue kept the queued tasks
    wait_for(lambda: not Path(f"/proc/{queue_pid}").exists() or
             Path(f"/proc/{queue_pid}/stat").read_text().split(") ")[-1].startswith("Z"), 30, "the queue gone")
    for i in (1, 2, 3):
        assert not (tmp_path / "jobs" / f"{job}_{i}" / f"{job}_{i}_supervisor.log").exists()
