"""Hang reports for a plain DDP-on-gloo script (tests/workers/torch_ddp_worker.py, no hpcring import)
under `hpcring run`: 3 real ranks, real torch and gloo over loopback, one rank misbehaves."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "torch_ddp_worker.py")
DEADLINE, GRACE = 4, 3
LINES = Path(WORKER).read_text().splitlines()
SLEEP_AT = f"torch_ddp_worker.py:{next(i for i, ln in enumerate(LINES, 1) if 'time.sleep(3600)' in ln)}"
BACKWARD_AT = f"torch_ddp_worker.py:{next(i for i, ln in enumerate(LINES, 1) if 'loss.backward()' in ln)}"


def run_job(tmp_path, *worker_args, ranks=3, timeout=120):
    env = {**os.environ, "HPCRING_TIMEOUT": str(DEADLINE), "HPCRING_DIAG_GRACE": str(GRACE),
           "HPCRING_JOB_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks), "--",
                        sys.executable, WORKER, *worker_args], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=tmp_path)
    fault = re.search(r"fault=\w+ t=([\d.]+)", p.stdout)
    print(f"fault -> job end {time.time() - float(fault.group(1)) if fault else float('nan'):.1f} s")
    return p, time.time() - float(fault.group(1)) if fault else None   # seconds from the fault to the job's end


from helpers.jobs import diag_folder as diag, hang_report as report  # noqa: E402


def test_ddp_rank_stuck_in_its_data_loader_is_named_with_its_location(tmp_path):
    p, took = run_job(tmp_path, "sleep", "2")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Timed out waiting 4000ms" in out          # torch's gloo timeout followed HPCRING_TIMEOUT
    rep = report(tmp_path)
    assert rep["categories"]["missing"] == [2], rep
    assert rep["categories"]["joined"] == [0, 1], rep
    assert rep["headline"].startswith("all_reduce#") and "rank 2 (local0) never joined" in rep["headline"]
    assert rep["op"]["backend"] == "gloo" and rep["op"]["count"] > 0
    assert f"now in load_batch at {SLEEP_AT}" in rep["details"]["2"]
    assert all(f"in torch backward at {BACKWARD_AT} (main)" in rep["where"][str(r)] for r in (0, 1)), rep["where"]
    assert out.count("COLLECTIVE FAILURE") == 1
    for r in range(3):
        assert f"hpcring: rank {r} (local0): {rep['headline']}; exiting with code 1" in out
        records = json.loads((diag(tmp_path) / f"flight-rank{r}.json").read_text())["records"]
        assert records and all(rec["backend"] == "gloo" for rec in records)
    assert "in load_batch" in (diag(tmp_path) / "stacks-rank2.txt").read_text()
    assert took is not None and took < DEADLINE + 30, (took, out)


def test_ddp_rank_killed_mid_training_is_named_dead(tmp_path):
    p, took = run_job(tmp_path, "kill", "1")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    rep = report(tmp_path)
    assert rep["categories"]["dead"] == [1], rep
    assert "rank 1 (local0) died" in rep["headline"]
    assert not rep["categories"].get("missing"), rep
    # Both survivors print their line. (Until session 11 the supervisor stopped them 1 s after the
    # report appeared counted from rank 1's death, which came seconds before the report: the
    # survivor that heard the report down the tree was often stopped before its line.)
    for r in (0, 2):
        assert f"hpcring: rank {r} (local0): {rep['headline']}; exiting with code 1" in out, out
    assert took is not None and took < DEADLINE + 30, (took, out)


def test_the_monitor_reports_a_collective_past_the_deadline_before_torch_times_out(tmp_path):
    # no backend named: torch may pick NCCL, so its timeout is deadline + grace + 30 s (torch's NCCL
    # watchdog would abort the process at its timeout); hpcring's monitor sees the all_reduce
    # unretired in torch's Flight Recorder at the deadline and starts the report first
    p, took = run_job(tmp_path, "sleep", "0", "--no-backend")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Timed out waiting" not in out
    rep = report(tmp_path)
    assert rep["categories"]["missing"] == [0], rep
    assert "still in flight after" in rep["trigger"]["error"] and "(deadline 4 s)" in rep["trigger"]["error"]
    assert rep["op"]["timeout"] == DEADLINE and rep["op"]["torch_timeout"] == DEADLINE + GRACE + 30
    assert f"now in load_batch at {SLEEP_AT}" in rep["details"]["0"]
    assert took is not None and took < DEADLINE + 30, (took, out)


def test_ddp_rank_stopped_mid_training_is_named_unreachable(tmp_path):
    # SIGSTOP: no snapshot and no reset, peers only time out. The stopped process would outlive
    # the job (ending it is the scheduler's part), so the test kills it once the report is there.
    env = {**os.environ, "HPCRING_TIMEOUT": str(DEADLINE), "HPCRING_DIAG_GRACE": str(GRACE),
           "HPCRING_JOB_DIR": str(tmp_path)}
    log = open(tmp_path / "out.txt", "w+")
    p = subprocess.Popen([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "3", "--",
                          sys.executable, WORKER, "stop", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                         cwd=tmp_path)
    victim = None
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not list(tmp_path.glob("*/diag/hang-report.json")):
            time.sleep(0.2)
        m = re.search(r"fault=stop t=[\d.]+ pid=(\d+)", (tmp_path / "out.txt").read_text())
        victim = int(m.group(1)) if m else None
        rep = report(tmp_path)
        assert rep["categories"].get("unreachable") == [1], rep
        assert "rank 1 (local0) unreachable" in rep["headline"] and "process stopped" in rep["details"]["1"]
        assert rep["categories"]["joined"] == [0, 2], rep
    finally:
        if victim:
            os.kill(victim, signal.SIGKILL)
        p.wait(timeout=60)
    assert p.returncode != 0
