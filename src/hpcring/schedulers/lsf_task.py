"""What every rank of an LSF job runs first: ``python -m hpcring.schedulers.lsf_task FOLDER``.

LSF has no per-task output files (``bsub -o`` is the batch script's), so this entry sends the
rank's stdout/stderr to ``<folder>/<jobid>_<rank>_log.out/.err`` (HPCRING_LOG_PATTERN from the job
script, ``%j`` = LSB_JOBID, ``%t`` = rank), makes sure submitit finds the LSF job environment
(also when hpcring runs from a checkout whose entry points are not installed), then runs
submitit's task entry, which writes this rank's ``<jobid>_<rank>_result.pkl``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from hpcring.bootstrap.launchers import detect
from hpcring.jobdir import job_id as hpcring_job_id


def log_base(pattern: str, job_id: str, rank: int) -> Path:
    """``/jobs/%j/%j_%t_log`` -> ``/jobs/42/42_3_log``."""
    return Path(pattern.replace("%j", job_id).replace("%J", job_id).replace("%t", str(rank)))


def redirect_output(base: Path) -> None:
    """Point fds 1 and 2 at ``base``.out/.err (append: a requeued job keeps its first run's lines)."""
    base.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, suffix in ((1, ".out"), (2, ".err")):
        f = os.open(f"{base}{suffix}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)


def register_environment() -> None:
    """Make submitit's JobEnvironment() find LsfJobEnvironment even without installed entry points."""
    from submitit.core import plugins

    from hpcring.schedulers.lsf import LsfJobEnvironment  # deferred: pulls submitit (after the output is redirected)
    envs = plugins.get_job_environments()
    if "lsf" not in envs:
        envs["lsf"] = LsfJobEnvironment()  # the cached mapping submitit consults


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hpcring.schedulers.lsf_task FOLDER", file=sys.stderr)
        return 2
    job_id = os.environ.get("LSB_JOBID")
    if not job_id:
        print("hpcring.schedulers.lsf_task: LSB_JOBID is not set: this runs inside an LSF job only",
              file=sys.stderr)
        return 2
    job_id = hpcring_job_id()           # an array task's is <id>_<task>, as its folder
    rank = detect().rank
    pattern = os.environ.get("HPCRING_LOG_PATTERN") or f"{argv[0]}/%j_%t_log"
    redirect_output(log_base(pattern, job_id, rank))
    os.environ["SUBMITIT_EXECUTOR"] = "lsf"
    register_environment()
    from submitit.core.submission import process_job
    process_job(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
