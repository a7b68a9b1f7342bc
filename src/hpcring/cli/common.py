"""What every command module shares: the one error wrapper and the --site option.

The library raises one family of exceptions (:class:`hpcring.errors.HpcringError`, each with its
exit code); here, and only here, they become ``error: ...`` on stderr and that exit code.
Nothing else is caught: a bug shows its traceback.

Every parameter of every command is also made strict here (:func:`strict_params`, applied by
:class:`StrictCommand` and, for sub-apps registered without :func:`command`, :class:`StrictGroup`):
typer reads numbers as Python does, so ``--nodes 1_0`` was 10 nodes and ``--stepfactor nan`` a
number; an empty or blank text value is refused (``--site ""`` was the default site, ``--template ""``
the bundled template). A flag added later gets the same rules without doing anything.
"""
from __future__ import annotations

import functools
from typing import get_args

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from hpcring.cli import output
from hpcring.config.envvars import check_environ
from hpcring.config.jobopts import SITE_HELP
from hpcring.config.text import MAX_TEXT, check_text, parse_float_text, parse_int_text, shown
from hpcring.errors import HpcringError

INT_MAX = 2**63 - 1     # an int flag without a declared max still fits every C and numpy integer

SiteOpt = typer.Option(None, "--site", "-s", help=SITE_HELP)
# what to give instead of an empty value, where the flag's own words say more than the generic hint
_BLANK_HINTS = {"--site": "a site name (`hpcring sites list`) or the path of a site YAML; leave --site out for "
                          "the default ($HPCRING_SITE, else the site named like the Slurm cluster you are in, "
                          "else local)"}


def newest_job():
    """The newest job's record, for commands whose JOB argument was left out (said on stderr)."""
    from hpcring.submit import newest
    rec = newest()
    output.info(f"job {rec.job_id} [{rec.key}] ({rec.name}), the newest")
    return rec


def job_target(job: str, one_task: str):
    """What a JOB argument names: (job record, None) for a job id or record name, (None, folder)
    for a job folder's path (a job run by `hpcring run` has no record, only the folder
    HPCRING_JOB_DIR gave it). ``one_task``: the command's verb for an array's hint ("report", "top")."""
    from pathlib import Path

    from hpcring.errors import UsageError
    try:
        check_text(job)
    except ValueError as exc:
        raise UsageError(f"JOB {shown(job)}: {exc}", hint="pass a job id (`hpcring status` lists them) "
                                                          "or a job folder") from None
    if "/" in job or job in (".", ".."):
        folder = Path(job)
        try:
            ok = folder.is_dir()
        except OSError:
            ok = False
        if not ok:
            raise HpcringError(f"job folder {shown(job)} does not exist or is no folder",
                               hint="pass a job id (`hpcring status` lists them) or the folder `hpcring submit` "
                                    "printed (`<job_dir>/<job id>`)")
        return None, folder
    from hpcring import submit as lib
    rec = lib.record(job)
    if rec.array is not None:
        raise UsageError(f"job {rec.job_id} is an array of {len(rec.array)} tasks, each a whole job",
                         hint=f"one task at a time: `hpcring {one_task} {rec.job_id}_{rec.array[0]}`")
    return rec, None


def exit_for(exc: HpcringError) -> typer.Exit:
    """Print ``error: <message>`` for a library error and return the Exit to raise."""
    output.error(str(exc))
    return typer.Exit(exc.exit_code)


def _strict_value(param, text: str):
    """Check one raw command-line value of ``param`` before typer converts it; raises
    typer.BadParameter (usage error, exit 2, naming the flag) for a value typer would accept but
    hpcring must not."""
    desc = param.type_descriptor
    kind = desc.annotation
    info = desc.parameter_info
    try:
        if kind is int:
            lo = 0 if info.min is None else info.min            # no hpcring count or index is negative
            hi = INT_MAX if info.max is None else info.max
            hint = f"a whole number from {lo} to {hi}, ASCII digits only"
            value = parse_int_text(text)
            if not lo <= value <= hi:
                raise ValueError("out of range")
        elif kind is float:
            hint = "a finite number such as 2, 0.5 or 1e-3"
            parse_float_text(text)          # bounds: typer's own min/max checks follow
        else:
            hint = f"text without line breaks, tabs or other control characters, at most {MAX_TEXT} characters"
            check_text(text)
            if not text.strip():        # `--site ""` is no site: it must not quietly mean the default
                flag = max(param.opts, key=len)
                hint = _BLANK_HINTS.get(flag, f"a value, or leave {flag} out for its default (see --help)")
                raise ValueError("empty")
    except ValueError as exc:
        raise typer.BadParameter(f"{shown(text)}: {exc}\n  hint: give {hint}") from None


def _is_checked(param) -> bool:
    """Numbers everywhere; text only in options (arguments after ``--`` are the user's command
    and script arguments, passed on as given; job ids and paths are checked where they are used)."""
    desc = getattr(param, "type_descriptor", None)
    if desc is None or getattr(param, "is_flag", False):
        return False
    if desc.annotation in (int, float):
        return True
    is_text = desc.annotation is str or get_args(desc.annotation) == (str,)
    return is_text and isinstance(param, TyperOption)


def strict_params(cmd):
    """Make every int, float and text option of ``cmd`` strict (see the module doc); idempotent."""
    for param in getattr(cmd, "params", ()):
        if getattr(param, "_hpcring_strict", False) or not _is_checked(param):
            continue
        convert = param.process_value

        def process_value(ctx, value, _param=param, _convert=convert):
            # raw text from the command line (a tuple for repeatable options); defaults are not text
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, str):
                    try:
                        _strict_value(_param, item)
                    except typer.BadParameter as exc:
                        exc.ctx, exc.param = ctx, _param
                        raise
            return _convert(ctx, value)

        param.process_value = process_value
        param._hpcring_strict = True
    for sub in (getattr(cmd, "commands", None) or {}).values():
        strict_params(sub)
    return cmd


class StrictCommand(TyperCommand):
    """A typer command whose parameters are strict (:func:`strict_params`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        strict_params(self)


class StrictGroup(TyperGroup):
    """The root group: makes every command below it strict, sub-apps registered without
    :func:`command` (``hpcring devcluster``) included."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        strict_params(self)


def command(target: typer.Typer, *args, **kwargs):
    """Register a command on ``target`` whose HpcringError becomes :func:`exit_for`'s exit and
    whose parameters are strict (:class:`StrictCommand`)."""
    kwargs.setdefault("cls", StrictCommand)

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
