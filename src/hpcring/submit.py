"""Submitting and cancelling jobs: the library behind `hpcring submit|render|cancel` and the job
records that status/logs/cancel look up (a job's state and outcome: hpcring.jobstatus; following it:
hpcring.jobfollow). Nothing here prints.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

from submitit.core.utils import FailedJobError

from hpcring import schedulers
from hpcring.bootstrap import auth
from hpcring.config.jobspec import JobSpec, job_root as jobspec_root
from hpcring.config.site import Site
from hpcring.errors import HpcringError, JobNotFoundError, SchedulerError, UsageError
from hpcring.bootstrap.auth import delete_secret_file
from hpcring.job import RunScript
from hpcring.jobstatus import job_state
from hpcring.schedulers.render import render_script
from hpcring.config.arrays import sweep_args
from hpcring.fsutil import write_json
from hpcring.schedulers.base import JobRecord, JobState, load_record, new_record, recent_records, state_dir


def job_root(job: JobSpec) -> Path:
    return jobspec_root(job.job_dir)


def _check_script(job: JobSpec) -> Path:
    p = Path(job.script)
    if not p.is_file():
        raise UsageError(f"script {job.script!r} does not exist (cwd {os.getcwd()})",
                         hint="pass the path of the Python script each rank runs")
    return p.resolve()


def _python(site: Site) -> str:
    return site.config.python or sys.executable


def preview(site: Site, job: JobSpec, template: str | None = None, warn: bool = True) -> str:
    """The exact script `submit` would hand to the scheduler (job id still a placeholder)."""
    folder = str(job_root(job) / "%j")
    command = schedulers.get(site.config.scheduler).rank_command(_python(site), folder)   # as the executors do
    return render_script(site, job, command, folder, template, python=_python(site), warn=warn)


NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")   # private to each node on most clusters


def node_local_warnings(site: Site, job: JobSpec, cwd: str | None = None) -> list[str]:
    """Why the ranks may not find the job's working directory or script: they lie under a folder
    that is private to each node on most clusters. Empty for the local backend (one machine). A
    warning, not an error: a site may share such a folder, and the ranks name what they miss."""
    if site.config.scheduler == "local":
        return []
    out = []
    for what, path in (("working directory", cwd or os.getcwd()), ("script", str(Path(job.script).resolve()))):
        for d in NODE_LOCAL_DIRS:
            if path == d or path.startswith(d + "/"):
                out.append(f"the job's {what} {path} is under {d}, which is private to each node on most "
                           f"clusters: if the nodes do not see it, every rank fails at start (submit from a "
                           f"shared file system)")
                break
    return out


def submit(site: Site, job: JobSpec, template: str | None = None, entry=None) -> JobRecord:
    """Submit through submitit; returns the record saved for status/logs/cancel.

    ``entry``: what every rank calls (pickled by submitit): by default ``RunScript`` of
    ``job.script``; ``hpcring.Executor`` passes a ``RunFunction`` (``job.script`` is then its label).
    What can be checked here is checked before the scheduler sees the job, and a submission that
    fails leaves no job folder, secret or submitit file behind."""
    script = str(_check_script(job)) if entry is None else job.script
    preview(site, job, template, warn=False)   # a template that fails or is no job script: nothing made
    state_dir()                                # where the record goes: an unusable one is refused now
    mod = schedulers.get(site.config.scheduler)
    never = mod.never_fits(site, job)
    if never:
        raise SchedulerError(f"{mod.COMMAND} would take this job and never start it: {never}",
                             hint="ask for fewer nodes (--nodes, --spare-nodes), have the closed or down "
                                  "hosts reopened or repaired, or let left-out nodes back in "
                                  "(`hpcring nodes clear` for those a history of faults keeps out)")
    root = job_root(job)
    ex = mod.make_executor(site, job, root / "%j", template, _python(site))   # makes nothing (no sbatch: refused)
    if entry is None:
        sweep = ({str(i): sweep_args(v) for i, v in zip(job.array.indices, job.sweep)} if job.sweep else None)
        entry = RunScript(script, job.args, os.getcwd(), job.gpus_per_node, sweep=sweep)
    with _cleared_on_failure(root, job):
        try:
            sjob = ex.submit(entry)
        except FailedJobError as exc:
            text = str(exc).strip()
            raise SchedulerError(f"{mod.COMMAND} refused the job: {text}",
                                 hint=mod.explain_refusal(text) or "see the scheduler's message above") from None
    folder = str(root / str(sjob.job_id))
    array = {} if job.array is None else {"array": list(job.array.indices), "array_limit": job.array.limit,
                                          "sweep": job.sweep}
    rec = new_record(str(sjob.job_id), site.config.scheduler, str(site.path), folder, job.ntasks,
                     job.name, script, mod.cluster_name(site), job.env["HPCRING_SECRET_FILE"], **array)
    if job.array is not None:
        _start_tasks(mod, rec)
    return rec


@contextlib.contextmanager
def _cleared_on_failure(root: Path, job: JobSpec):
    """Make the job root (a UsageError naming it when it cannot be made or written) and the job's
    secret; if the block fails, remove what this submission left: the secret (when made here),
    submitit's temporary files (``<uuid>.pkl``, ``.submission_file_<uuid>.sh``) and the folders
    made here."""
    where = job.sources.get("job_dir", "job_dir")
    missing, p = [], root
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    made = [d for d in reversed(missing)] + ([] if os.path.lexists(root / ".secrets") else [root / ".secrets"])
    before: set[str] = set()
    new_secret = "HPCRING_SECRET_FILE" not in job.env   # a restart resubmits with the first attempt's

    def undo() -> None:
        if new_secret:
            delete_secret_file(job.env.pop("HPCRING_SECRET_FILE", None))
        try:
            for entry in root.iterdir():
                if entry.name not in before and entry.is_file() and (
                        entry.name.startswith(".submission_file_") or entry.suffix == ".pkl"):
                    entry.unlink(missing_ok=True)
        except OSError:
            pass
        for d in reversed(made):      # innermost first; only when nothing else is in there
            try:
                d.rmdir()
            except OSError:
                pass
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hpcring-probe-", dir=root)   # as root too: a read-only mount
        os.close(fd)
        os.unlink(probe)
        before = {e.name for e in root.iterdir()}
        if new_secret:
            job.env["HPCRING_SECRET_FILE"] = str(auth.new_job_secret(root))
    except OSError as exc:
        undo()
        raise UsageError(f"cannot use the job folder {root} ({where}): {exc.strerror or exc}",
                         hint="set job_dir in the site config, HPCRING_JOB_DIR or Executor(folder=) to a "
                              "writable shared path") from None
    try:
        yield
    except BaseException:
        undo()
        raise


def _start_tasks(mod, rec: JobRecord) -> None:
    """Give every array task its folder and submitit's pickle (the ranks look for
    ``<id>_<task>/<id>_<task>_submitted.pkl``), record which task has which values, then let the
    scheduler start them (Slurm's array was submitted held: it opens its --output in these folders)."""
    pickle = Path(rec.folder) / f"{rec.job_id}_submitted.pkl"
    write_json(Path(rec.folder) / "array.json", {"tasks": rec.array, "limit": rec.array_limit,
                                                 "sweep": rec.sweep})
    for task in rec.tasks():
        folder = Path(task.folder)
        folder.mkdir(parents=True, exist_ok=True)
        _install_pickle(pickle, folder / f"{task.job_id}_submitted.pkl")
    mod.release(rec)


def _install_pickle(pickle: Path, target: Path) -> None:
    """Make ``target`` this job's pickle, replacing whatever is there in one step. A pickle already
    there is another job's: job ids of clusters that share a job_dir overlap (the dev cluster's Slurm
    and its LSF emulation both start at 1), and keeping it made the task run that job's function.
    A rank waiting for the file (submitit polls for it) sees either nothing or the whole new one."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(pickle, tmp)
        except OSError:                # a file system without hard links
            import shutil
            shutil.copyfile(pickle, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def record(job_id: str) -> JobRecord:
    return load_record(job_id)


def newest() -> JobRecord:
    """The most recently submitted job's record."""
    recs = recent_records(1)
    if not recs:
        raise JobNotFoundError("no job was submitted through hpcring from this account yet",
                               hint="submit one with `hpcring submit SCRIPT`, or pass a job id")
    return recs[0]


def cancel(rec: JobRecord) -> JobState | None:
    """Cancel the job (an array: every task; a task record: that task); returns its state instead
    when it had already ended (nothing to cancel)."""
    mod = schedulers.get(rec.scheduler)
    try:
        st = job_state(rec)
    except HpcringError:
        st = None                  # the scheduler cannot say: ask it to cancel anyway
    if st is not None and st.finished:
        return st
    mod.cancel(rec)
    return None
