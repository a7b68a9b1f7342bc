"""The failure paths without a cluster: the rank supervisor (real processes), the outcome model,
job records, the teardown table, the preemption API and the atomic JSON writer."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcring import preempt
from hpcring.errors import JobNotFoundError, UsageError
from hpcring.bootstrap.auth import delete_secret_file
from hpcring.fsutil import write_json
from hpcring.jobdir import hang_headline
from hpcring.outcome import rank_failure, read_records, record_path, summarize, write_record
from hpcring.schedulers import supervisor
from hpcring.schedulers.base import JobRecord, JobState, load_record, new_record

PY = sys.executable


def rank(code: str, **popen) -> subprocess.Popen:
    return supervisor.start([PY, "-c", code], dict(os.environ), **popen)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- supervisor ------------------------------------------------------------------------------

def test_a_failing_rank_ends_the_others_frozen_and_term_ignoring_ones_included():
    ok = rank("import time; time.sleep(60)")
    frozen = rank("import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); time.sleep(60)")
    deaf = rank("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    bad = rank("import time, sys; time.sleep(0.5); sys.exit(3)")
    t0 = time.monotonic()
    ended = supervisor.Supervisor([ok, frozen, deaf, bad], grace_s=0.5, kill_after_s=0.5).wait()
    took = time.monotonic() - t0
    assert ended.state == "FAILED" and ended.first_failed == 3 and ended.exit_code == 3
    assert ended.codes[0] == 128 + signal.SIGTERM            # took SIGTERM
    assert ended.codes[1] in (128 + signal.SIGTERM, 128 + signal.SIGKILL)   # SIGCONT let it take it
    assert ended.codes[2] == 128 + signal.SIGKILL             # ignored SIGTERM: killed
    assert sorted(ended.killed) == [0, 1, 2]
    assert took < 5, took


def test_a_diagnosed_failure_shortens_the_grace(tmp_path):
    (tmp_path / "hang-report.json").write_text("{}")
    procs = [rank("import time; time.sleep(60)"), rank("import sys; sys.exit(1)")]
    t0 = time.monotonic()
    supervisor.Supervisor(procs, grace_s=30, kill_after_s=0.5, diag=tmp_path).wait()
    assert time.monotonic() - t0 < supervisor.DIAGNOSED_GRACE_S + 3


def test_the_diagnosed_grace_counts_from_the_report_not_the_first_exit(tmp_path):
    """A rank killed at the fault exits seconds before the report exists; the survivor, which
    prints its line a moment after the report, keeps DIAGNOSED_GRACE_S from the report's
    appearance (counted from the death, it would be stopped before its line)."""
    g = supervisor.DIAGNOSED_GRACE_S
    report = tmp_path / "hang-report.json"
    survivor = rank("import os, time\n"
                    f"while not os.path.exists({str(report)!r}): time.sleep(0.01)\n"
                    f"time.sleep({g / 2})\n"
                    "print('line', flush=True)\n"
                    "raise SystemExit(1)", stdout=subprocess.PIPE)
    dead = rank("import sys; sys.exit(9)")
    dead.wait()
    threading.Timer(g * 0.6, lambda: report.write_text("{}")).start()    # the report comes late
    ended = supervisor.Supervisor([survivor, dead], grace_s=30, kill_after_s=0.5, diag=tmp_path).wait()
    assert ended.killed == [], ended                    # nobody had to be stopped
    assert ended.codes[0] == 1 and survivor.stdout.read() == b"line\n"


def test_stop_request_and_time_limit():
    procs = [rank("import time; time.sleep(60)") for _ in range(2)]
    sup = supervisor.Supervisor(procs, grace_s=10)
    sup.stop("CANCELLED")
    ended = sup.wait()
    assert ended.state == "CANCELLED" and ended.exit_code == 128 + signal.SIGTERM
    ended = supervisor.Supervisor([rank("import time; time.sleep(60)")], grace_s=10, limit_s=0.3).wait()
    assert ended.state == "TIMEOUT"


def test_clean_exit_is_completed():
    ended = supervisor.Supervisor([rank("pass"), rank("pass")], grace_s=1).wait()
    assert (ended.state, ended.exit_code, ended.first_failed, ended.killed) == ("COMPLETED", 0, None, [])


def test_ranks_die_with_their_supervisor_even_by_sigkill(tmp_path):
    pidfile = tmp_path / "pid"
    middle = subprocess.Popen([PY, "-c", (
        "import os, sys, time\n"
        "from hpcring.schedulers import supervisor\n"
        f"p = supervisor.start([sys.executable, '-c', 'import time; time.sleep(60)'], dict(os.environ))\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n")], env=dict(os.environ, PYTHONPATH=str(Path(supervisor.__file__).parents[2])))
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert alive(child)
    middle.kill()
    middle.wait()
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the rank outlived its SIGKILLed supervisor"


# ---- outcome ---------------------------------------------------------------------------------

def test_outcome_orders_failures_and_names_missing_ranks(tmp_path):
    for r, st in {0: {"exit_code": 0}, 1: {"exit_code": 1, "ended": 5.0, "host": "n1"},
                  2: {"exit_code": 1, "ended": 2.0, "host": "n2", "error": "ValueError: x"}}.items():
        write_record(tmp_path, "8", {"rank": r, **st})
    # rank 3 never wrote one; rank 4 was killed mid-write (not through write_record)
    record_path(tmp_path, "8", 4).write_text("{half")
    oc = summarize(read_records(tmp_path, "8", 5), 5)
    assert [s["rank"] for s in oc.failed] == [2, 1] and oc.missing == [3, 4] and not oc.clean
    assert rank_failure(oc.failed[0]) == "rank 2 on n2: ValueError: x"
    assert rank_failure(oc.failed[1]) == "rank 1 on n1: exited with code 1"


def test_hang_headline(tmp_path):
    assert hang_headline(tmp_path) is None
    (tmp_path / "hang-report.json").write_text(json.dumps({"headline": "allreduce#4: rank 1 (n2) died"}))
    assert hang_headline(tmp_path) == ("allreduce#4: rank 1 (n2) died", tmp_path / "hang-report.txt")


def test_timeout_is_not_blamed_on_a_collective(tmp_path, state_dir):
    from hpcring import jobstatus
    from hpcring.outcome import Outcome
    rec = JobRecord("9", "slurm", "s", str(tmp_path), 2, "train", "t.py", 0.0, "c1")
    (tmp_path / "diag").mkdir()
    (tmp_path / "diag" / "hang-report.json").write_text(json.dumps({"headline": "allreduce#9: rank 0 exited"}))
    write_json(tmp_path / "9_preempt.json", {"signal": "SIGUSR2", "at": time.time()})
    err = jobstatus.describe_failure(rec, Outcome(JobState("TIMEOUT", "TIMEOUT", 0), [], [0, 1]))
    assert "TIMEOUT: the job reached its time limit after the SIGUSR2 warning" in str(err)
    assert "collective" not in str(err).split("warning")[0] and "allreduce" not in str(err)
    err = jobstatus.describe_failure(rec, Outcome(JobState("FAILED", "FAILED", 1), [], [0, 1]))
    assert "collective failure: allreduce#9: rank 0 exited" in str(err)


def test_srun_kills_are_not_blamed_when_a_rank_reported_its_own_failure(tmp_path, state_dir):
    """hpcring's teardown kills the step after a rank records its failure: srun's "Killed" lines
    are then the consequence; with no rank's own record they are the diagnosis."""
    from hpcring import jobstatus
    from hpcring.outcome import Outcome
    rec = JobRecord("7", "slurm", "s", str(tmp_path), 3, "train", "t.py", 0.0, "c1")
    (tmp_path / "7_0_log.err").write_text("srun: error: node1: task 0: Killed\n")
    own = {"rank": 2, "host": "node3", "exit_code": 2, "error": "the script /x/t.py does not exist on node3"}
    err = str(jobstatus.describe_failure(rec, Outcome(JobState("FAILED", "FAILED", 1), [own], [0, 1])))
    assert "rank 2 on node3: the script /x/t.py does not exist on node3" in err and "killed" not in err, err
    err = str(jobstatus.describe_failure(rec, Outcome(JobState("FAILED", "FAILED", 1), [], [0, 1, 2])))
    assert "rank 0 (node1) was killed first (srun: Killed)" in err, err


def test_a_submit_directory_missing_on_the_node_is_named(tmp_path):
    from hpcring.job import not_on_this_node
    script = tmp_path / "t.py"
    script.write_text("")
    assert not_on_this_node(str(tmp_path), str(script), "n1") is None
    msg = not_on_this_node(str(tmp_path / "gone"), str(script), "n1")
    assert f"working directory {tmp_path / 'gone'}" in msg and "does not exist on n1" in msg and "shared" in msg
    msg = not_on_this_node(str(tmp_path), str(tmp_path / "u.py"), "n1")
    assert f"the script {tmp_path / 'u.py'} does not exist on n1" in msg


def test_node_local_paths_are_warned_about_before_submitting(tmp_path):
    from hpcring import submit
    from hpcring.config.jobspec import resolve_job
    from hpcring.config.site import load_site
    dev, local = load_site("devcluster", {}), load_site("local", {})
    job = resolve_job(dev, "/tmp/x/train.py", [], {}, environ={})
    ws = submit.node_local_warnings(dev, job, cwd="/tmp/x")
    assert len(ws) == 2 and "working directory /tmp/x is under /tmp" in ws[0] and "script /tmp/x/train.py" in ws[1]
    shared = resolve_job(dev, "/srv/hpcring/t.py", [], {}, environ={})
    assert submit.node_local_warnings(dev, shared, cwd="/srv/hpcring") == []
    assert submit.node_local_warnings(dev, shared, cwd="/tmpfoo") == []          # a prefix, not the folder
    assert submit.node_local_warnings(local, resolve_job(local, "/tmp/x/t.py", [], {}, environ={}), cwd="/tmp/x") == []


# ---- job records -----------------------------------------------------------------------------

def test_records_of_different_schedulers_do_not_collide(state_dir):
    new_record("38", "local", "local", "/l/38", 2, "a", "a.py")
    new_record("38", "slurm", "dev", "/s/38", 4, "b", "b.py", cluster="devcluster")
    new_record("39", "slurm", "dev", "/s/39", 4, "c", "c.py", cluster="devcluster")
    assert load_record("local-38").folder == "/l/38"
    assert load_record("slurm-devcluster-38").folder == "/s/38"
    assert load_record("39").key == "slurm-devcluster-39"          # plain id, unambiguous
    with pytest.raises(UsageError, match=r"job id 38 is ambiguous: 2 jobs have it \(local-38, slurm-devcluster-38\)"):
        load_record("38")
    with pytest.raises(JobNotFoundError, match="job 40 was not submitted"):
        load_record("40")


def test_secret_removal_is_quiet(tmp_path):
    secret = tmp_path / "x.key"
    secret.write_text("s")
    delete_secret_file(secret)
    delete_secret_file(secret)
    delete_secret_file(None)
    assert not secret.exists()


# ---- teardown --------------------------------------------------------------------------------

def test_teardown_asks_the_launcher_to_end_the_job():
    from hpcring import schedulers       # the scheduler modules own the commands; teardown runs them
    assert schedulers.end_job_argv({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}) == ["scancel", "--signal=KILL", "5.0"]
    assert schedulers.end_job_argv({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "batch"}) is None
    assert schedulers.end_job_argv({"LSB_JOBID": "12"}) == ["bkill", "12"]
    assert schedulers.end_job_argv({"LSB_JOBID": "12", "LSB_JOBINDEX": "3"}) == ["bkill", "12[3]"]   # array task 2
    assert schedulers.end_job_argv({"HPCRING_LAUNCHER": "local"}) is None   # the supervisor does it
    assert schedulers.annotate_argv("allreduce#4: rank 1 (node2)\n unreachable", {"SLURM_JOB_ID": "5"}) == \
        ["scontrol", "update", "JobId=5", "Comment=hpcring: allreduce#4: rank 1 (node2) unreachable"]


# ---- preemption ------------------------------------------------------------------------------

def test_warning_sets_the_flag_runs_callbacks_and_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(preempt, "_warned", {})
    monkeypatch.setattr(preempt, "_callbacks", [])
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    seen = []
    old = signal.getsignal(signal.SIGUSR2)
    try:
        assert preempt.install(tmp_path / "w.json") == signal.SIGUSR2
        preempt.on_preempt(seen.append)
        assert not preempt.preempted()
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.1)
        assert preempt.preempted() and seen == ["SIGUSR2"]
        assert json.loads((tmp_path / "w.json").read_text())["signal"] == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_requeue_count_takes_the_larger_of_ours_and_slurms():
    assert preempt.requeue_count({}) == 0
    assert preempt.requeue_count({"HPCRING_REQUEUE_COUNT": "2", "SLURM_RESTART_COUNT": "1"}) == 2
    assert preempt.requeue_count({"HPCRING_REQUEUE_COUNT": "0", "SLURM_RESTART_COUNT": "3"}) == 3


def test_runscript_checkpoint_is_the_same_script_one_requeue_later():
    from hpcring.job import RunScript
    d = RunScript("t.py", ["--x"], "/w", 2, requeues=1).__submitit_checkpoint__()
    assert (d.function.script, d.function.args, d.function.requeues) == ("t.py", ["--x"], 2)
    assert RunScript.checkpoint is RunScript.__submitit_checkpoint__   # the name submitit's handler checks


def test_bootstrap_failure_is_recorded_under_the_launchers_rank(monkeypatch):
    from hpcring.rank_life import bootstrap_failure
    for var in [v for v in os.environ if v.startswith(("SLURM_", "OMPI_", "PMIX_", "LSB_", "HPCRING_", "JSM_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HPCRING_LAUNCHER", "local")
    for k, v in {"HPCRING_RANK": "2", "HPCRING_SIZE": "3", "HPCRING_LOCAL_RANK": "0", "HPCRING_LOCAL_SIZE": "1",
                 "HPCRING_NODE_RANK": "2", "HPCRING_NUM_NODES": "3", "HPCRING_NODELIST": "local[0-2]",
                 "HPCRING_HOSTNAME": "local2", "HPCRING_JOB_ID": "5"}.items():
        monkeypatch.setenv(k, v)
    st = bootstrap_failure(RuntimeError("rendezvous incomplete: rank 1 never came\n  hint: ..."), first_line=True)
    assert (st["rank"], st["host"], st["exit_code"]) == (2, "local2", 1)
    assert st["error"] == "rendezvous incomplete: rank 1 never came"


def test_mpi_setup_names_a_rank_that_never_arrives():
    from types import SimpleNamespace

    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    from hpcring.collectives.mpi import _all_arrived
    from hpcring.errors import CollectiveError
    secret = os.urandom(32)
    with StoreServer("127.0.0.1", 0, secret=secret) as server:
        client = StoreClient("127.0.0.1", server.port, secret, timeout=5.0)
        topo = SimpleNamespace(rank=0, size=3, hosts=("n0", "n1", "n2"))
        client.set("hpcring/mpi/arrived/2", b"1")        # rank 2 came, rank 1 never does
        client.add("hpcring/mpi/arrived", 1)
        with pytest.raises(CollectiveError, match=r"MPI setup: rank 1 \(n1\) never reached it within 0.5 s"):
            _all_arrived(client, topo, 0.5)
