"""The LSF backend without LSF: submission text, bjobs parsing, state mapping, the submitit plugin."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import SchedulerError
from hpcring.schedulers.render import render_script
from hpcring.schedulers import get, lsf, lsf_task
from hpcring.schedulers.base import JobState

ROOT = Path(__file__).resolve().parents[2]


def test_registered():
    assert get("lsf") is lsf
    for hook in ("make_executor", "state", "cancel", "COMMAND", "explain_refusal"):
        assert hasattr(lsf, hook)
    assert lsf.COMMAND == "bsub"


def test_entry_points_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.submitit]' in text
    assert 'executor = "hpcring.schedulers.lsf:LsfExecutor"' in text
    assert 'job_environment = "hpcring.schedulers.lsf:LsfJobEnvironment"' in text
    assert lsf.LsfExecutor.name() == "lsf" and lsf.LsfJobEnvironment.name() == "lsf"


@pytest.mark.parametrize("text, jid", [
    ("Job <123> is submitted to queue <normal>.\n", "123"),
    ("Job <7> is submitted to default queue <batch>.", "7"),
    (b"Warning: something\nJob <42> is submitted to queue <debug>.\n", "42"),
])
def test_job_id_from_bsub(text, jid):
    assert lsf.job_id_from_output(text) == jid
    assert lsf.LsfExecutor._get_job_id_from_submission_command(text) == jid


def test_job_id_missing_is_a_scheduler_error():
    with pytest.raises(SchedulerError, match="could not find a job id"):
        lsf.job_id_from_output("normal2: No such queue. Job not submitted.")


@pytest.mark.parametrize("stat, state, finished", [
    ("PEND", "PENDING", False), ("WAIT", "PENDING", False), ("RUN", "RUNNING", False),
    ("PSUSP", "SUSPENDED", False), ("USUSP", "SUSPENDED", False), ("SSUSP", "SUSPENDED", False),
    ("DONE", "COMPLETED", True), ("EXIT", "FAILED", True),
    ("ZOMBI", "UNKNOWN", False), ("UNKWN", "UNKNOWN", False),
])
def test_every_lsf_state(stat, state, finished):
    info = lsf.parse_bjobs(f"17 {stat} - 2*node1:2*node2\n")["17"]
    assert info["State"] == state and info["stat"] == stat and info["nodes"] == "node1,node2"
    assert JobState(state).finished is finished
    watcher = lsf.LsfInfoWatcher()
    watcher._info_dict["17"] = info
    watcher._registered.add("17")
    assert watcher.is_done("17", mode="cache") is finished


def test_suspended_is_not_finished_for_submitit():
    """submitit's stock watcher takes anything but PENDING/RUNNING/... for finished: not ours."""
    watcher = lsf.LsfInfoWatcher()
    watcher._registered.add("5")
    watcher._info_dict.update(lsf.parse_bjobs(b"5 USUSP - 2*node1\n"))
    assert watcher.get_state("5", mode="cache") == "SUSPENDED"
    assert not watcher.is_done("5", mode="cache")


def test_parse_bjobs_skips_noise_and_reads_exit_code():
    out = lsf.parse_bjobs("Job <9> is not found\n3 EXIT 3 1*node2\n4 DONE - 1*node1\n")
    assert set(out) == {"3", "4"} and out["3"]["exit_code"] == "3"


def test_watcher_command_polls_unfinished_jobs_with_bjobs():
    w = lsf.LsfInfoWatcher()
    assert w._make_command() is None
    w._registered.update({"1", "2"})
    w._finished.add("1")
    assert w._make_command() == ["bjobs", "-o", "jobid stat exit_code exec_host jobindex", "-noheader", "2"]


def test_explain_refusal():
    assert "bqueues" in lsf.explain_refusal("normal2: No such queue. Job not submitted.")
    assert lsf.explain_refusal("all good") is None


def _executor(tmp_path, **params):
    ex = lsf.LsfExecutor(tmp_path / "%j", site="devcluster-lsf", python="/usr/bin/python3")
    if params:
        ex.update_parameters(**params)
    return ex


def test_executor_multi_task_and_stdin_submission(tmp_path):
    ex = _executor(tmp_path, nodes=3, tasks_per_node=2, time=7)
    assert ex._num_tasks() == 6  # not hard-coded to one task
    assert ex.parameters["timeout_min"] == 7
    cmd = ex._make_submission_command(Path("/x/job.sh"))
    assert cmd[:3] == ["/bin/sh", "-c", 'exec bsub < "$1"'] and cmd[-1] == "/x/job.sh"
    text = ex._make_submission_file_text(ex._submitit_command_str, "uid")
    assert "#BSUB -n 6" in text and '#BSUB -R "span[ptile=2]"' in text and "#BSUB -W 0:07" in text
    assert f"-m hpcring.schedulers.lsf_task {tmp_path}/%j" in text
    assert 'blaunch -u "$HOSTFILE"' in text


def test_executor_refuses_unknown_parameter_and_non_lsf_site(tmp_path):
    with pytest.raises(ValueError, match="unknown LSF executor parameter"):
        _executor(tmp_path, gpus=3)
    with pytest.raises(SchedulerError, match="not an LSF one"):
        lsf.LsfExecutor(tmp_path, site="devcluster")


def test_make_executor_needs_bsub(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    site = load_site("devcluster-lsf", {})
    job = resolve_job(site, "x.py", [], {"nodes": 1}, environ={})
    with pytest.raises(SchedulerError, match="`bsub` is not on PATH"):
        lsf.make_executor(site, job, tmp_path, None, sys.executable)


def _render(site_name, **cli):
    site = load_site(site_name, {})
    job = resolve_job(site, "train.py", [], dict(cli), environ={})
    return render_script(site, job, "CMD", "/jobs/%j")


def test_template_launchers(tmp_path, site_file):
    base = (ROOT / "site_configs" / "devcluster-lsf.yaml").read_text()
    mpi = site_file(base.replace("kind: blaunch", "kind: mpirun"), "mpi.yaml")
    text = _render(str(mpi), nodes=2, tasks_per_node=2)
    assert 'mpirun -np 4 --hostfile "$HOSTFILE" --map-by ppr:2:node' in text
    drop = site_file(base.replace("  warning_time: \"1\"", "  warning_time: \"1\"\n  drop_launch_node: true"), "d.yaml")
    text = _render(str(drop), nodes=2, tasks_per_node=2)
    assert 'grep -v -x -F "$(head -n 1 "$LSB_DJOB_HOSTFILE")"' in text and 'blaunch -u "$HOSTFILE"' in text
    gpu = site_file(base.replace("cpus_per_node: 4\npartitions", "cpus_per_node: 4\ngpus_per_node: 4\npartitions"), "g.yaml")
    text = _render(str(gpu), nodes=1, gpus_per_node=4, exclusive=None)
    assert '#BSUB -gpu "num=4:mode=exclusive_process"' in text
    text = _render("lsf-summit", nodes=2)
    assert "#BSUB -nnodes 2" in text and "#BSUB -n " not in text and "jsrun -n 12 -r 6" in text
    assert "#BSUB -wa USR2" in text and "#BSUB -wt 5" in text


def test_task_log_base_and_redirect(tmp_path):
    assert lsf_task.log_base("/j/%j/%j_%t_log", "42", 3) == Path("/j/42/42_3_log")
    # redirect in a child so this test's own stdout stays put
    code = (f"import sys; from pathlib import Path; "
            f"from hpcring.schedulers.lsf_task import redirect_output as r; r(Path({str(tmp_path / 'a' / 'x')!r})); "
            "print('to out'); print('to err', file=sys.stderr)")
    assert os.system(f"{sys.executable} -c \"{code}\"") == 0
    assert (tmp_path / "a" / "x.out").read_text() == "to out\n"
    assert (tmp_path / "a" / "x.err").read_text() == "to err\n"


def test_task_entry_refuses_outside_lsf(monkeypatch, capsys):
    monkeypatch.delenv("LSB_JOBID", raising=False)
    assert lsf_task.main(["/f"]) == 2
    assert "inside an LSF job" in capsys.readouterr().err


def test_job_environment_under_blaunch(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\nnode1\nnode2\nnode2\n")
    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_", "PMI", "JSM_", "MV2_")) or k in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "lsf")
    monkeypatch.setenv("LSB_JOBID", "77")
    monkeypatch.setenv("LSF_PM_TASKID", "4")
    monkeypatch.setenv("LSB_DJOB_HOSTFILE", str(hostfile))
    monkeypatch.setenv("LSB_MCPU_HOSTS", "node1 2 node2 2")
    monkeypatch.setattr("socket.gethostname", lambda: "node2")
    lsf.LsfJobEnvironment._topology.cache_clear()
    lsf_task.register_environment()
    import submitit
    env = submitit.JobEnvironment()
    assert isinstance(env, lsf.LsfJobEnvironment)
    assert (env.job_id, env.global_rank, env.num_tasks, env.local_rank, env.node, env.num_nodes) == \
        ("77", 3, 4, 1, 1, 2)
    assert env.hostnames == ["node1", "node2"]
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path / "%j"))
    assert env.paths.folder == tmp_path / "77"
    lsf.LsfJobEnvironment._topology.cache_clear()


def test_state_and_cancel_through_commands(tmp_path, monkeypatch, state_dir):
    """state()/cancel() run bjobs/bkill; a fake pair of commands stands in for LSF here."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "bjobs").write_text('#!/bin/sh\necho "$4 EXIT 130 2*node1"\n')
    (bin_ / "bkill").write_text('#!/bin/sh\necho "Job <$1> is being terminated"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    assert lsf.state("12") == JobState("FAILED", "EXIT", 130, "node1")
    lsf.cancel("12")
    assert lsf.state("12").state == "CANCELLED"
    (bin_ / "bjobs").write_text('#!/bin/sh\necho "Job <$4> is not found" >&2\nexit 255\n')
    assert lsf.state("13").state == "UNKNOWN"


def test_array_elements_are_told_apart_by_their_index():
    """bjobs prints the array's id on every element; the jobindex field (LSF's 1-based index) tells
    them apart, and hpcring names element i+1 as task i."""
    text = "12 DONE - 1*node1 1\n12 EXIT 3 1*node2 2\n13 RUN - 1*node3 0\n"
    assert sorted(lsf.parse_bjobs(text)) == ["12[1]", "12[2]", "13"]
    assert (lsf._hpcring_id("12[1]"), lsf._lsf_id("12_1"), lsf._lsf_id("13")) == ("12_0", "12[2]", "13")
