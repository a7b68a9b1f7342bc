"""A run that the scheduler ends (requeue, cancel, time limit) is not a collective failure: the
first rank to see a peer leave asks the scheduler once; when it says the run is over, no rank
reports, writes a failure or cancels the (requeued) job. The scheduler is a fake `scontrol` /
`bjobs` on PATH that answers as Slurm 22.05 and LSF do."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcring import schedulers

ROOT = Path(__file__).resolve().parents[2]


def fake_scontrol(tmp_path: Path, state: str, restarts: int, rc: int = 0, log: Path | None = None) -> dict:
    """``log``: a file each call appends its arguments to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    f = bin_dir / "scontrol"
    f.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {f'echo "$@" >> {log}' if log else ':'}
        [ {rc} -ne 0 ] && {{ echo "slurm_load_jobs error: Invalid job id specified" >&2; exit {rc}; }}
        echo "JobId=$4 JobName=x UserId=root(0) JobState={state} Reason=None Requeue=1 Restarts={restarts} BatchFlag=1"
        """))
    f.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("state,restarts,mine,ending", [
    ("RUNNING", 0, "0", None),
    ("RUNNING", 2, "2", None),
    ("COMPLETING", 1, "0", "requeued"),      # scontrol requeue: this run is over
    ("PENDING", 1, "0", "requeued"),
    ("COMPLETING", 0, "0", "state COMPLETING"),   # scancel, time limit
    ("CANCELLED", 0, "", "state CANCELLED"),
])
def test_slurm_run_ending(tmp_path, monkeypatch, state, restarts, mine, ending):
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, state, restarts)["PATH"])
    env = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": mine}
    got = schedulers.run_ending(env)
    if ending is None:
        assert got is None
    else:
        assert ending in got and "42" in got


def test_unknown_when_the_scheduler_cannot_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, "RUNNING", 0, rc=1)["PATH"])
    assert schedulers.run_ending({"SLURM_JOB_ID": "42"}) is None      # report as before
    assert schedulers.run_ending({}) is None                          # no scheduler at all


_RANKS = r"""
import os, sys, threading, time, types
from hpcring.bootstrap.store_server import StoreServer
from hpcring.diagnostics.watchdog import Watchdog
from hpcring.collectives.recorder import FlightRecorder
SECRET = b"w" * 32
HOSTS = ("nodeA", "nodeB", "nodeC")
with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
    dogs = []
    for r in range(3):
        topo = types.SimpleNamespace(rank=r, size=3, host=HOSTS[r], hosts=HOSTS, interface="eth0")
        dogs.append(Watchdog(topo, ("127.0.0.1", srv.port), SECRET, grace=3.0, abort=True).start())
    rec = FlightRecorder(1, 3, "ring", capacity=8).queue("barrier", "float32", 0, None, 5.0, site="t.py:1")
    dogs[1].trigger("barrier#7 on rank 1: rank 0 (nodeA) exited without joining it", rec.to_dict())
    time.sleep(20)
print("NOT EXITED")
"""


@pytest.mark.parametrize("state,restarts,quiet", [("COMPLETING", 1, True), ("RUNNING", 0, False)])
def test_peers_of_a_requeued_run_exit_quietly(tmp_path, state, restarts, quiet):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_JOB_DIR=str(tmp_path), HPCRING_JOB_ID="77",
               SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0", HPCRING_END_JOB="0",
               **fake_scontrol(tmp_path, state, restarts))
    r = subprocess.run([sys.executable, "-c", _RANKS], capture_output=True, text=True, timeout=90, env=env)
    if quiet:
        assert r.returncode == 143, r.stderr
        assert "Slurm requeued job 77" in r.stderr and "not a collective failure" in r.stderr, r.stderr
        assert "COLLECTIVE FAILURE" not in r.stderr
        assert not (tmp_path / "77" / "diag" / "hang-report.json").exists()
    else:                                   # a running job: the report as before
        assert "COLLECTIVE FAILURE" in r.stderr, r.stderr
        assert "not a collective failure" not in r.stderr


_STORE_GONE = r"""
import os, sys, time, types
from hpcring.bootstrap.store_server import StoreServer
from hpcring.diagnostics.watchdog import Watchdog
from hpcring.collectives.recorder import FlightRecorder
SECRET = b"w" * 32
HOSTS = ("nodeA", "nodeB", "nodeC")
srv = StoreServer("127.0.0.1", 0, secret=SECRET)
dogs = []
for r in (1, 2):
    topo = types.SimpleNamespace(rank=r, size=3, host=HOSTS[r], hosts=HOSTS, interface="eth0")
    dogs.append(Watchdog(topo, ("127.0.0.1", srv.port), SECRET, grace=2.0, abort=True).start())
srv.close()                  # rank 0 left (it ran `scontrol requeue` and returned): its store went with it
rec = FlightRecorder(1, 3, "ring", capacity=8).queue("allreduce", "float32", 8, None, 5.0, site="t.py:1")
dogs[0].trigger("allreduce#8 recv from rank 0 (nodeA) failed: recvmsg(): Connection reset by peer", rec.to_dict())
time.sleep(30)
print("NOT EXITED")
"""


@pytest.mark.parametrize("state,restarts,quiet", [("COMPLETING", 1, True), ("PENDING", 1, True),
                                                  ("CANCELLED", 0, True), ("RUNNING", 0, False)])
def test_a_rank_whose_store_left_with_rank_0_asks_before_it_reports(tmp_path, state, restarts, quiet):
    """Rank 0 requeued its own job and returned: its store is gone, so no root claims the trigger
    or asks Slurm; the rank that saw the reset asks itself (once) before its own-view report."""
    log = tmp_path / "scontrol.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_JOB_DIR=str(tmp_path), HPCRING_JOB_ID="78",
               SLURM_JOB_ID="78", SLURM_RESTART_COUNT="0", HPCRING_END_JOB="0",
               **fake_scontrol(tmp_path, state, restarts, log=log))
    r = subprocess.run([sys.executable, "-c", _STORE_GONE], capture_output=True, text=True, timeout=90, env=env)
    assert "NOT EXITED" not in r.stdout
    asked = log.read_text().splitlines() if log.exists() else []
    if quiet:
        assert r.returncode == 143, r.stderr
        assert "job 78" in r.stderr and "not a collective failure" in r.stderr, r.stderr
        assert "COLLECTIVE FAILURE" not in r.stderr
        assert not (tmp_path / "78" / "diag" / "hang-report.json").exists()
        assert asked == ["-o show job 78"], asked      # one question, from the rank that saw it
    else:                                   # Slurm says the run goes on: rank 0 died, a real failure
        assert r.returncode == 1, r.stderr
        assert "COLLECTIVE FAILURE" in r.stderr and "one rank's view" in r.stderr, r.stderr
        assert "not a collective failure" not in r.stderr
        assert all(a == "-o show job 78" for a in asked) and 1 <= len(asked) <= 2, asked


def test_teardown_leaves_a_run_the_scheduler_ends_alone(tmp_path, monkeypatch, capsys):
    """A rank that fails while Slurm requeues the job does not scancel its step: the next run's
    step has the same id (JOB.0), and a late kill would end that run."""
    from hpcring.diagnostics import teardown
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, "COMPLETING", 1)["PATH"])
    import types
    ran = []
    fake = types.SimpleNamespace(Popen=lambda *a, **k: ran.append(a), run=lambda *a, **k: ran.append(a),
                                 DEVNULL=subprocess.DEVNULL, SubprocessError=subprocess.SubprocessError)
    import hpcring.schedulers as schedulers
    monkeypatch.setattr(schedulers, "subprocess", fake)   # the teardown's own calls only, not the query's
    teardown.end_job(0, "x", {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"})
    assert ran == [] and "Slurm requeued job 9" in capsys.readouterr().err
    monkeypatch.setenv("PATH", fake_scontrol(tmp_path, "RUNNING", 0)["PATH"])
    teardown.end_job(0, "x", {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"})
    assert [a[0][0] for a in ran] == ["scontrol", "scancel"]     # a running job: annotated and ended


def test_a_controller_that_does_not_answer_costs_seconds_not_the_message_timeout(tmp_path, monkeypatch):
    """A node cut off from slurmctld: scontrol would wait Slurm's MessageTimeout and more; the
    question is given up after RUN_ENDING_TIMEOUT and the report goes on as before."""
    import time
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nsleep 60\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    t = time.monotonic()
    assert schedulers.run_ending({"SLURM_JOB_ID": "42"}) is None
    assert time.monotonic() - t < schedulers.RUN_ENDING_TIMEOUT + 2
