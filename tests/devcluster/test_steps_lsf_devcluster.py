"""Restarts inside the allocation on LSF (hpcring.steps with schedulers/lsf_steps.py), end to end on
the LSF emulation (tests/lsf_emulation) over the dev cluster's 3 nodes.

A 2-host job with 1 spare host (`--spare-nodes 1 --max-restarts 1`, site devcluster-lsf) whose rank
1 is SIGKILLed or frozen (SIGSTOP) at step 3 goes on inside the same LSF job on the surviving host
and the spare (one `blaunch -z` a step): one job id, DONE, the restarted step resumes from the
checkpoint and ends with an uninterrupted run's weights; `hpcring status` shows the steps; a frozen
rank's task is ended by the loop (no bkill of the job). `--min-nodes 1` with no spare goes on with
one host. A code error is not restarted. `--preflight`
leaves a host whose interface routes nowhere out before the script starts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "tests" / "workers" / "restart_train.py"
EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"


@pytest.fixture
def base():
    """A folder every node sees: the emulation's state, the job folders, the script's output."""
    d = Path("/srv/hpcring/pytest-steps-lsf") / uuid.uuid4().hex[:10]
    (d / "out").mkdir(parents=True)
    (d / "emu").mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def submit(base: Path, *flags: str, script_args=(), env_extra=None):
    """`hpcring submit --wait` of restart_train.py on devcluster-lsf; (rc, text, env)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PATH=f"{EMU_BIN}:{os.environ['PATH']}",
               HPCRING_STATE_DIR=str(base / "state"), HPCRING_JOB_DIR=str(base / "jobs"),
               HPCRING_LSF_EMU_DIR=str(base / "emu"), HPCRING_TIMEOUT="8", **(env_extra or {}))
    env.pop("HPCRING_MAX_RESTARTS", None)
    env.pop("HPCRING_SECRET_FILE", None)
    cmd = [sys.executable, "-m", "hpcring", "submit", str(TRAIN), "--site", "devcluster-lsf", "--tasks-per-node", "1",
           "--time", "5", "--wait", *flags, "--", str(base / "out"), *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                       timeout=300)
    return p.returncode, p.stdout + p.stderr, env


def hosts(out: Path, attempt: int) -> dict[int, str]:
    return {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in out.glob(f"hosts-{attempt}-*")}


def job_of(text: str) -> list[str]:
    return re.findall(r"Submitted job (\S+)", text)


def steps_of(base: Path, job: str) -> dict:
    return json.loads((base / "jobs" / job / "steps.json").read_text())


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_lost_host_is_replaced_by_the_spare_inside_the_same_lsf_job(base, fault):
    rc, text, env = submit(base, "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "1",
                           script_args=("--steps", "10", f"--{fault}-rank", "1", "--freeze-step", "3"))
    assert rc == 0, text[-5000:]
    jobs = job_of(text)
    assert len(jobs) == 1, text[-3000:]                   # no resubmission: the same LSF job
    job = jobs[0]
    first, again = hosts(base / "out", 0), hosts(base / "out", 1)
    bad = first[1]
    assert len(again) == 2 and bad not in again.values() and again[0] == first[0], (first, again)
    res = json.loads((base / "out" / "result.json").read_text())
    assert res["w"] == res["expected"] and res["requeue_count"] == 1 and res["attempt"] == 1, res
    data = steps_of(base, job)
    s0, s1 = data["steps"]
    spare = (set(data["allocation"]) - {first[0], bad}).pop()
    assert len(data["allocation"]) == 3 and s0["hosts"] == [first[0], bad] and list(s0["blamed"]) == [bad], data
    assert s1["spares"] == [spare] and s1["end"] == "COMPLETED" and s1["size"] == 2, s1
    why = "dead (rank 1)" if fault == "kill" else "unreachable (rank 1)"
    assert why in s0["blamed"][bad], s0
    assert 0 < s0["lost_s"] < (10 if fault == "kill" else 20), s0     # the fault's first sign -> next step
    if fault == "freeze":            # the frozen task was SIGKILLed by the loop: blaunch's status says so
        assert s0["rc"] == 137, s0
    st = subprocess.run([sys.executable, "-m", "hpcring", "status", job], env=env, capture_output=True, text=True,
                        timeout=60).stdout
    assert f"job {job}  COMPLETED (DONE)" in st and f"step 0  {first[0]},{bad}  2 ranks  FAILED" in st, st
    assert f"(spare {spare})  2 ranks  COMPLETED" in st and "-> restart 1 of at most 1 on " in st, st
    assert (base / "jobs" / job / "steps" / "0").is_dir()          # the failed step's records kept
    history = [json.loads(x) for x in (base / "jobs" / ".hpcring" / "node-history.jsonl").read_text().splitlines()]
    assert [(h["node"], h["key"]) for h in history] == [(bad, f"lsf-devcluster-lsf-{job}")], history   # the record's key
    batch = (base / "jobs" / job / f"{job}_batch.err").read_text()
    assert "ending the job: bkill" not in text + batch, batch[-3000:]


def test_min_nodes_goes_on_with_fewer_hosts_when_no_spare_is_left_on_lsf(base):
    rc, text, env = submit(base, "--nodes", "2", "--min-nodes", "1", "--max-restarts", "1",
                           script_args=("--steps", "8", "--kill-rank", "1", "--freeze-step", "2"))
    assert rc == 0, text[-5000:]
    job = job_of(text)[0]
    data = steps_of(base, job)
    assert len(data["allocation"]) == 2 and [s["size"] for s in data["steps"]] == [2, 1], data
    res = json.loads((base / "out" / "result.json").read_text())
    assert res["steps"] == 8 and res["requeue_count"] == 1, res     # resumed: steps 2..7 on one rank
    w = np.zeros(8, np.float64)     # steps 0-1 summed over 2 ranks, then over the one left (restart_train's rule)
    for step in range(8):
        w = 0.5 * w + sum(np.arange(8, dtype=np.float32) * (r + 1) + step for r in range(2 if step < 2 else 1))
    assert res["w"] == w.tolist(), (res["w"], w.tolist())
    assert "size=1" in text and f"job {job} COMPLETED" in text, text[-3000:]


def test_a_code_error_is_not_restarted_inside_the_lsf_job(base):
    rc, text, env = submit(base, "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "2",
                           script_args=("--steps", "6", "--fail-step", "2"))
    assert rc == 1, text[-3000:]
    job = job_of(text)[0]
    data = steps_of(base, job)
    assert len(data["steps"]) == 1, data
    s0 = data["steps"][0]
    assert "code error: rank" in s0["end"] and "bad batch at step 2" in s0["end"], s0
    assert s0["decision"] == "not restarted (no node-level fault)", s0
    assert not (base / "jobs" / ".hpcring" / "node-history.jsonl").exists()


def test_preflight_leaves_a_host_on_a_dead_interface_out_on_lsf(base):
    """node2's only configured interface is dead0 (routes nowhere): the gang check, one blaunch -z
    task a host, names it and the script starts on node1 and the spare."""
    rc, text, env = submit(base, "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "1", "--preflight",
                           script_args=("--steps", "4"), env_extra={"HPCRING_PREFLIGHT_IFNAME_FOR": "node2==dead0"})
    assert rc == 0, text[-5000:]
    job = job_of(text)[0]
    data = steps_of(base, job)
    pre = data["preflight"]
    assert list(pre["bad"]) == ["node2"] and "dead0" in pre["bad"]["node2"] and pre["seconds"] <= 30, pre
    assert [s["hosts"] for s in data["steps"]] == [["node1", "node3"]], data
    assert sorted(hosts(base / "out", 0).values()) == ["node1", "node3"]    # the script never ran on node2
