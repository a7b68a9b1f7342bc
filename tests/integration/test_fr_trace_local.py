"""torch's Flight Recorder analyzer on a real hung job: 3 local ranks (ring over loopback and shared
memory, the authenticated store as side channel), one of which never calls allreduce#4 or raises
before it. torchfrtrace, run on the job's ``diag/fr-trace`` as a user would, names the same rank
and op as hpcring's hang report; a rank that raised wrote its dump on the way out and is named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.jobs import diag_folder, hang_report

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "workers" / "fault_worker.py")
ENV = {"HPCRING_TIMEOUT": "5", "HPCRING_DIAG_GRACE": "3", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}

pytest.importorskip("torch.distributed.flight_recorder.fr_trace")


def _job(tmp_path, entry: str, *worker_args) -> str:
    """One 3-rank job of fault_worker.py on this machine, through ``hpcring run`` or ``hpcring
    submit --wait`` (the rank entry that runs the script in its own process); its output."""
    env = {**os.environ, **ENV, "HPCRING_JOB_DIR": str(tmp_path / "jobs"), "HPCRING_STATE_DIR": str(tmp_path / "state")}
    if entry == "run":
        argv = ["run", "--nodes", "1", "--tasks-per-node", "3", "--", sys.executable, WORKER, *worker_args]
    else:
        argv = ["submit", WORKER, "--site", "local", "--nodes", "1", "--tasks-per-node", "3", "--wait", "--",
                *worker_args]
    p = subprocess.run([sys.executable, "-m", "hpcring", *argv], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    return out


def _torchfrtrace(folder: Path) -> str:
    """The analyzer as installed with torch (its console script is `torchfrtrace`)."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_torchfrtrace_and_the_report_name_the_rank_that_never_joined(tmp_path):
    _job(tmp_path, "run", "skip", "1")
    jobs = tmp_path / "jobs"
    rep = hang_report(jobs)
    assert rep["categories"]["missing"] == [1] and rep["op"]["op"] == "allreduce" and rep["op"]["seq"] == 4
    frt = diag_folder(jobs) / "fr-trace"
    assert sorted(p.name for p in frt.iterdir()) == [f"fr_trace_rank_{r}" for r in range(3)]
    out = _torchfrtrace(frt)
    assert "Not all ranks joining collective, sequence number: 4" in out, out
    assert "missing ranks: {1}" in out and "collective: gloo:all_reduce" in out
    assert "fault_worker.py:" in out                                   # the call site, as a frame


@pytest.mark.parametrize("entry", ["run", "submit"])
def test_a_rank_that_raised_leaves_its_dump_and_is_named(tmp_path, entry):
    out = _job(tmp_path, entry, "raise", "1")
    jobs = tmp_path / "jobs"
    rep = hang_report(jobs)
    assert rep["categories"]["exited"] == [1], rep
    assert rep["headline"] == "allreduce#4: rank 1 (local0) raised RuntimeError and exited without joining it"
    assert rep["details"]["1"].startswith("raised RuntimeError: injected fault: rank 1 gives up before allreduce#4 "
                                          "in main at fault_worker.py:")
    assert "RuntimeError: injected fault" in out                       # the script's own traceback is kept
    diag = diag_folder(jobs)
    flight = json.loads((diag / "flight-rank1.json").read_text())     # written by the rank that raised
    assert flight["reason"].startswith("rank 1 raised RuntimeError: injected fault")
    assert [r["seq"] for r in flight["records"]] == [1, 2, 3]
    assert (diag / "stacks-rank1.txt").exists()
    out = _torchfrtrace(diag / "fr-trace")
    assert "Not all ranks joining collective, sequence number: 4" in out and "missing ranks: {1}" in out, out


def test_a_ddp_job_on_gloo_gets_torchs_own_dump_that_torchfrtrace_can_match(tmp_path):
    # torch's own Flight Recorder (the torch watch): its dump as torch writes it, with the process
    # groups that gloo leaves out of pg_config filled in, so torchfrtrace can match the entries
    env = {**os.environ, **ENV, "HPCRING_JOB_DIR": str(tmp_path / "jobs")}
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "3", "--",
                        sys.executable, str(ROOT / "tests" / "workers" / "torch_ddp_worker.py"), "sleep", "2"], env=env,
                       capture_output=True, text=True, timeout=180, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert p.returncode != 0, p.stdout + p.stderr
    rep = hang_report(tmp_path / "jobs")
    assert rep["categories"]["missing"] == [2] and rep["op"]["op"] == "all_reduce"
    out = _torchfrtrace(diag_folder(tmp_path / "jobs") / "fr-trace")
    assert f"Not all ranks joining collective, sequence number: {rep['op']['seq']}" in out, out
    assert "missing ranks: {2}" in out and "collective: gloo:all_reduce" in out
    assert "torch_ddp_worker.py:" in out                               # torch's own Python frames
