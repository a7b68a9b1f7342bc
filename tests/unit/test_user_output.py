"""What a user sees when a job fails or is followed: exit codes that are the rank's own, the
script's traceback once and without hpcring's/submitit's frames, srun's lines tagged as srun's,
state lines after the output they follow, and a verdict that cites only the latest run's report."""
from __future__ import annotations

import io
import json
import os
import sys
import time

import pytest

from hpcring import jobfollow, jobstatus
from hpcring.fsutil import write_json
from hpcring.outcome import Outcome
from hpcring.schedulers import slurm
from hpcring.schedulers.base import JobRecord, JobState, new_record


def fake_sacct(tmp_path, line: str, squeue: str = "") -> dict:
    """PATH with a `sacct` printing ``line`` (its fields as the caller asks for them) for any job,
    and a `squeue` printing ``squeue`` (%i|%T|%N; nothing: the job is not in squeue)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, out in (("sacct", line), ("squeue", squeue)):
        (bin_dir / name).write_text(f"#!/bin/sh\nprintf '%s' '{out}'\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("state,field,code", [
    ("RUNNING", "0:0", None), ("PENDING", "0:0", None), ("TIMEOUT", "0:0", None),
    ("CANCELLED by 0", "0:15", 143), ("FAILED", "9:0", 9), ("FAILED", "3:0", 3), ("COMPLETED", "0:0", 0),
])
def test_slurm_exit_code_from_sacct(tmp_path, monkeypatch, state, field, code):
    for k, v in fake_sacct(tmp_path, f"41|{state}|{field}|node1").items():
        monkeypatch.setenv(k, v)
    st = slurm.state("41")
    assert (st.state, st.exit_code) == (state.split()[0], code)


def test_slurm_state_of_a_live_job_is_squeues(tmp_path, monkeypatch):
    """Accounting lags: sacct still says PENDING while the ranks run; squeue knows."""
    for k, v in fake_sacct(tmp_path, "44|PENDING|0:0|None assigned", squeue="44|RUNNING|node[1-2]").items():
        monkeypatch.setenv(k, v)
    assert slurm.state("44") == JobState("RUNNING", "RUNNING", None, "node[1-2]")
    for k, v in fake_sacct(tmp_path, "44|FAILED|3:0|node[1-2]", squeue="44|COMPLETING|node[1-2]").items():
        monkeypatch.setenv(k, v)
    assert slurm.state("44") == JobState("FAILED", "FAILED", 3, "node[1-2]")     # over: sacct's word


def test_status_shows_the_failing_ranks_exit_code_not_the_teardowns(cli, tmp_path, state_dir):
    """On Slurm the failing rank ends the step with SIGKILL: sacct says 9:0; the rank exited 3."""
    new_record("42", "slurm", "dev", str(tmp_path), 2, "exit3", "/x/exit3.py", cluster="dev")
    write_json(tmp_path / "42_1_status.json", {"rank": 1, "host": "node2", "exit_code": 3, "error": None,
                                               "ended": time.time()})
    r = cli("status", "42", env=fake_sacct(tmp_path, "42|FAILED|9:0|node[1-2]"))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == "job 42  FAILED  exit 3"
    assert "rank 1 on node2: exited with code 3" in r.stdout


@pytest.mark.parametrize("line", ["43|RUNNING|0:0|node1", "43|TIMEOUT|0:0|node1"])
def test_status_shows_no_exit_code_where_there_is_none(cli, tmp_path, state_dir, line):
    new_record("43", "slurm", "dev", str(tmp_path), 1, "sleep", "/x/sleep.py", cluster="dev")
    r = cli("status", "43", env=fake_sacct(tmp_path, line))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == f"job 43  {line.split('|')[1]}", r.stdout


def test_local_timeout_hint_offers_no_requeue(tmp_path, state_dir):
    rec = JobRecord("8", "local", "local", str(tmp_path), 1, "sleep", "/x/sleep.py", 0.0)
    err = jobstatus.describe_failure(rec, Outcome(JobState("TIMEOUT", "TIMEOUT", 143), [], [0]))
    assert "requeue" in err.hint and "neither warns nor requeues" in err.hint and "--time" in err.hint
    rec = JobRecord("8", "slurm", "dev", str(tmp_path), 1, "sleep", "/x/sleep.py", 0.0, "dev")
    err = jobstatus.describe_failure(rec, Outcome(JobState("TIMEOUT", "TIMEOUT", None), [], [0]))
    assert "checkpoint on the warning" in err.hint


def test_a_hang_report_of_an_earlier_run_is_not_the_cause(tmp_path, state_dir, monkeypatch):
    """A requeued job keeps its folder: a report written before the latest run started (rank 0
    writes the requeue count at each start) is not why that run was cancelled."""
    rec = JobRecord("9", "local", "local", str(tmp_path), 2, "train", "t.py", 0.0)
    diag = tmp_path / "diag"
    diag.mkdir()
    report = diag / "hang-report.json"
    report.write_text(json.dumps({"headline": "allreduce#3: rank 1 (node2) never joined"}))
    write_json(tmp_path / "9_requeues.json", {"count": 1})
    old = time.time() - 600
    os.utime(report, (old, old))
    cancelled = Outcome(JobState("CANCELLED", "CANCELLED by 0", None), [], [0, 1])
    assert "allreduce" not in str(jobstatus.describe_failure(rec, cancelled))
    assert jobstatus.hang_headline(rec) is None
    now = time.time() + 1
    os.utime(report, (now, now))                  # this run's own report: cited
    assert "collective failure: allreduce#3" in str(jobstatus.describe_failure(rec, cancelled))


def test_a_requeued_job_cancelled_before_it_ran_again_cites_no_report(tmp_path, state_dir, monkeypatch):
    """Requeued, then cancelled while pending: no rank started again, but Slurm's Submit time
    (reset by the requeue) is after the report of the run before."""
    rec = JobRecord("19", "slurm", "dev", str(tmp_path), 2, "train", "t.py", 0.0, "dev")
    write_json(tmp_path / "19_requeues.json", {"count": 0})
    (tmp_path / "diag").mkdir()
    report = tmp_path / "diag" / "hang-report.json"
    report.write_text(json.dumps({"headline": "allreduce#3: rank 1 (node2) never joined"}))
    then = time.time() - 120
    os.utime(report, (then, then))
    os.utime(tmp_path / "19_requeues.json", (then - 60, then - 60))
    requeued = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(then + 30))
    for k, v in fake_sacct(tmp_path, f"19|{requeued}").items():
        monkeypatch.setenv(k, v)
    assert slurm.queued_at("19") == pytest.approx(then + 30, abs=1)
    cancelled = Outcome(JobState("CANCELLED", "CANCELLED by 0", None), [], [0, 1])
    assert "allreduce" not in str(jobstatus.describe_failure(rec, cancelled))
    requeued = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(then - 30))   # never requeued
    for k, v in fake_sacct(tmp_path, f"19|{requeued}").items():
        monkeypatch.setenv(k, v)
    assert "collective failure: allreduce#3" in str(jobstatus.describe_failure(rec, cancelled))


def test_slurms_own_lines_are_not_tagged_as_a_ranks(tmp_path):
    rec = JobRecord("5", "slurm", "dev", str(tmp_path), 2, "j", "j.py", 0.0, "dev")
    (tmp_path / "5_0_log.err").write_text("rank0 says\nsrun: error: node2: task 1: Killed\n")
    (tmp_path / "5_1_log.err").write_text("srun: not srun's: rank 1 printed this\n"
                                          "slurmstepd-node2: error: *** STEP 5.0 ON node2 CANCELLED ***\n")
    lines = [jobfollow.tag(*x) for x in jobfollow.LogTail(rec).poll(final=True)]
    assert lines == ["[0]<stderr>:rank0 says", "[slurm]<stderr>:srun: error: node2: task 1: Killed",
                     "[1]<stderr>:srun: not srun's: rank 1 printed this",
                     "[slurm]<stderr>:slurmstepd-node2: error: *** STEP 5.0 ON node2 CANCELLED ***"]


def test_follow_prints_the_end_state_after_the_last_output(tmp_path, state_dir, monkeypatch):
    rec = JobRecord("6", "local", "local", str(tmp_path), 1, "j", "j.py", 0.0)
    log = tmp_path / "6_0_log.out"
    states = iter(["RUNNING", "FAILED"])

    def state(_rec):
        st = next(states)
        if st == "FAILED":             # the job printed its last line, then ended
            log.write_text("last words\n")
        return JobState(st, st, None if st == "RUNNING" else 1)

    monkeypatch.setattr(jobfollow, "job_state", state)
    events = []
    jobfollow.follow(rec, on_state=lambda st: events.append(st.state), on_line=lambda *x: events.append(x[2]),
                     poll_s=0.01)
    assert events == ["RUNNING", "last words", "FAILED"]


def test_a_traceback_every_rank_printed_is_shown_once():
    tb = ["Traceback (most recent call last):", '  File "/x/t.py", line 3, in <module>', "    f()",
          "RuntimeError: every rank"]
    out = []
    sink = jobfollow.SameTracebackOnce(lambda r, s, line: out.append(jobfollow.tag(r, s, line)))
    for rank in (0, 1):
        sink(rank, "stdout", "step 1")
        for line in tb:
            sink(rank, "stderr", line)
    sink(2, "stderr", tb[0])
    sink(2, "stderr", tb[1])
    sink(2, "stderr", "    g()")
    sink(2, "stderr", "RuntimeError: rank 2's own")     # not the same: shown in full
    sink(0, "stderr", tb[0])                            # rank 0 again: its own repeat is shown
    for line in tb[1:]:
        sink(0, "stderr", line)
    sink(3, "stderr", tb[0])                            # cut short by a kill: shown at the end
    sink.flush()
    assert out == (["[0]<stdout>:step 1"] + [f"[0]<stderr>:{ln}" for ln in tb]
                   + ["[1]<stdout>:step 1",
                      "[1]<stderr>:Traceback: the same as rank 0's (RuntimeError: every rank)"]
                   + [f"[2]<stderr>:{ln}" for ln in tb[:2] + ["    g()", "RuntimeError: rank 2's own"]]
                   + [f"[0]<stderr>:{ln}" for ln in tb] + [f"[3]<stderr>:{tb[0]}"])


def _failed_local_job(tmp_path, job_id="7"):
    (tmp_path / f"{job_id}_local.json").write_text(json.dumps({"state": "FAILED", "pid": 0, "exit_code": 3}))
    (tmp_path / f"{job_id}_1_log.err").write_text("oops\n")
    write_json(tmp_path / f"{job_id}_1_status.json", {"rank": 1, "host": "local1", "exit_code": 3, "error": None,
                                                      "ended": time.time()})
    write_json(tmp_path / f"{job_id}_0_status.json", {"rank": 0, "host": "local0", "exit_code": 0, "error": None,
                                                      "ended": time.time()})
    return new_record(job_id, "local", "local", str(tmp_path), 2, "exit3", "/x/exit3.py")


def test_logs_follow_exits_with_the_failing_ranks_code(cli, tmp_path, state_dir):
    _failed_local_job(tmp_path)
    r = cli("logs", "7", "--follow")
    assert r.exit_code == 3, r.output
    assert "[1]<stderr>:oops" in r.stdout
    assert "error: job 7 (exit3) FAILED: rank 1 on local1: exited with code 3" in r.stderr


# ---- inside the rank: the script's traceback, as `python script.py` prints it ---------------

def _run_as_main(tmp_path, code: str):
    from hpcring.job import run_as_main
    script = tmp_path / "user_script.py"
    script.write_text(code)
    err, old_argv, old_path = io.StringIO(), sys.argv, list(sys.path)
    old_err, sys.stderr = sys.stderr, err
    try:
        result = run_as_main(str(script), [])
    finally:
        sys.stderr, sys.argv, sys.path[:] = old_err, old_argv, old_path
    return result, err.getvalue()


def test_the_scripts_traceback_has_only_its_own_frames(tmp_path):
    (code, error), err = _run_as_main(tmp_path, "def f():\n    raise ValueError('boom')\n\ndef g():\n    f()\n\ng()\n")
    assert (code, error) == (1, "ValueError: boom")
    assert err.count("Traceback (most recent call last):") == 1
    frames = [ln for ln in err.splitlines() if ln.startswith("  File ")]
    assert [f.split(", in ")[1] for f in frames] == ["<module>", "g", "f"], err
    assert all("user_script.py" in f for f in frames), err
    assert "runpy" not in err and "hpcring/job.py" not in err and "site-packages" not in err and err.endswith("ValueError: boom\n")


def test_a_chained_exception_keeps_its_cause(tmp_path):
    (code, _), err = _run_as_main(tmp_path, "try:\n    {}['k']\nexcept KeyError as e:\n"
                                            "    raise RuntimeError('no config') from e\n")
    assert code == 1 and "KeyError: 'k'" in err and "direct cause" in err and "RuntimeError: no config" in err
    assert "runpy" not in err and "hpcring/job.py" not in err and "site-packages" not in err


def test_sys_exit_prints_nothing(tmp_path):
    (code, error), err = _run_as_main(tmp_path, "import sys\nsys.exit(3)\n")
    assert (code, error, err) == (3, None, "")


def test_a_syntax_error_is_shown_without_wrapper_frames(tmp_path):
    (code, _), err = _run_as_main(tmp_path, "def f(:\n")
    assert code == 1 and "SyntaxError" in err and "user_script.py" in err and "runpy" not in err
