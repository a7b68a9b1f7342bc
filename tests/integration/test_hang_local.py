"""The hang watchdog end to end on this machine: `hpcring run` starts 4 real ranks (ring over
loopback TCP, the authenticated store as side channel) and one of them misbehaves."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from helpers.jobs import diag_folder, hang_report  # noqa: E402

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "fault_worker.py")


def run_job(tmp_path, *worker_args, ranks=4, env=None, timeout=90):
    e = {**os.environ, "HPCRING_TIMEOUT": "4", "HPCRING_DIAG_GRACE": "3", "HPCRING_JOB_DIR": str(tmp_path), **(env or {})}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks), "--",
                        sys.executable, WORKER, *worker_args], env=e, capture_output=True, text=True,
                       timeout=timeout, cwd=tmp_path)
    return p, time.monotonic() - t0


diag, report = diag_folder, hang_report


def test_skipped_collective_is_reported_and_every_rank_exits(tmp_path):
    p, took = run_job(tmp_path, "skip", "2")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    rep = report(tmp_path)
    assert rep["categories"]["missing"] == [2]
    assert "never joined" in rep["headline"] and "allreduce#4" in rep["headline"]
    assert "load_batch at fault_worker.py" in rep["details"]["2"]
    assert out.count("COLLECTIVE FAILURE") == 1                     # one rank prints the report
    for r in range(4):                                              # every rank says why it exits
        assert f"hpcring: rank {r} (" in out and "exiting with code 1" in out
    assert "after" not in {line.split("phase=")[-1].split()[0] for line in out.splitlines() if "phase=" in line}
    for r in range(4):
        assert (diag(tmp_path) / f"stacks-rank{r}.txt").read_text().count("File ") >= 1
        assert json.loads((diag(tmp_path) / f"flight-rank{r}.json").read_text())["rank"] == r
    assert took < 4 + 3 + 30


def test_killed_rank_is_reported_dead(tmp_path):
    p, _ = run_job(tmp_path, "kill", "1")
    assert p.returncode != 0
    rep = report(tmp_path)
    assert rep["categories"]["dead"] == [1], rep
    assert "died" in rep["headline"]


def test_raise_mode_keeps_the_process_and_raises_with_the_report(tmp_path):
    p, _ = run_job(tmp_path, "different", "3", env={"HPCRING_ON_FAILURE": "raise"})
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "raising CollectiveError" in out and "exiting with code" not in out
    assert "hpcring.errors.CollectiveError" in out and "called barrier#4" in out
    assert report(tmp_path)["categories"]["different"] == [3]


def test_precheck_catches_a_count_mismatch_without_waiting_for_the_deadline(tmp_path):
    p, took = run_job(tmp_path, "mismatch", "0", env={"HPCRING_CHECK_COLLECTIVES": "1", "HPCRING_TIMEOUT": "60"})
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "pre-collective check" in out and "rank 0 called allreduce#4(count=32768" in out
    assert report(tmp_path)["categories"]["mismatch"] == [0]
    assert took < 60


def test_dump_signal_dumps_flight_records_and_keeps_running_and_sigusr1_stays_free(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(
        "import signal, time, numpy as np, hpcring\n"
        "s = hpcring.init(); c = s.communicator('ring')\n"
        "assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL   # Lightning installs its requeue here\n"
        "c.allreduce(np.ones(4, np.float32)); c.barrier()\n"
        "print('READY', flush=True)\n"
        "time.sleep(3)\n"
        "c.allreduce(np.ones(4, np.float32))\n"
        "print('SURVIVED', flush=True)\n")
    env = {**os.environ, "HPCRING_JOB_DIR": str(tmp_path), "HPCRING_SECRET": os.urandom(16).hex()}
    for var in ("SLURM_JOB_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "LSB_JOBID"):
        env.pop(var, None)
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=tmp_path)
    assert p.stdout.readline().strip() == "READY"
    p.send_signal(signal.SIGRTMIN + 7)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "SURVIVED" in out
    data = json.loads((tmp_path / "0" / "diag" / "flight-rank0.json").read_text())
    assert [r["op"] for r in data["records"]] == ["allreduce", "barrier"]
    assert data["reason"] == "signal SIGRTMIN+7"
