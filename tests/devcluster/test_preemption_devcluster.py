"""Preemption and time limits end to end: tests/workers/preempt_train.py checkpoints on the scheduler's
warning (or every step, for an unannounced requeue), is requeued, resumes and ends with the same
weights as an uninterrupted run; a script that ignores the warning ends TIMEOUT, not FAILED.

Slurm (dev cluster): a real time limit (--time 2 with the site's --signal=USR2@60) and
`scontrol requeue`. Slurm holds a requeued job for cred_expire (120 s) before it may start again;
the tests release their own job at once (`scontrol update JobId=N StartTime=now`). LSF: the
emulation's -W/-wa/-wt, with its minute shortened (HPCRING_LSF_EMU_MINUTE_S). The two tests
that wait for a real Slurm time limit (1-2 min each) run with HPCRING_SLOW_TESTS=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "tests" / "workers" / "preempt_train.py"
EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"

slow = pytest.mark.skipif(os.environ.get("HPCRING_SLOW_TESTS") != "1",
                          reason="waits for a real Slurm time limit (1-2 min): set HPCRING_SLOW_TESTS=1")


def expected(steps: int, size: int = 3) -> list[float]:
    """The uninterrupted run's weights (what preempt_train.py computes without any interruption)."""
    w = np.zeros(8)
    for s in range(steps):
        w = 0.5 * w + (np.arange(8, dtype=np.float32) * sum(range(1, size + 1)) + size * s).astype(np.float64)
    return w.tolist()


def submit(site: str, steps: int, sleep: float, time_arg: str, env_extra=None, script_args=(), during=None):
    folder = Path("/srv/hpcring/pytest-preempt") / uuid.uuid4().hex[:8]
    (folder / "out").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(folder / "state"),
               HPCRING_JOB_DIR=str(folder), **(env_extra or {}))
    cmd = [sys.executable, "-m", "hpcring", "submit", str(TRAIN), "--site", site, "--nodes", "3",
           "--tasks-per-node", "1", "--time", time_arg, "--wait", "--", str(folder / "out"), "--steps", str(steps),
           "--sleep", str(sleep), *script_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         stdin=subprocess.DEVNULL, cwd=str(ROOT))
    first = p.stdout.readline()
    job = first.split("Submitted job ")[1].split()[0] if "Submitted job" in first else ""
    stop = threading.Event()
    if site == "devcluster" and job:
        threading.Thread(target=_release_when_requeued, args=(job, stop), daemon=True).start()
    if during is not None:
        threading.Thread(target=during, args=(job, folder), daemon=True).start()
    out, _ = p.communicate(timeout=400)
    stop.set()
    status = subprocess.run([sys.executable, "-m", "hpcring", "status", job], env=env, capture_output=True,
                            text=True, timeout=60).stdout
    result = folder / "out" / "result.json"
    return {"rc": p.returncode, "out": first + out, "job": job, "folder": folder, "status": status,
            "result": json.loads(result.read_text()) if result.exists() else None}


def _release_when_requeued(job: str, stop: threading.Event) -> None:
    while not stop.is_set():
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True, timeout=30)
        if "BeginTime" in r.stdout:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True, timeout=30)
        time.sleep(1)


def check_resumed(res, steps: int) -> None:
    assert res["rc"] == 0, res["out"][-4000:]
    assert res["result"] is not None, res["out"][-4000:]
    assert res["result"]["steps"] == steps
    assert res["result"]["w"] == pytest.approx(expected(steps)), res["result"]
    assert res["result"]["requeues"] >= 1
    assert f"requeued {res['result']['requeues']}" in res["status"], res["status"]
    assert "COMPLETED" in res["status"]


def test_lsf_warning_checkpoint_requeue_resume():
    emu = Path("/srv/hpcring") / f".lsf-emulation-preempt-{os.getpid()}"
    # -W 2 / -wt 1 (site devcluster-lsf) with 12 s minutes: warned 12 s into each 24 s run
    res = submit("devcluster-lsf", 40, 0.5, "2", env_extra={
        "PATH": f"{EMU_BIN}:{os.environ['PATH']}", "HPCRING_LSF_EMU_DIR": str(emu), "HPCRING_LSF_EMU_MINUTE_S": "12"})
    check_resumed(res, 40)
    assert "warned by SIGUSR2" in res["out"] and "requeueing the job" in res["out"]


def test_slurm_scontrol_requeue_resumes_from_the_checkpoint():

    def requeue(job, folder):
        deadline = time.time() + 120
        while time.time() < deadline:      # a few steps in, then the unannounced requeue
            logs = "".join(p.read_text(errors="replace") for p in folder.glob("*/*_0_log.out"))
            if (folder / "out" / "ckpt.npz").exists() and "start step=0" in logs:
                time.sleep(3)
                subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
                return
            time.sleep(0.3)
    res = submit("devcluster", 30, 0.5, "5", during=requeue)
    check_resumed(res, 30)
    assert "requeues=1" in res["out"] and "start step=0 requeues=0" in res["out"]
    resumed = [line for line in res["out"].splitlines() if "requeues=1" in line]
    assert all("start step=0 " not in line for line in resumed), resumed   # it resumed, it did not restart


def test_slurm_job_that_requeues_itself_resumes_twice_and_finishes():
    """Rank 0 runs `scontrol requeue` and returns 0 (Lightning's auto-requeue does this): the
    job's secret must survive the run's end, the peers it left mid-collective must not report a
    collective failure or cancel the requeued job, and the job resumes twice and finishes."""
    res = submit("devcluster", 14, 0.3, "5", script_args=("--self-requeue", "2"))
    check_resumed(res, 14)
    assert res["result"]["requeues"] == 2, res["result"]
    assert "requeues=2" in res["out"], res["out"][-3000:]
    assert "cannot read secret file" not in res["out"]
    assert "COLLECTIVE FAILURE" not in res["out"] and "ending the job" not in res["out"], res["out"][-3000:]


LIGHTNING = ROOT / "tests" / "workers" / "lightning_requeue.py"


def _warn_batch_twice(job, folder):
    """Stand-in for Slurm's --signal timer (its resolution is a minute): the batch shell gets the
    job's warning signal, as Slurm sends it (B:), once a run is training, in two runs."""
    warned = 0
    deadline = time.time() + 300
    while warned < 2 and time.time() < deadline:
        logs = "".join(p.read_text(errors="replace") for p in folder.glob("*/*_0_log.out"))
        if logs.count("LREQ rank=0 start") > warned:
            time.sleep(3)
            subprocess.run(["scancel", "--batch", "--signal=USR1", job], timeout=30)
            warned += 1
        time.sleep(0.5)


def test_lightning_auto_requeue_and_the_hpcring_warning_from_one_job():
    """Lightning's documented `--signal=SIGUSR1@90` beside the site's USR2@60: Slurm keeps one
    --signal, so hpcring's job script takes the warning in the batch shell and hands every rank
    both signals. Lightning saves and requeues on USR1 (twice), hpcring notes its USR2 warning,
    and the job resumes from Lightning's checkpoint and finishes."""
    folder = Path("/srv/hpcring/pytest-preempt") / uuid.uuid4().hex[:8]
    (folder / "out").mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(folder / "state"),
               HPCRING_JOB_DIR=str(folder))
    cmd = [sys.executable, "-m", "hpcring", "submit", str(LIGHTNING), "--site", "devcluster", "--nodes", "2",
           "--time", "5", "--sched-arg=--signal=SIGUSR1@90", "--wait", "--", str(folder / "out")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         stdin=subprocess.DEVNULL, cwd=str(ROOT))
    first = ""
    while "Submitted job " not in first and p.poll() is None:     # the signal note comes first
        first += p.stdout.readline()
    assert "Slurm keeps one --signal per job" in first, first
    job = first.split("Submitted job ")[1].split()[0]
    stop = threading.Event()
    threading.Thread(target=_release_when_requeued, args=(job, stop), daemon=True).start()
    threading.Thread(target=_warn_batch_twice, args=(job, folder), daemon=True).start()
    try:
        out, _ = p.communicate(timeout=400)
    finally:
        stop.set()
        if p.poll() is None:
            p.kill()
            subprocess.run(["scancel", job], timeout=30)
    out = first + out
    assert p.returncode == 0, out[-4000:]
    result = json.loads((folder / "out" / "result.json").read_text())
    assert result == {"steps": 60, "restarts": 2}, result
    assert out.count("Handling auto-requeue signal") >= 2, out[-4000:]
    assert "restarts=2" in out and "start step=0 restarts=2" not in out, out[-4000:]   # it resumed
    assert list(folder.glob("*/*_preempt.json")), "hpcring's own warning was not delivered"
    assert "COLLECTIVE FAILURE" not in out and "cannot read secret file" not in out


@slow
def test_slurm_time_limit_checkpoint_requeue_resume():
    # --time 2 and the site's USR2@60: warned 0-60 s before the limit (Slurm's resolution); the
    # 60 x 1.5 s of work cannot fit in one run
    res = submit("devcluster", 60, 1.5, "2")
    check_resumed(res, 60)
    assert "warned by SIGUSR2" in res["out"]


@slow
def test_slurm_script_that_ignores_the_warning_ends_timeout():
    res = submit("devcluster", 200, 1.0, "1", script_args=("--ignore-warning",))
    assert res["rc"] != 0
    assert "TIMEOUT: the job reached its time limit after the SIGUSR2 warning" in res["out"], res["out"][-3000:]
    assert "collective failure" not in res["out"]
    assert "TIMEOUT" in res["status"]
