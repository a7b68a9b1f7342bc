"""The interface every scheduler implements, and the job registry the CLI reads.

:class:`Scheduler` is what ``schedulers.get(name)`` returns (slurm.py, lsf.py, local.py; each module
satisfies it with module-level functions, submitit-style: one module per scheduler). Everything
that runs a scheduler command (sbatch, srun, scancel, squeue, sacct, scontrol, bsub, bjobs, bkill,
blaunch, jsrun) or reads its output is behind it; callers outside ``schedulers/`` only get
JobStates, words and texts back.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from hpcring.config.text import shown
from hpcring.errors import HpcringError, JobNotFoundError, SchedulerError, UsageError
from hpcring.fsutil import write_json
from hpcring.ranks import rank_ranges

# States normalized across schedulers (Slurm's names; LSF and local map onto them).
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


COMMAND_TIMEOUT = 30.0         # seconds a scheduler command (sacct, bjobs, scancel, ...) may take


def run_command(cmd: list[str], *, missing_hint: str, slow_hint: str,
                timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    """Run a scheduler query/control command (output captured, no stdin, COMMAND_TIMEOUT). A
    command not on PATH or not answering is a SchedulerError with the scheduler's own hint."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SchedulerError(f"`{cmd[0]}` is not on PATH", hint=missing_hint) from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"`{' '.join(cmd)}` did not answer within {timeout:g} s",
                             hint=slow_hint) from None


@dataclass(frozen=True)
class JobState:
    state: str                 # normalized (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)
    raw: str = ""              # the scheduler's own word, e.g. "CANCELLED by 0" or "EXIT"
    exit_code: int | None = None
    nodelist: str = ""         # the hosts, as the scheduler writes them (a Slurm hostlist, LSF host names)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


@dataclass
class JobRecord:
    job_id: str
    scheduler: str
    site: str
    folder: str
    ntasks: int
    name: str
    script: str
    submitted_at: float
    cluster: str = ""          # Slurm's ClusterName, LSF's cluster, or the site's name
    secret_file: str = ""      # the job's rendezvous secret, deleted once the job has ended
    array: list[int] | None = None   # an array job: its task indices (hpcring's, 0-based); else None
    array_limit: int | None = None   # at most this many tasks run at once (``%N``)
    sweep: list[dict] | None = None  # per array task, in ``array`` order: {name: value} (``--sweep``)
    parent: str = ""           # an array task's record: the array's job id (its own is PARENT_TASK)

    def task(self, index: int) -> "JobRecord":
        """The record of array task ``index``: id ``<id>_<index>``, folder ``<root>/<id>_<index>``
        (each task is a whole job with its own folder, logs and status records)."""
        tid = f"{self.job_id}_{index}"
        return replace(self, job_id=tid, folder=str(Path(self.folder).parent / tid), array=None,
                       array_limit=None, sweep=None, parent=self.job_id)

    def tasks(self) -> list["JobRecord"]:
        return [self.task(i) for i in self.array or ()]

    @property
    def task_index(self) -> int | None:
        return int(self.job_id.rsplit("_", 1)[1]) if self.parent else None

    @property
    def key(self) -> str:
        """The record's name: ``slurm-<cluster>-<id>``, ``lsf-<cluster>-<id>``, ``local-<id>``.

        Ids of different schedulers and clusters overlap (local job 38, Slurm job 38); the key
        does not."""
        return "-".join(p for p in (self.scheduler, self.cluster if self.scheduler != "local" else "",
                                    self.job_id) if p)


class Scheduler(Protocol):
    """What one scheduler provides (module-level functions of slurm.py, lsf.py, local.py).

    Job side: ``make_executor`` (a submitit executor whose submission file is hpcring's rendered
    template), ``rank_command`` (what each rank runs), ``states`` (the states of many jobs from ONE
    query: sacct, bjobs or the local state files; follow loops back off between calls),
    ``cancel`` (an array's id: every task; ``JOB_TASK``: one), ``release`` (start an array
    submitted held), ``queued_at``, ``cluster_name``, ``explain_refusal`` (a hint for a refused
    submission), ``never_fits`` (why the scheduler would take a job and never start it: checked
    before submitting), ``first_casualty`` (the launcher's own "rank N was killed" line),
    ``run_on_nodes`` (a command once per node of a running job: ``hpcring stacks``' probe). Rank side, from the job's environment:
    ``end_job_argv``/``annotate_argv`` (end every rank after a diagnosed failure; put the headline
    in the scheduler's record), ``run_ending``. Slurm and LSF also have ``launch_argv``
    (launch_words.py), the launcher line of job scripts and ``hpcring run``.
    """
    COMMAND: str               # the submission command's name, for messages

    def make_executor(self, site: Any, job: Any, folder: Path, template: str | None, python: str) -> Any: ...
    def rank_command(self, python: str, folder: str) -> str: ...
    def states(self, recs: Sequence["JobRecord"]) -> dict[str, JobState]: ...
    def cancel(self, rec: "JobRecord") -> None: ...
    def queued_at(self, rec: "JobRecord") -> float | None: ...
    def cluster_name(self, site: Any) -> str: ...
    def explain_refusal(self, text: str) -> str | None: ...
    def never_fits(self, site: Any, job: Any) -> str | None: ...
    def first_casualty(self, rec: "JobRecord") -> str | None: ...
    def release(self, rec: "JobRecord") -> None: ...
    def run_on_nodes(self, job_id: str, command: Callable[[str], list[str]],
                     timeout: float) -> tuple[str, str, int, str]: ...
    def end_job_argv(self, environ: Mapping[str, str]) -> list[str] | None: ...
    def annotate_argv(self, headline: str, environ: Mapping[str, str]) -> list[str] | None: ...


def state_dir() -> Path:
    """``<HPCRING_STATE_DIR or ~/.local/state/hpcring>/jobs``, created; an unusable one (a file,
    /dev/null, no permission) is an error naming where it came from."""
    env = os.environ.get("HPCRING_STATE_DIR")
    base = env or os.path.join(os.environ.get("XDG_STATE_HOME", os.path.expanduser("~/.local/state")), "hpcring")
    p = Path(base) / "jobs"
    try:
        p.mkdir(parents=True, exist_ok=True)
        if not p.is_dir():
            raise NotADirectoryError(f"{p} is not a directory")
    except OSError as exc:
        why = exc.strerror or str(exc)
        if env:
            raise UsageError(f"HPCRING_STATE_DIR={env!r} cannot hold job records ({p}: {why})",
                             hint="point HPCRING_STATE_DIR at a writable folder, or unset it") from None
        raise HpcringError(f"cannot keep job records in {p}: {why}",
                           hint="make it writable, or set HPCRING_STATE_DIR to a writable folder") from None
    return p


# A job id or record name: Slurm 38 or 38_2 (array task), LSF 1234, local-38, slurm-devcluster-38.
# Anything else (a path, a glob such as '*', a 5000-character string) never names a record, and
# must not reach the filesystem as part of a file name.
_JOB_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)
MAX_JOB_REF = 200


def check_job_ref(ref: str) -> str:
    """``ref`` if it can be a job id or record name; UsageError otherwise."""
    ref = str(ref)
    why = ("empty" if not ref else f"too long ({len(ref)} characters, at most {MAX_JOB_REF})"
           if len(ref) > MAX_JOB_REF else None if _JOB_REF.fullmatch(ref) else
           "only letters, digits, '.', '_' and '-' (not first) can appear in one")
    if why:
        raise UsageError(f"{shown(ref)} is not a job id or record name: {why}",
                         hint="pass the id `hpcring submit` printed (38, or its record name local-38); "
                              "`hpcring status` lists the newest jobs")
    return ref


def save_record(rec: JobRecord) -> None:
    write_json(state_dir() / f"{rec.key}.json", asdict(rec), indent=1)


def load_record(ref: str) -> JobRecord:
    """The record named ``ref``: a full key (``slurm-devcluster-38``) or a plain id (``38``) when
    only one scheduler/cluster has a job with that id; ``38_2`` (or ``slurm-devcluster-38_2``) is
    task 2 of array job 38."""
    ref = check_job_ref(ref)
    try:
        return _load_record(ref)
    except JobNotFoundError:
        head, sep, index = ref.rpartition("_")
        if not (sep and index.isdigit() and head):
            raise
        try:
            rec = _load_record(head)
        except JobNotFoundError:
            raise JobNotFoundError(f"job {ref} was not submitted through hpcring from this account (no record "
                                   f"{ref} or {head} in {state_dir()})",
                                   hint="check the id with `hpcring status`") from None
        if rec.array is None or int(index) not in rec.array:
            what = (f"its tasks are {format_indices(rec.array)}" if rec.array is not None
                    else "it is not an array job")
            raise UsageError(f"job {head} has no array task {int(index)}: {what}",
                             hint=f"`hpcring status {head}` lists its tasks") from None
        return rec.task(int(index))


def format_indices(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    return rank_ranges(list(indices))


def _load_record(ref: str) -> JobRecord:
    d = state_dir()
    exact = d / f"{ref}.json"
    if "-" in ref and exact.is_file():
        return _read_checked(exact)
    found = sorted(p for p in d.glob(f"*-{ref}.json") if p.stem.rsplit("-", 1)[-1] == ref)
    if exact.is_file():              # a record written before keys existed
        found.append(exact)
    if len(found) > 1:
        keys = ", ".join(p.stem for p in found)
        raise UsageError(f"job id {ref} is ambiguous: {len(found)} jobs have it ({keys})",
                         hint=f"pass the full name, e.g. `hpcring status {found[0].stem}`")
    if not found:
        raise JobNotFoundError(f"job {ref} was not submitted through hpcring from this account "
                               f"(no record {ref} in {d})", hint="check the id with `squeue --me` or `bjobs`")
    return _read_checked(found[0])


def _read_checked(path: Path) -> JobRecord:
    """:func:`_read`, with a damaged or unreadable record as an error naming the file."""
    try:
        return _read(path)
    except (OSError, ValueError, TypeError) as exc:
        raise HpcringError(f"job record {path} cannot be read: {exc}",
                           hint="it was damaged or written by another version; delete it to forget the job") from None


def recent_records(limit: int) -> list[JobRecord]:
    """The ``limit`` most recently submitted jobs' records, newest first (unreadable ones skipped)."""
    recs = []
    for path in state_dir().glob("*.json"):
        try:
            recs.append(_read(path))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(recs, key=lambda r: r.submitted_at, reverse=True)[:max(0, limit)]


def _read(path: Path) -> JobRecord:
    return JobRecord(**json.loads(path.read_text()))


def new_record(job_id: str, scheduler: str, site: str, folder: str, ntasks: int, name: str,
               script: str, cluster: str = "", secret_file: str = "", **array: Any) -> JobRecord:
    """Write and return a new record; ``array``: its ``array``, ``array_limit`` and ``sweep``."""
    rec = JobRecord(job_id=job_id, scheduler=scheduler, site=site, folder=folder, ntasks=ntasks,
                    name=name, script=script, submitted_at=time.time(), cluster=cluster, secret_file=secret_file,
                    **array)
    save_record(rec)
    return rec
