"""One family of exceptions for the whole library.

The CLI maps them to a message and an exit code; library code never prints or exits. Each error
says what went wrong, where (file and key, rank and host) and, in ``hint``, what to do about it.
"""
from __future__ import annotations


class HpcringError(Exception):
    """Base of every error hpcring raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(HpcringError):
    """A bad flag or argument combination (exit code 2, like any CLI usage error)."""

    exit_code = 2


class InvalidParameterError(UsageError, ValueError):
    """A keyword ``hpcring.Executor.update_parameters`` does not take, or a value of the wrong type
    or out of bounds (a ValueError too, as submitit's own parameter errors are)."""


class ConfigError(HpcringError):
    """A site config is wrong. ``problems`` lists every problem found, one per field."""

    def __init__(self, message: str, problems: list[str] | None = None, *, hint: str | None = None):
        self.problems = list(problems or [])
        full = message
        if self.problems:
            full += "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(full, hint=hint)


class SiteNotFoundError(ConfigError):
    """No site config of that name or path."""


class TemplateError(HpcringError):
    """A job-script template failed to render (undefined variable, syntax error)."""


class SchedulerError(HpcringError):
    """The scheduler refused or failed a command (sbatch, sacct, bsub, ...)."""


class JobNotFoundError(HpcringError):
    """No job with that id is known to hpcring."""


class JobFailedError(HpcringError):
    """A job (or one of its ranks) ended with a failure. ``rank``/``host``: the first failing rank,
    when one is known; ``traceback``: its exception's traceback text (a Python function's job)."""

    def __init__(self, message: str, *, exit_code: int = 1, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.exit_code = exit_code if 0 < exit_code < 256 else 1
        self.rank: int | None = None
        self.host: str | None = None
        self.traceback: str | None = None


class WaitTimeoutError(HpcringError, TimeoutError):
    """A wait given a deadline (``Job.wait(timeout=)``, ``result(timeout=)``) ran out; the job itself
    was left as it was."""


class HostlistError(HpcringError):
    """A malformed Slurm hostlist expression; the message points at the position."""


class BootstrapError(HpcringError):
    """Ranks could not be derived, an interface could not be verified, or rendezvous failed."""


class CollectiveError(HpcringError):
    """A collective failed or missed its deadline; the message names op, peer rank and host."""


class RemoteError(HpcringError):
    """A login node could not be used: unreachable, ssh refused, rsync failed, no hpcring there."""


class DevClusterError(HpcringError):
    """The local dev cluster could not be brought up or down."""


class Preempted(HpcringError):
    """Raised by a training script (after saving its checkpoint) to stop now and be requeued.

    ``hpcring submit`` jobs: every rank raises it at the same step (``hpcring.preempted(comm)``
    agrees on the step); rank 0 then requeues the job through submitit, which restarts it from the
    beginning with ``hpcring.requeue_count()`` one higher. See docs/preemption.md."""
