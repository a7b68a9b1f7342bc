"""What every command module shares: the one error wrapper and the --site option.

The library raises one family of exceptions (:class:`hpcring.errors.HpcringError`, each with its
exit code); here, and only here, they become ``error: ...`` on stderr and that exit code.
Nothing else is caught: a bug shows its traceback.
"""
from __future__ import annotations

import functools

import typer

from hpcring.cli import output
from hpcring.config.envvars import check_environ
from hpcring.errors import HpcringError

SITE_HELP = ("Site name or path to a site YAML (default: $HPCRING_SITE, else the site named like the Slurm "
             "cluster you are in, else local).")
SiteOpt = typer.Option(None, "--site", "-s", help=SITE_HELP)


def newest_job():
    """The newest job's record, for commands whose JOB argument was left out (said on stderr)."""
    from hpcring.submit import newest
    rec = newest()
    output.info(f"job {rec.job_id} [{rec.key}] ({rec.name}), the newest")
    return rec


def exit_for(exc: HpcringError) -> typer.Exit:
    """Print ``error: <message>`` for a library error and return the Exit to raise."""
    output.error(str(exc))
    return typer.Exit(exc.exit_code)


def command(target: typer.Typer, *args, **kwargs):
    """Register a command on ``target`` whose HpcringError becomes :func:`exit_for`'s exit."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            try:
                check_environ()   # a bad HPCRING_* value stops here, before any rank starts
                return fn(*a, **kw)
            except HpcringError as exc:
                raise exit_for(exc) from None
        return target.command(*args, **kwargs)(wrapper)
    return deco
