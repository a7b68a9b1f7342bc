"""The local backend: the same job on this machine, with no scheduler.

Submission renders ``templates/local.sh.j2`` and starts it detached (its own session), so
``submit`` returns at once as with sbatch; the script runs ``local_run``, the supervisor that
starts nodes x tasks_per_node ranks with an allocation's per-rank environment and records the
job's state in ``<folder>/<jobid>_local.json``. An array (each task the whole job, folder
``<root>/<id>_<task>``) or a job with a dependency is started by ``local_queue`` instead, which
waits for the dependency and runs at most ``%N`` tasks at once.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from submitit.core import core

from collections.abc import Mapping, Sequence

from hpcring.config.envvars import MAX_LOCAL_RANKS
from hpcring.config.jobspec import JobSpec
from hpcring.config.site import Site
from hpcring.errors import JobNotFoundError, SchedulerError, UsageError
from hpcring.fsutil import write_json
from hpcring.schedulers.render import render_script
from hpcring.schedulers.base import JobRecord, JobState, load_record, state_dir
from hpcring.schedulers.launch_words import submitit_command
from hpcring.schedulers.local_queue import pid_alive, start

COMMAND = "local"


def state_file(folder: Path, job_id: str) -> Path:
    return Path(str(folder).replace("%j", job_id)) / f"{job_id}_local.json"


def read_state(folder: Path, job_id: str) -> dict | None:
    try:
        return json.loads(state_file(folder, job_id).read_text())
    except (OSError, ValueError):
        return None


class _Watcher(core.InfoWatcher):
    """submitit's watcher over our state files (no scheduler command to poll)."""

    def __init__(self) -> None:
        super().__init__(delay_s=1)
        self.folders: dict[str, Path] = {}

    def _make_command(self):
        return None

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        folder = self.folders.get(job_id)
        return state(job_id, folder).state if folder else "UNKNOWN"


class LocalJob(core.Job):
    watcher = _Watcher()

    def __init__(self, folder, job_id: str, tasks=(0,)) -> None:
        self.watcher.folders[job_id] = Path(folder)
        super().__init__(folder, job_id, tasks)

    def cancel(self, check: bool = True) -> None:
        cancel(self.job_id, self.watcher.folders.get(self.job_id))


class Executor(core.PicklingExecutor):
    job_class = LocalJob

    def __init__(self, folder: Path, site: Site, job: JobSpec, template: str | None, python: str) -> None:
        super().__init__(folder)
        self._site, self._job, self._template, self.python = site, job, template, python
        self.parameters["timeout_min"] = job.time_min

    @property
    def _submitit_command_str(self) -> str:
        return submitit_command(self.python, str(self.folder))

    def _num_tasks(self) -> int:
        return self._job.ntasks

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_script(self._site, self._job, command, str(self.folder), self._template, python=self.python)

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return [sys.executable, "-m", "hpcring.schedulers.local", "spawn", str(submission_file_path),
                str(self.folder), str(self._job.time_min * 60), *queue_args(self._job)]

    @staticmethod
    def _get_job_id_from_submission_command(string) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        for word in text.split():
            if word.isdigit():
                return word
        raise SchedulerError(f"local backend: no job id in {text!r}")


def make_executor(site: Site, job: JobSpec, folder: Path, template: str | None, python: str) -> Executor:
    queue_args(job)                    # a dependency on a job that is not local: refused before anything starts
    return Executor(folder, site, job, template, python)


def queue_args(job: JobSpec) -> list[str]:
    """local_queue's options for an array or a dependency (none for a plain job): the tasks, how
    many at once (``%N``, else as many as MAX_LOCAL_RANKS allows), each dependency's state file."""
    out: list[str] = []
    if job.array is not None:
        fit = max(1, MAX_LOCAL_RANKS // job.ntasks)
        out += ["--tasks", ",".join(map(str, job.array.indices)),
                "--parallel", str(min(job.array.limit or fit, fit, len(job.array.indices)))]
    if job.dependency is not None:
        for dep in job.dependency.jobs:
            try:
                rec = load_record(dep)
            except JobNotFoundError:
                raise UsageError(f"--dependency/--after: job {dep} is not a job of the local backend",
                                 hint="a local job can wait only for other local jobs (`hpcring status` lists them)") from None
            if rec.scheduler != "local" or rec.array is not None:
                raise UsageError(f"--dependency/--after: job {dep} is a {rec.scheduler} "
                                 f"{'array' if rec.array is not None else 'job'}; a local job waits for local "
                                 "jobs and array tasks (JOB_TASK)", hint="name a local job or one task of a local array")
            out += ["--after", f"{job.dependency.kind}:{dep}:{state_file(Path(rec.folder), rec.job_id)}"]
    return out


def _next_job_id() -> str:
    """Monotonic per-user ids (1, 2, ...), safe against concurrent submissions."""
    path = state_dir().parent / "local_job_counter"
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        n = int(fh.read().strip() or "0") + 1
        fh.seek(0)
        fh.truncate()
        fh.write(str(n))
    return str(n)


def spawn(script: str, folder: str, time_limit_s: str, queue: list[str] | None = None) -> str:
    """Start the rendered script detached (through local_queue for an array or a dependency);
    return the job id (printed like sbatch does)."""
    job_id = _next_job_id()
    if queue:
        return start(job_id, script, folder, time_limit_s, queue)
    real = Path(folder.replace("%j", job_id))
    real.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HPCRING_LOCAL_JOB_ID=job_id, HPCRING_TIME_LIMIT_S=time_limit_s)
    with open(real / f"{job_id}_supervisor.log", "ab") as log:
        proc = subprocess.Popen(["bash", script], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=env, start_new_session=True, close_fds=True)
    write_json(real / f"{job_id}_local.json",
                 {"state": "PENDING", "pgid": proc.pid, "pid": proc.pid, "submitted": time.time()})
    return job_id


def state(job_id: str, folder: Path | None) -> JobState:
    data = read_state(folder, job_id) if folder else None
    if data is None:
        return JobState("UNKNOWN", "no local state file")
    st = data.get("state", "UNKNOWN")
    if st in ("PENDING", "RUNNING") and data.get("pid") and not pid_alive(int(data["pid"])):
        # supervisor gone without writing a final state: killed from outside
        return JobState("FAILED", "supervisor vanished", data.get("exit_code"))
    return JobState(st, data.get("reason") or st, data.get("exit_code"), data.get("nodes", ""))


def states(recs: Sequence[JobRecord]) -> dict[str, JobState]:
    """From each job's state file (no scheduler to ask)."""
    return {r.job_id: state(r.job_id, Path(r.folder)) for r in recs}


def rank_command(python: str, folder: str) -> str:
    return submitit_command(python, folder)


def release(rec: JobRecord) -> None:
    """Nothing held: local_queue starts each task once its pickle is there."""


def queued_at(rec: JobRecord) -> float | None:
    return None


def cluster_name(site: Site) -> str:
    return site.name


def explain_refusal(text: str) -> str | None:
    return None


def never_fits(site, job) -> str | None:
    """None: the local backend runs every job on this machine (its size is checked when it is
    resolved)."""
    return None


def first_casualty(rec: JobRecord) -> str | None:
    """The supervisor records each rank's own exit; it writes no launcher line to read."""
    return None


def end_job_argv(environ: Mapping[str, str]) -> list[str] | None:
    return None                # the supervisor ends the ranks itself


def annotate_argv(headline: str, environ: Mapping[str, str]) -> list[str] | None:
    return None


def run_on_nodes(job_id: str, command, timeout: float) -> tuple[str, str, int, str]:
    raise SchedulerError("the local backend's ranks are on this machine: probe them here")


CANCEL_WAIT_S = 8.0   # the supervisor's own stop (SIGTERM, then SIGKILL after 3 s) fits in this


QUEUE_STOP_WAIT_S = 5.0   # the queue's own stop: it starts nothing more and marks its tasks CANCELLED


def cancel(rec: JobRecord | str, folder: Path | None = None) -> None:
    """Cancel a job (every task of an array: its queue first); see :func:`cancel_one`."""
    if isinstance(rec, JobRecord):
        tasks = [(one.job_id, Path(one.folder)) for one in (rec.tasks() if rec.array is not None else [rec])]
        if len(tasks) > 1:
            _stop_queue(tasks)
        for job_id, task_folder in tasks:
            cancel_one(job_id, task_folder)
    else:
        cancel_one(rec, folder)


def _queued(tasks: list[tuple[str, Path]]) -> dict[str, int]:
    """{task: its queue's pid} for the tasks not started yet whose queue (local_queue) still runs."""
    out = {}
    for job_id, folder in tasks:
        data = read_state(folder, job_id) or {}
        pid = data.get("pid")
        if data.get("state") == "PENDING" and not data.get("pgid") and pid and pid_alive(int(pid)):
            try:
                if b"local_queue" in Path(f"/proc/{int(pid)}/cmdline").read_bytes():
                    out[job_id] = int(pid)
            except OSError:
                pass
    return out


def _stop_queue(tasks: list[tuple[str, Path]]) -> None:
    """Stop an array's queue before its tasks: cancelled task by task, the queue could start the
    next task the moment the running one ended (seen in CI: a queued task's supervisor started).
    Stopped (SIGTERM), it starts nothing more and marks every task it had not started CANCELLED;
    bounded by QUEUE_STOP_WAIT_S, after which cancel_one marks them itself."""
    queues = set(_queued(tasks).values())
    for pid in queues:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + QUEUE_STOP_WAIT_S
    while queues and time.monotonic() < deadline and _queued(tasks):
        time.sleep(0.05)


def cancel_one(job_id: str, folder: Path | None) -> None:
    """A task not started yet (no process group) is only marked CANCELLED; otherwise SIGTERM to the job's process group (the supervisor stops its ranks and records CANCELLED);
    whatever is still alive after CANCEL_WAIT_S -- a supervisor that is gone or stuck, ranks that
    ignore SIGTERM as submitit's do -- gets SIGKILL, and the state file says CANCELLED."""
    data = read_state(folder, job_id) if folder else None
    if data is None:
        raise SchedulerError(f"local job {job_id}: no state file under {folder}")
    if data.get("state") not in ("PENDING", "RUNNING"):
        return
    if not data.get("pgid"):          # queued in local_queue: it reads this before starting the task
        data.update(state="CANCELLED", ended=time.time(), reason="cancelled before it started")
        write_json(state_file(folder, job_id), data)
        return
    pgid = int(data["pgid"])
    if not _signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGCONT)
        _signal_group(pgid, signal.SIGKILL)
    data = read_state(folder, job_id) or data
    if data.get("state") in ("PENDING", "RUNNING"):
        data.update(state="CANCELLED", ended=time.time(), exit_code=data.get("exit_code") or 137)
        write_json(state_file(folder, job_id), data)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _group_alive(pgid: int) -> bool:
    """Any non-zombie process left in the group (zombies of a dead supervisor do not count)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


if __name__ == "__main__":  # submission command: python -m hpcring.schedulers.local spawn SCRIPT FOLDER LIMIT [QUEUE...]
    if len(sys.argv) < 5 or sys.argv[1] != "spawn":
        print("usage: python -m hpcring.schedulers.local spawn SCRIPT FOLDER TIME_LIMIT_S [local_queue options]",
              file=sys.stderr)
        sys.exit(2)
    print(f"Submitted local job {spawn(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])}")
