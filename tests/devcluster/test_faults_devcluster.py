"""Fault injection on the real dev cluster (3 nodes x 2 ranks, `hpcring submit --wait`).

Each scenario asserts what the hang report says, that every rank has exited within
deadline + 30 s of the fault, and that Slurm marks the job FAILED. The times from the fault to the
report and to the end of the job are printed (run with -s to see them).
Scenarios 6-8 (bad interface, slow link, a rank that never starts) are in
test_faults_bootstrap_devcluster.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "fault_worker.py"
from helpers.jobs import job_id_of, sacct_state  # noqa: E402


DEADLINE = 8.0
GRACE = 4.0


def run_fault(scenario: str, victim: int, backend: str = "ring", *, during=None, extra=()):
    """Submit fault_worker.py on 3x2 ranks; returns a dict with the report, output, sacct state, times."""
    folder = Path("/srv/hpcring/pytest-faults") / f"{scenario}-{backend}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_TIMEOUT=str(DEADLINE),
               HPCRING_DIAG_GRACE=str(GRACE), HPCRING_JOB_DIR=str(folder),
               HPCRING_STATE_DIR=str(folder / "state"))
    cmd = [sys.executable, "-m", "hpcring", "submit", str(WORKER), "--site", "devcluster", "--nodes", "3",
           "--tasks-per-node", "2", "--time", "5", "--wait", "--", scenario, str(victim), "--backend", backend, *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT),
                         stdin=subprocess.DEVNULL)
    fault_at = {}
    if during is not None:                     # act on the cluster while the job runs
        th = threading.Thread(target=lambda: fault_at.update(t=during(folder)), daemon=True)
        th.start()
    out, err = p.communicate(timeout=240)
    ended = time.time()
    job = job_id_of(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    report_file = folder / job / "diag" / "hang-report.json"     # one diag folder per job
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    text = out + err
    faults = [float(t) for t in re.findall(r"phase=fault t=([\d.]+)", text)]
    fault = fault_at.get("t") or (min(faults) if faults else None)
    state = sacct_state(job)
    res = {"report": report, "out": text, "rc": p.returncode, "state": state, "folder": folder, "job": job,
           "fault": fault, "ended": ended,
           "report_at": report_file.stat().st_mtime if report_file.exists() else None}
    if fault:
        print(f"\n[{scenario}/{backend}] fault -> report {res['report_at'] - fault if res['report_at'] else float('nan'):.1f} s, "
              f"fault -> job end seen by the submitter {ended - fault:.1f} s (deadline {DEADLINE:g} s, grace {GRACE:g} s)")
    return res


def check_common(res, *, allow_dead_rank: int | None = None):
    assert res["rc"] != 0, res["out"][-3000:]
    assert res["state"] == "FAILED", (res["state"], res["out"][-3000:])
    assert res["fault"] is not None
    assert res["ended"] - res["fault"] < DEADLINE + 30, res["out"][-3000:]
    exits = set(int(r) for r in re.findall(r"hpcring: rank (\d+) \([^)]*\): .*; exiting with code 1", res["out"]))
    expected = set(range(6)) - ({allow_dead_rank} if allow_dead_rank is not None else set())
    assert exits >= expected, (exits, res["out"][-3000:])


def test_1_skipped_collective_names_the_missing_rank():
    res = run_fault("skip", 5)
    check_common(res)
    rep = res["report"]
    assert rep["categories"]["missing"] == [5], rep
    assert rep["headline"] == "allreduce#4: rank 5 (node3) never joined"
    assert "collective failure: allreduce#4: rank 5 (node3) never joined" in res["out"]   # submit --wait
    assert "load_batch at fault_worker.py" in rep["details"]["5"]
    assert rep["categories"]["joined"] == [0, 1, 2, 3, 4]


def test_2_different_collective():
    res = run_fault("different", 2)
    check_common(res)
    rep = res["report"]
    assert rep["categories"]["different"] == [2], rep
    assert "called barrier#4" in rep["details"]["2"]


def test_3_count_and_dtype_mismatch():
    res = run_fault("mismatch", 4)
    check_common(res)
    rep = res["report"]
    assert rep["categories"]["mismatch"] == [4], rep
    assert "count=32768 (others 65536)" in rep["details"]["4"]
    res = run_fault("dtype", 1)
    check_common(res)
    assert "dtype=float64 (others float32)" in res["report"]["details"]["1"]


def test_4_sigkilled_rank_is_dead():
    res = run_fault("kill", 3)
    check_common(res, allow_dead_rank=3)
    rep = res["report"]
    assert rep["categories"]["dead"] == [3], rep
    assert rep["headline"] == "allreduce#4: rank 3 (node2) died"


def test_5_cut_link_names_the_unreachable_host():
    def cut(folder):
        # wait until every rank is looping over large allreduces, then take node2's link down
        deadline, seen = time.time() + 120, False
        while time.time() < deadline and not seen:     # the logs are in the job's own folder below
            logs = "".join(p.read_text(errors="replace") for p in folder.rglob("*_log.out"))
            seen = logs.count("phase=looping") >= 6
            time.sleep(0.2)
        time.sleep(1.0)
        t = time.time() if seen else None    # not seen: still cut (the job ends) but the test fails
        subprocess.run(["ip", "link", "set", "hpcv-node2", "down"], check=True)
        # Keep it cut until node2's ranks had to give up (deadline + store timeout + grace), then
        # heal it so that slurmd can report the step: a link that stays down is a NODE_FAIL.
        time.sleep(DEADLINE + 5 + GRACE + 4)
        subprocess.run(["ip", "link", "set", "hpcv-node2", "up"], check=True)
        return t
    try:
        res = run_fault("cut", -1, during=cut)
    finally:
        subprocess.run(["ip", "link", "set", "hpcv-node2", "up"], check=False)
    check_common(res)
    rep = res["report"]
    assert rep["categories"]["unreachable"] == [2, 3], rep
    assert "ranks 2-3 (node2) unreachable" in rep["headline"]
    # ranks on node2 cannot reach the side channel: they print their own view and exit too
    assert "one rank's view" in res["out"]


mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")


@mpi
def test_1_mpi_skipped_collective():
    res = run_fault("skip", 5, "mpi")
    check_common(res)
    assert res["report"]["categories"]["missing"] == [5], res["report"]
    assert res["report"]["op"]["backend"] == "mpi"


@mpi
def test_2_mpi_different_collective():
    res = run_fault("different", 2, "mpi")
    check_common(res)
    assert res["report"]["categories"]["different"] == [2], res["report"]


@mpi
def test_4_mpi_sigkilled_rank_is_dead():
    # Slurm's PMIx plugin cancels the whole step as soon as one MPI process dies (its error
    # handler runs in slurmstepd), before any watchdog could: the diagnosis is then srun's own
    # line, which `hpcring submit --wait` turns into the job's error.
    res = run_fault("kill", 3, "mpi")
    assert res["rc"] != 0 and res["state"] == "FAILED", res["out"][-3000:]
    assert res["ended"] - res["fault"] < DEADLINE + 30
    rep = res["report"]
    if rep is None:
        assert "rank 3 (node2) was killed first (srun: Killed)" in res["out"], res["out"][-3000:]
    else:
        assert 3 in rep["categories"].get("dead", []) + rep["categories"].get("unreachable", []), rep
