"""One small module per scheduler; ``get(name)`` returns it (a :class:`base.Scheduler`)."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpcring.errors import ConfigError, HpcringError

if TYPE_CHECKING:
    from hpcring.schedulers.base import Scheduler
from hpcring.jobdir import job_id


def get(name: str) -> "Scheduler":
    if name == "slurm":
        from hpcring.schedulers import slurm as mod  # deferred: pulls submitit, jinja2, pydantic
    elif name == "local":
        from hpcring.schedulers import local as mod  # deferred: pulls submitit, jinja2, pydantic
    elif name == "lsf":
        try:
            from hpcring.schedulers import lsf as mod  # deferred: pulls submitit, jinja2, pydantic
        except ImportError:
            raise ConfigError("the LSF scheduler backend is not available in this build",
                              hint="use a Slurm or local site") from None
    else:
        raise ConfigError(f"unknown scheduler {name!r}")
    return mod


# A rank asks on its way to a report: a node cut off from slurmctld must not wait out scontrol's
# message timeout (10 s and more) before it says what it saw. (LSF keeps the command bound: the
# emulation's bjobs is a Python program that a loaded host starts slowly.)
RUN_ENDING_TIMEOUT = 3.0


def run_ending(environ: Mapping[str, str], timeout: float = RUN_ENDING_TIMEOUT) -> str | None:
    """Inside a job: why the scheduler is ending this run (requeue, cancel, time limit), or None
    while it runs, or when nothing can tell (no scheduler, or it does not answer). A rank asks
    before it reports a collective failure: a peer that the scheduler stopped is not one."""
    try:
        if environ.get("SLURM_JOB_ID"):
            from hpcring.schedulers import slurm  # deferred: pulls submitit, jinja2, pydantic
            count = environ.get("SLURM_RESTART_COUNT", "0")
            return slurm.run_ending(environ["SLURM_JOB_ID"], int(count) if count.isdigit() else 0, timeout)
        if environ.get("LSB_JOBID"):
            # job_id: an array element's is <id>_<task>; bjobs has its own, longer bound
            return get("lsf").run_ending(job_id(environ))
    except HpcringError:
        return None
    return None


def _of_environment(environ: Mapping[str, str]) -> str | None:
    """The scheduler this process runs under, from its environment (None: none or the local backend,
    whose supervisor ends its ranks itself)."""
    if environ.get("SLURM_JOB_ID"):
        return "slurm"
    if environ.get("LSB_JOBID"):
        return "lsf"
    return None


def end_job_argv(environ: Mapping[str, str]) -> list[str] | None:
    """Inside a job: the command that ends every rank of it, or None where a supervisor does it."""
    name = _of_environment(environ)
    return get(name).end_job_argv(environ) if name else None


def annotate_argv(headline: str, environ: Mapping[str, str]) -> list[str] | None:
    """Inside a job: the command that writes ``headline`` into the scheduler's record of it, or None."""
    name = _of_environment(environ)
    return get(name).annotate_argv(headline, environ) if name else None


def end_job(rank: int, argv: list[str], annotate: list[str] | None, timeout: float) -> None:
    """Run ``annotate`` (bounded) then ``argv``; never raises. scancel is started, not waited for:
    run from inside the step it ends, it kills its own caller, and while the step is already being
    torn down it may not return at all (diagnostics/teardown.py)."""
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    for cmd in (annotate, argv):
        if cmd is None:
            continue
        try:
            if cmd is argv and argv[0] == "scancel":   # no descriptor inherited
                subprocess.Popen(cmd, start_new_session=True, close_fds=True, **quiet)
            else:                  # the Comment first: Slurm refuses to update a finished job; bkill only asks
                subprocess.run(cmd, timeout=timeout, check=False, **quiet)
        except (OSError, subprocess.SubprocessError) as exc:   # the launcher's own kill still applies
            print(f"hpcring: rank {rank}: could not run {cmd[0]}: {exc}", file=sys.stderr, flush=True)
