"""What every scheduler module provides, and the job registry the CLI reads.

A scheduler module (slurm.py, lsf.py, local.py) fills a few hooks, submitit-style:
  ``make_executor(site, job, folder, template)`` -> a submitit executor whose submission file is
  our rendered template; ``state(job_id)`` -> JobState; ``cancel(job_id)``; ``COMMAND``, the
  submission command name (for error messages).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcring.errors import JobNotFoundError

# States normalized across schedulers (Slurm's names; LSF and local map onto them).
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@dataclass(frozen=True)
class JobState:
    state: str                 # normalized (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)
    raw: str = ""              # the scheduler's own word, e.g. "CANCELLED by 0" or "EXIT"
    exit_code: int | None = None
    nodes: str = ""

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


def state_dir() -> Path:
    base = os.environ.get("HPCRING_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME", os.path.expanduser("~/.local/state")), "hpcring")
    p = Path(base) / "jobs"
    p.mkdir(parents=True, exist_ok=True)
    return p


def save_record(rec: JobRecord) -> None:
    path = state_dir() / f"{rec.job_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(rec), indent=1))
    os.replace(tmp, path)


def load_record(job_id: str) -> JobRecord:
    path = state_dir() / f"{job_id}.json"
    if not path.is_file():
        raise JobNotFoundError(f"job {job_id} was not submitted through hpcring from this account "
                               f"(no {path})", hint="check the id with `squeue --me` or `bjobs`")
    return JobRecord(**json.loads(path.read_text()))


def new_record(job_id: str, scheduler: str, site: str, folder: str, ntasks: int, name: str,
               script: str) -> JobRecord:
    rec = JobRecord(job_id=job_id, scheduler=scheduler, site=site, folder=folder, ntasks=ntasks,
                    name=name, script=script, submitted_at=time.time())
    save_record(rec)
    return rec
