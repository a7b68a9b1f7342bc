"""Restarts inside the allocation, end to end (hpcring.steps; README "When a node fails").

On the real dev cluster (3 nodes): a 2-node job with 1 spare node (`--spare-nodes 1
--max-restarts 1`, no --wait needed) whose rank 1 is SIGKILLed (its node lost) or frozen (SIGSTOP)
at step 3 goes on in the same allocation on the surviving node and the spare: one job, COMPLETED,
the restarted step resumes from the checkpoint (HPCRING_RESTART_COUNT 1) and ends with the weights
of an uninterrupted run; `hpcring status` shows the steps, the blamed node and the spare; the node
history records the blame. `--preflight` leaves a node whose interface routes nowhere out before the
script starts, the spare taking its place. `--min-nodes 1` with no spare goes on with one node (the world shrinks
to one rank). A code error is not restarted.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "tests" / "workers" / "restart_train.py"



def submit(tag: str, *flags: str, script_args=(), timeout_s: int = 8, env_extra=None):
    """`hpcring submit --wait` of restart_train.py in a fresh shared folder; (rc, text, env, out, base)."""
    base = Path("/srv/hpcring/pytest-steps") / f"{tag}-{uuid.uuid4().hex[:8]}"
    out = base / "out"
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(base / "state"),
               HPCRING_JOB_DIR=str(base / "jobs"), HPCRING_TIMEOUT=str(timeout_s), **(env_extra or {}))
    env.pop("HPCRING_MAX_RESTARTS", None)
    cmd = [sys.executable, "-m", "hpcring", "submit", str(TRAIN), "--site", "devcluster", "--tasks-per-node", "1",
           "--time", "5", "--wait", *flags, "--", str(out), *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                       timeout=420)
    (base / "submit.log").write_text(p.stdout + p.stderr)
    return p.returncode, p.stdout + p.stderr, env, out, base


def job_of(text: str) -> list[str]:
    return re.findall(r"Submitted job (\S+)", text)


def hosts(out: Path, attempt: int) -> dict[int, str]:
    return {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in out.glob(f"hosts-{attempt}-*")}


def steps_of(base: Path, job: str) -> dict:
    return json.loads((base / "jobs" / job / "steps.json").read_text())


def status(env, job: str) -> str:
    return subprocess.run([sys.executable, "-m", "hpcring", "status", job], env=env, capture_output=True,
                          text=True, timeout=60).stdout


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_lost_node_is_replaced_by_the_spare_in_the_same_allocation(fault):
    rc, text, env, out, base = submit(fault, "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "1",
                                      script_args=("--steps", "10", f"--{fault}-rank", "1", "--freeze-step", "3"))
    assert rc == 0, text[-5000:]
    jobs = job_of(text)
    assert len(jobs) == 1, text[-3000:]                   # no resubmission: the same allocation
    job = jobs[0]
    first, again = hosts(out, 0), hosts(out, 1)
    bad = first[1]
    assert len(again) == 2 and bad not in again.values() and again[0] == first[0], (first, again)
    res = json.loads((out / "result.json").read_text())
    assert res["w"] == res["expected"] and res["requeue_count"] == 1 and res["attempt"] == 1, res
    data = steps_of(base, job)
    s0, s1 = data["steps"]
    assert s0["hosts"] == [first[0], bad] and list(s0["blamed"]) == [bad], s0
    spare = (set(data["allocation"]) - {first[0], bad}).pop()
    assert s1["spares"] == [spare] and s1["end"] == "COMPLETED" and s1["size"] == 2, s1
    # a killed rank: the survivors' report names it dead (the ring, the site's backend since auto
    # picks the ring on a TCP fabric, sees the connection close at once); a report later than the
    # step's end leaves it to srun's line. A frozen one: only the report can tell.
    whys = ("dead (rank 1)", "lost (task 1 killed; srun)") if fault == "kill" else ("unreachable (rank 1)",)
    assert any(why in s0["blamed"][bad] for why in whys), s0
    assert 0 < s0["lost_s"] < (10 if fault == "kill" else 20), s0     # the fault's first sign -> next step
    st = status(env, job)
    assert f"step 0  {first[0]},{bad}  2 ranks  FAILED" in st and f"-> restart 1 of at most 1 on " in st, st
    assert f"(spare {spare})  2 ranks  COMPLETED" in st, st
    history = (base / "jobs" / ".hpcring" / "node-history.jsonl").read_text().splitlines()
    assert [json.loads(x)["node"] for x in history] == [bad], history
    assert (base / "jobs" / job / "steps" / "0").is_dir()          # the failed step's records kept


def test_min_nodes_goes_on_with_fewer_nodes_when_no_spare_is_left():
    rc, text, env, out, base = submit("shrink", "--nodes", "2", "--min-nodes", "1", "--max-restarts", "1",
                                      script_args=("--steps", "8", "--kill-rank", "1", "--freeze-step", "2"))
    assert rc == 0, text[-5000:]
    job = job_of(text)[0]
    data = steps_of(base, job)
    assert [s["size"] for s in data["steps"]] == [2, 1], data
    assert "the world shrinks to 1 ranks" in text or "world shrinks" in (base / "jobs" / job / f"{job}_0_log.err").read_text()
    res = json.loads((out / "result.json").read_text())
    assert res["steps"] == 8 and res["requeue_count"] == 1, res
    assert "size=1" in text, text[-3000:]
    assert f"job {job} COMPLETED" in text, text[-2000:]


def test_a_code_error_is_not_restarted_inside_the_allocation():
    rc, text, env, out, base = submit("code", "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "2",
                                      script_args=("--steps", "6", "--fail-step", "2"))
    assert rc == 1, text[-3000:]
    job = job_of(text)[0]
    data = steps_of(base, job)
    assert len(data["steps"]) == 1, data
    s0 = data["steps"][0]
    assert "code error: rank" in s0["end"] and "bad batch at step 2" in s0["end"], s0
    assert s0["decision"] == "not restarted (no node-level fault)", s0
    assert not (base / "jobs" / ".hpcring" / "node-history.jsonl").exists()


def test_preflight_leaves_a_node_on_a_dead_interface_out_before_the_script():
    """node2's only configured interface is dead0 (routes nowhere): the gang check names it within
    30 s and the script starts on node1 and the spare."""
    rc, text, env, out, base = submit("preflight", "--nodes", "2", "--spare-nodes", "1", "--max-restarts", "1",
                                      "--preflight", script_args=("--steps", "4"),
                                      env_extra={"HPCRING_PREFLIGHT_IFNAME_FOR": "node2==dead0"})
    assert rc == 0, text[-5000:]
    job = job_of(text)[0]
    data = steps_of(base, job)
    pre = data["preflight"]
    assert list(pre["bad"]) == ["node2"] and "dead0" in pre["bad"]["node2"] and pre["seconds"] <= 30, pre
    assert [s["hosts"] for s in data["steps"]] == [["node1", "node3"]], data
    assert sorted(hosts(out, 0).values()) == ["node1", "node3"]          # the script never ran on node2
    st = status(env, job)
    assert "preflight  " in st and "left out node2 (nobody could connect to it on dead0" in st, st
    rec = json.loads((base / "jobs" / ".hpcring" / "node-history.jsonl").read_text().splitlines()[0])
    assert rec["node"] == "node2" and rec["reason"].startswith("preflight: ") and rec["cause"] == "preflight", rec

