"""One small module per scheduler; ``get(name)`` returns it."""
from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from hpcring.errors import ConfigError


def get(name: str) -> ModuleType:
    if name == "slurm":
        from hpcring.schedulers import slurm as mod
    elif name == "local":
        from hpcring.schedulers import local as mod
    elif name == "lsf":
        try:
            from hpcring.schedulers import lsf as mod
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
    from hpcring.errors import HpcringError
    try:
        if environ.get("SLURM_JOB_ID"):
            from hpcring.schedulers import slurm
            count = environ.get("SLURM_RESTART_COUNT", "0")
            return slurm.run_ending(environ["SLURM_JOB_ID"], int(count) if count.isdigit() else 0, timeout)
        if environ.get("LSB_JOBID"):
            return get("lsf").run_ending(environ["LSB_JOBID"])   # bjobs: its own, longer bound
    except HpcringError:
        return None
    return None
