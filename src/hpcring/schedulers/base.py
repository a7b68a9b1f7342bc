"""What every scheduler module provides, and the job registry the CLI reads.

A scheduler module (slurm.py, lsf.py, local.py) fills a few hooks, submitit-style:
  ``make_executor(site, job, folder, template)`` -> a submitit executor whose submission file is
  our rendered template; ``state(job_id)`` -> JobState; ``cancel(job_id)``; ``COMMAND``, the
  submission command name (for error messages); Slurm and LSF also ``launch_argv(site, request)``,
  the line that starts the ranks (launch_words.py), used by job scripts and ``hpcring run``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcring.errors import HpcringError, JobNotFoundError, SchedulerError, UsageError
from hpcring.fsutil import write_json

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

    @property
    def key(self) -> str:
        """The record's name: ``slurm-<cluster>-<id>``, ``lsf-<cluster>-<id>``, ``local-<id>``.

        Ids of different schedulers and clusters overlap (local job 38, Slurm job 38); the key
        does not."""
        return "-".join(p for p in (self.scheduler, self.cluster if self.scheduler != "local" else "",
                                    self.job_id) if p)


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
    from hpcring.config.envvars import shown
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
    only one scheduler/cluster has a job with that id."""
    ref = check_job_ref(ref)
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
               script: str, cluster: str = "", secret_file: str = "") -> JobRecord:
    rec = JobRecord(job_id=job_id, scheduler=scheduler, site=site, folder=folder, ntasks=ntasks,
                    name=name, script=script, submitted_at=time.time(), cluster=cluster, secret_file=secret_file)
    save_record(rec)
    return rec
