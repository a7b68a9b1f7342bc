"""A representative subset of the fault matrix on this machine (benchmarks/fault_matrix.py runs all
of it and prints the table; tests/devcluster/test_fault_matrix_devcluster.py is the Slurm and LSF
half): a frozen rank (SIGSTOP) ends the local job with the victim named, every rank gone and the
job over within deadline + 30 s, FAILED; a different count or collective under mpirun is named at
once (the signature check); a rank late to its very first collective is "never joined" at the
deadline, like any later one; and nothing outlives ``hpcring run`` or a local cancel."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.faults import DEADLINE, check, fault_matrix

mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
shared = pytest.mark.skipif(not os.access("/srv/hpcring", os.W_OK), reason="/srv/hpcring is not writable")


@shared
def test_local_frozen_rank_ends_the_job():
    res = fault_matrix.run_one("local", "ring", "stop", DEADLINE)
    check(res)
    assert "unreachable" in res.headline and "rank 1" in res.headline
    assert "collective failure: allreduce#4: rank 1 (local0) unreachable" in res.out   # submit --wait


@shared
def test_local_rank_late_to_the_first_collective_is_never_joined_at_the_deadline():
    """The ring connects on the first collective: a peer late to it is that collective's missing
    rank (the watchdog's report, at the deadline), not a bootstrap error at another one."""
    res = fault_matrix.run_one("local", "ring", "late", DEADLINE)
    check(res)
    assert res.headline == "allreduce#1: rank 1 (local0) never joined", res.headline
    assert DEADLINE - 0.5 <= res.dt(res.report_at) <= DEADLINE + 4, res.dt(res.report_at)   # deadline + grace at most
    report = next(res.folder.glob("**/diag/hang-report.txt")).read_text()
    assert "missing   : rank 1 (local0): never joined: last completed #0, now in load_batch" in report, report


@mpi
@shared
@pytest.mark.parametrize("fault,what", [("mismatch", "called it with different arguments"),
                                        ("different", "called a different collective")])
def test_mpirun_mismatch_is_named_at_once(fault, what):
    """Open MPI does not check arguments (a different count corrupted its heap: SIGABRT, no
    report); the signature check names the rank on every rank before MPI sees the call."""
    res = fault_matrix.run_one("local", "mpi", fault, DEADLINE)
    check(res)
    assert res.headline == f"allreduce#4: rank 1 ({os.uname().nodename}) {what}", res.headline
    assert res.dt(res.report_at) < 3.0, res.dt(res.report_at)         # not at the deadline
    assert "double free" not in res.out and "corruption" not in res.out, res.out[-3000:]


def test_a_rank_still_finishing_the_previous_collective_does_not_hide_the_failed_one():
    """Dev cluster, 3x2 ring, count mismatch at #4 (1 of 4 runs): rank 3 was still receiving the
    end of allreduce#3 when the others had failed #4; the report said "allreduce#3: failed (no
    rank is missing or mismatched)". The failed collective is the stuck one."""
    from hpcring.diagnostics import report

    def rec(seq, state, count=65536):
        return {"seq": seq, "op": "allreduce", "dtype": "float32", "count": count, "root": None,
                "backend": "ring", "timeout": 8.0, "site": "w.py:1", "state": state}
    done = [rec(1, "done"), rec(2, "done")]
    snaps = {0: {"records": done + [rec(3, "done"), rec(4, "failed")], "last_done": 3},
             1: {"records": done + [rec(3, "done"), rec(4, "failed", 32768)], "last_done": 3},
             2: {"records": done + [rec(3, "started")], "last_done": 2, "where": "in allreduce at w.py:1"}}
    out = report.diagnose(3, ["n1", "n2", "n3"], snaps, {}, {"rank": 0, "op": rec(4, "failed")})
    assert out.headline == "allreduce#4: rank 1 (n2) called it with different arguments", out.headline
    assert out.details[2].startswith("never joined: still in allreduce#3"), out.details


def test_slurm_teardown_starts_the_kill_without_waiting_for_it(tmp_path, monkeypatch):
    """The reporter's scancel runs in a session of its own and is not waited for; the Comment
    goes first and is waited for (a finished job's Comment cannot be set)."""
    from hpcring.diagnostics import teardown
    log = tmp_path / "calls"
    for name, body in (("scontrol", f'echo "scontrol $*" >> {log}; echo "JobId=7 JobState=RUNNING Restarts=0"'),
                       ("scancel", f'echo "scancel $* sid=$(ps -o sid= -p $$ | tr -d " ") pid=$$" >> {log}; exec sleep 30')):
        f = tmp_path / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    t0 = time.monotonic()
    teardown.end_job(0, "allreduce#4: rank 1 (node2) unreachable", {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})
    assert time.monotonic() - t0 < 3.0                       # the 30 s scancel was not waited for
    deadline = time.monotonic() + 10
    while "scancel" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [ln for ln in log.read_text().splitlines() if not ln.startswith("scontrol -o show job")]
    assert lines[0].startswith("scontrol update JobId=7 Comment=hpcring: allreduce#4"), lines
    assert lines[1].startswith("scancel --signal=KILL 7.0"), lines
    sid, pid = (int(w.split("=")[1]) for w in lines[1].split()[-2:])
    assert sid == pid != os.getsid(0)                          # its own session
    os.kill(pid, signal.SIGKILL)                               # the fake we started


def test_sigkill_of_hpcring_run_leaves_no_rank_and_no_secret(tmp_path):
    marker = f"sleep-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "2", "--",
                          sys.executable, "-c", f"import hpcring, time; hpcring.init(); print('up', flush=True); "
                          f"time.sleep(300)  # {marker}"],
                         env=dict(os.environ, HPCRING_JOB_DIR=str(tmp_path)), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    assert "up" in p.stdout.readline()
    watch = fault_matrix.ProcWatch(marker)
    run_dirs = list(Path("/tmp").glob(f"hpcring-run-{p.pid}-*"))
    assert run_dirs and (run_dirs[0] / "secret.key").exists()
    assert len([q for q in watch.alive() if q != p.pid]) == 4      # 2 x (rank_exec + CMD)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while watch.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.stop()
    assert watch.alive() == [], "ranks outlived a SIGKILLed `hpcring run`"
    assert not run_dirs[0].exists(), "the run folder with the job's secret was left behind"


def test_local_cancel_stops_ranks_that_ignore_sigterm(tmp_path):
    script = tmp_path / "deaf.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('up', flush=True)\ntime.sleep(300)\n")
    env = dict(os.environ, HPCRING_STATE_DIR=str(tmp_path / "state"), HPCRING_JOB_DIR=str(tmp_path / "jobs"))
    r = subprocess.run([sys.executable, "-m", "hpcring", "submit", str(script), "--site", "local", "--nodes", "1",
                        "--tasks-per-node", "2"], env=env, capture_output=True, text=True, timeout=60)
    job = r.stderr.split("Submitted job ")[1].split()[0]
    folder = tmp_path / "jobs" / job
    watch = fault_matrix.ProcWatch(str(folder))
    deadline = time.monotonic() + 60
    while "up" not in "".join(p.read_text() for p in folder.glob("*_log.out")) and time.monotonic() < deadline:
        time.sleep(0.2)
    t0 = time.monotonic()
    c = subprocess.run([sys.executable, "-m", "hpcring", "cancel", job], env=env, capture_output=True, text=True,
                       timeout=60)
    assert c.returncode == 0, c.stderr
    deadline = time.monotonic() + 15
    while watch.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.stop()
    assert watch.alive() == [] and time.monotonic() - t0 < 15
    s = subprocess.run([sys.executable, "-m", "hpcring", "status", job], env=env, capture_output=True, text=True)
    assert f"job {job}  CANCELLED" in s.stdout, s.stdout + s.stderr
    assert not list((tmp_path / "jobs" / ".secrets").glob("*.key"))   # removed when the job ended
