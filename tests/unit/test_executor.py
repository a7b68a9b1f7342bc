"""``hpcring.Executor``: what is refused at submission (an HpcringError with what, where and a hint;
nothing queued, no job record, no job folder left behind), and the scheduler paths that are only
rendered here (Slurm, LSF)."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

import hpcring
from hpcring.errors import HpcringError, SchedulerError, UsageError

ROOT = Path(__file__).resolve().parents[2]
HELLO = str(ROOT / "examples" / "hello.py")
REAL_POPEN = subprocess.Popen


def work(x=1):
    return x


@pytest.fixture
def sandbox(local_env, tmp_path, monkeypatch):
    """Empty state and job folders; Popen is a tripwire unless a test lets the job start."""
    dirs = local_env
    monkeypatch.chdir(dirs["cwd"])
    started = []

    def trip(*a, **kw):
        started.append(a[0] if a else kw.get("args"))
        raise AssertionError(f"started {started[-1]}")
    monkeypatch.setattr(subprocess, "Popen", trip)
    dirs["started"] = started
    dirs["tmp"] = tmp_path
    return dirs


def nothing_left(dirs, *more: Path) -> list[str]:
    """What a refused submission left: records, job folders (the job root itself may exist only if
    it did before), files in the working folder, anything started."""
    left = [str(p) for p in dirs["state"].rglob("*") if p.is_file()]
    left += [str(p) for d in (dirs["jobs"], dirs["cwd"], *more) if d.exists() for p in d.rglob("*")]
    return left + [f"started {s}" for s in dirs["started"]]


def refused(call, *words) -> HpcringError:
    with pytest.raises(HpcringError) as info:
        call()
    text = str(info.value)
    assert "hint:" in text, text
    for w in words:
        assert w in text, (w, text)
    return info.value


# ------------------------------------------------------------------------------ unpicklable

def test_unpicklable_argument(sandbox):
    ex = hpcring.Executor()
    lock = threading.Lock()
    exc = refused(lambda: ex.submit(work, lock), "argument 0", "lock", "cannot be pickled", "nothing was submitted")
    assert isinstance(exc, UsageError)
    refused(lambda: ex.submit(work, x=lock), "keyword argument x=")
    refused(lambda: ex.map_array(work, [1, 2, lock]), "item 2's argument 0")
    assert not nothing_left(sandbox)


def test_unpicklable_function(sandbox):
    lock = threading.Lock()

    def closes_over_a_lock():        # a local function goes by value, with what it closes over
        return lock.locked()
    refused(lambda: hpcring.Executor().submit(closes_over_a_lock), "the function", "closes_over_a_lock",
            "cannot be pickled")
    refused(lambda: hpcring.Executor().submit("not a function"), "is not callable")
    assert not nothing_left(sandbox)


# ------------------------------------------------------------------------------ what the site refuses

SITE = """name: partitioned
scheduler: slurm
cpus_per_node: 8
partitions:
  debug: {max_nodes: 2, max_time: "00:30:00"}
  long: {max_nodes: 1}
defaults: {partition: debug}
launcher: {kind: srun}
fabric: {kind: tcp, data_interfaces: ["=lo"]}
"""


@pytest.fixture
def partitioned(sandbox, monkeypatch):
    """A Slurm site with partitions; no sbatch on PATH (and Popen a tripwire): nothing can reach a
    real scheduler, whatever a case lets through."""
    path = sandbox["tmp"] / "partitioned.yaml"
    path.write_text(SITE)
    monkeypatch.setenv("PATH", "/nonexistent")
    return str(path)


def every_submission(ex):
    return (lambda: ex.submit(work), lambda: ex.map_array(work, [1, 2]), lambda: ex.submit_script(HELLO),
            lambda: ex.render(work))


@pytest.mark.parametrize("params,words", [
    ({"partition": "gpu"}, ["partition 'gpu' (update_parameters) is not defined", "debug, long"]),
    ({"nodes": 3}, ["nodes=3 exceeds partition 'debug' max_nodes 2"]),
    ({"partition": "long", "nodes": 2}, ["nodes=2 exceeds partition 'long' max_nodes 1"]),
    ({"time": 31}, ["time=00:31:00 exceeds partition 'debug' max_time"]),
    ({"tasks_per_node": 4, "cpus_per_task": 4}, ["16 CPUs per node", "has 8"]),
    ({"gpus_per_node": 1}, ["gpus_per_node=1", "has 0 GPUs"]),
])
def test_what_the_site_refuses(params, words, partitioned, sandbox):
    ex = hpcring.Executor(site=partitioned)
    ex.update_parameters(**params)           # each value is fine alone: the site refuses the job
    for submit in every_submission(ex):
        refused(submit, *words)
    assert not nothing_left(sandbox)


@pytest.mark.parametrize("params,words", [
    ({"nodes": 2, "tasks_per_node": 200}, ["400 ranks", "at most 256"]),
    ({"tasks_per_node": 8, "cpus_per_task": 16}, ["128 CPUs per node", "has 64"]),
    ({"dependency": "afterok:999"}, ["job 999 is not a job of the local backend"]),
    ({"template": "/nonexistent.sh.j2"}, ["does not exist"]),
])
def test_what_the_local_site_refuses(params, words, sandbox):
    ex = hpcring.Executor(site="local")
    ex.update_parameters(**params)
    for submit in every_submission(ex)[:3] if "dependency" in params else every_submission(ex):
        refused(submit, *words)
    assert not nothing_left(sandbox)


def test_an_unknown_site(sandbox):
    refused(lambda: hpcring.Executor(site="no-such-site").submit(work), "no-such-site")
    assert not nothing_left(sandbox)


def test_a_bad_environment_value_stops_submission(sandbox, monkeypatch):
    monkeypatch.setenv("HPCRING_NODES", "0")
    refused(lambda: hpcring.Executor().submit(work), "HPCRING_NODES")
    monkeypatch.setenv("HPCRING_NODES", "1")
    monkeypatch.setenv("HPCRING_TIMEOUT", "nan")
    refused(lambda: hpcring.Executor().submit(work), "HPCRING_TIMEOUT")
    assert not nothing_left(sandbox)


def test_submit_script_refuses_what_submit_refuses(sandbox):
    ex = hpcring.Executor()
    refused(lambda: ex.submit_script("/nonexistent/train.py"), "does not exist")
    refused(lambda: ex.submit_script(str(ROOT / "examples")), "is a directory")
    refused(lambda: ex.submit_script(HELLO, "--lr 0.1"), "args is one str")
    refused(lambda: ex.submit_script(HELLO, ["--lr", 0.1]), "argument 1")
    refused(lambda: ex.submit_script(HELLO, ["a\x00b"]), "NUL")
    assert not nothing_left(sandbox)


# ------------------------------------------------------------------------------ the folder

def test_a_folder_that_cannot_be_written(sandbox):
    a_file = sandbox["tmp"] / "a-file"
    a_file.write_text("x")
    for folder in (a_file, a_file / "jobs", Path("/proc/hpcring-jobs")):
        exc = refused(lambda: hpcring.Executor(folder=folder).submit(work),
                      f"cannot use the job folder {folder}", "Executor(folder=)", "writable")
        assert isinstance(exc, UsageError)
        refused(lambda: hpcring.Executor(folder=folder).map_array(work, [1]), "cannot use the job folder")
    assert a_file.read_text() == "x" and not nothing_left(sandbox)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder(sandbox):
    ro = sandbox["tmp"] / "ro"
    ro.mkdir(mode=0o500)
    try:
        refused(lambda: hpcring.Executor(folder=ro / "jobs").submit(work), "cannot use the job folder")
        refused(lambda: hpcring.Executor(folder=ro).submit(work), "cannot use the job folder")
        assert not list(ro.iterdir())
    finally:
        ro.chmod(0o700)


def test_a_refused_submission_leaves_no_folder(sandbox, monkeypatch):
    """The scheduler refuses after the folder, the secret and submitit's files were made: all of
    them go again (a folder made for the job too), and the job has no record."""
    from hpcring.schedulers import local
    monkeypatch.setattr(subprocess, "Popen", REAL_POPEN)          # the (refusing) submission command runs
    monkeypatch.setattr(local.Executor, "_make_submission_command",
                        lambda self, path: ["sh", "-c", "echo 'refused: no slots' >&2; exit 1"])
    new = sandbox["tmp"] / "new" / "jobs"
    exc = refused(lambda: hpcring.Executor(folder=new).submit(work), "refused the job", "no slots")
    assert isinstance(exc, SchedulerError)
    assert not (sandbox["tmp"] / "new").exists()          # made for this job, removed with it
    existing = sandbox["jobs"]
    (existing / "keep.txt").write_text("mine")
    refused(lambda: hpcring.Executor(folder=existing).map_array(work, [1, 2]), "refused the job")
    assert sorted(p.name for p in existing.iterdir()) == ["keep.txt"]      # no .secrets, pickle or script
    assert not list(sandbox["state"].rglob("*.json"))


# ------------------------------------------------------------------------------ Slurm and LSF: rendered only

def test_slurm_job_script_of_a_function(sandbox):
    ex = hpcring.Executor(site="slurm-tcp", folder="/scratch/me/runs")
    ex.update_parameters(nodes=4, tasks_per_node=2, time="2:00:00", partition="cpu", account="proj",
                         sched_arg=["--mem=8G"], timeout=120)
    text = ex.render(work)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=2", "#SBATCH --time=02:00:00",
                 "#SBATCH --partition=cpu", "#SBATCH --account=proj", "#SBATCH --mem=8G",
                 "#SBATCH --job-name=work", "HPCRING_TIMEOUT=120", "/scratch/me/runs/%j", "submitit.core._submit"):
        assert line in text, line
    assert not nothing_left(sandbox)


def test_lsf_job_script_of_a_function(sandbox):
    ex = hpcring.Executor(site="lsf-summit")
    ex.update_parameters(nodes=2, time=30, name="sweep")
    text = ex.render(work)
    assert "#BSUB -J sweep" in text or '#BSUB -J "sweep"' in text or "#BSUB -J 'sweep'" in text, text
    assert "#BSUB -W 0:30" in text and "#BSUB -nnodes 2" in text, text


def test_submitting_to_slurm_without_sbatch_makes_nothing(sandbox, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    refused(lambda: hpcring.Executor(site="slurm-tcp").submit(work), "`sbatch` is not on PATH")
    refused(lambda: hpcring.Executor(site="lsf-summit").map_array(work, [1]), "`bsub` is not on PATH")
    assert not nothing_left(sandbox)


def test_job_lookup_of_an_unknown_id(sandbox):
    refused(lambda: hpcring.Job("12345"), "job 12345 was not submitted through hpcring")
    refused(lambda: hpcring.Job("../etc"), "is not a job id")
    refused(lambda: hpcring.Executor().job("*"), "is not a job id")
