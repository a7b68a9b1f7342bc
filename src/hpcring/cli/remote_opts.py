"""``--remote [user@]host[:port]``: run a command on a login node over ssh (hpcring.remote).

The login node gets the command line the user typed, rebuilt from what click parsed (so every
flag, present and future, travels without a list here), less ``--remote``: ``submit`` with the
script named inside the copied folder, ``status``/``logs``/``cancel``/``stacks`` with the job's
record name there. Imports nothing heavy.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperArgument

try:
    from click import get_current_context
except ImportError:                   # typer 0.2x carries its own copy of click
    from typer._click.globals import get_current_context

REMOTE_HELP = ("Run on this login node over ssh: user@host:port (user@ and :port optional; default: "
               "$HPCRING_REMOTE, else the site's remote: section; `none`: here). See docs/remote.md.")


def remote_option():
    return typer.Option(None, "--remote", help=REMOTE_HELP)


def _long(opts) -> str:
    return next((o for o in opts if o.startswith("--")), opts[0])


def command_words(ctx, replace: dict | None = None, drop=("remote",)) -> list[str]:
    """The command's arguments as the user gave them (options in long form, positionals, then
    ``--`` and the script's arguments), with ``replace``'s values for the named parameters."""
    replace = replace or {}
    opts: list[str] = []
    positional: list[str] = []
    rest: list[str] = []
    for p in ctx.command.params:
        if p.name in drop:
            continue
        value = replace.get(p.name, ctx.params.get(p.name))
        if isinstance(p, TyperArgument):
            if value is None:
                continue
            if p.nargs == -1:
                rest += [str(v) for v in value]
            else:
                positional.append(str(value))
            continue
        if value is None or value == p.default or value in ((), []):
            continue
        if p.is_flag:
            if p.secondary_opts:          # --exclusive/--shared
                opts.append(_long(p.opts) if value else _long(p.secondary_opts))
            elif value:
                opts.append(_long(p.opts))
            continue
        for v in (value if p.multiple else [value]):
            opts += [_long(p.opts), str(v)]
    return opts + positional + (["--", *rest] if rest else [])


def _site_word(site, cli_site: Optional[str]) -> Optional[str]:
    """What --site the login node gets: the site's name when the laptop's came from a file path or
    HPCRING_SITE (its hpcring looks the name up in its own site folders), else nothing."""
    chosen = cli_site if cli_site is not None else (os.environ.get("HPCRING_SITE") or "").strip() or None
    if chosen is None:
        return None
    return site.name if (os.sep in chosen or chosen.endswith((".yaml", ".yml"))) else chosen


def submit_remote(req, remote: Optional[str]) -> bool:
    """``hpcring submit`` on the login node when one is named (flag, environment, site); True when
    it ran there (its non-zero exit code raised as typer.Exit), False to submit here."""
    from hpcring import remote as lib
    from hpcring.cli.jobopts import check_script
    from hpcring.config.site import load_site
    site = load_site(req.site)
    target = lib.resolve(remote, site)
    if target is None:
        return False
    check_script(req.script)
    ctx = get_current_context()
    words = command_words(ctx, replace={"script": Path(req.script).name,
                                        "site": _site_word(site, req.site)})
    from hpcring.cli import output
    output.info(f"submitting through {target.where} ({target.source}): copying {Path(req.script).resolve().parent}")
    with _interrupted(target):
        code = lib.submit(target, Path(req.script), words, stream=bool(ctx.params.get("wait")))
    if code:
        raise typer.Exit(code)
    return True


@contextlib.contextmanager
def _interrupted(target):
    """Ctrl-C stops the ssh here (and so the following), not the job on the cluster: say so."""
    try:
        yield
    except KeyboardInterrupt:
        from hpcring.cli import output
        output.info(f"\nstopped; anything already submitted keeps running on {target.where} "
                    "(`hpcring status JOB` and `hpcring cancel JOB` from here reach it)")
        raise typer.Exit(130) from None


def _newest_here() -> float:
    from hpcring.schedulers.base import recent_records
    recs = recent_records(1)
    return recs[0].submitted_at if recs else 0.0


def _not_also_here(job: str, there: str, target) -> None:
    """A plain id that names a job here too is ambiguous: say so rather than guess."""
    from hpcring.errors import HpcringError, UsageError
    from hpcring.schedulers.base import load_record
    if job == there:
        return
    try:
        here = load_record(job)
    except HpcringError:
        return
    raise UsageError(f"job {job} is ambiguous: {here.key} here and {there} on {target.where}",
                     hint=f"name it by its record: `{here.key}` or `{there}`")


def remote_aware(job_param: str = "job_id", follows: tuple[str, ...] = ("follow",), newest: bool = False):
    """Decorate a job command (status, logs, cancel, stacks) with ``--remote``: with a login node
    named (flag, HPCRING_REMOTE, or a job submitted from here with --remote), the command runs
    there and its output and exit code are passed on. ``newest``: without JOB the command means
    the newest job, which may be one submitted from here with --remote."""
    def deco(fn):
        sig = inspect.signature(fn)
        extra = inspect.Parameter("remote", inspect.Parameter.KEYWORD_ONLY, default=remote_option(),
                                  annotation=Optional[str])

        @functools.wraps(fn)
        def wrapper(*args, remote: Optional[str] = None, **kwargs):
            from hpcring import remote as lib
            ctx = get_current_context()
            job = ctx.params.get(job_param)
            target, replace = None, {}
            if remote is not None or (os.environ.get(lib.ENV_REMOTE) or "").strip():
                from hpcring.config.site import load_site     # its remote: section's ssh options
                target = lib.resolve(remote, load_site(None))
            elif job is not None:
                found = lib.recalled(job)     # a job submitted from here with --remote
                if found:
                    target, replace[job_param] = found
                    _not_also_here(job, found[1], target)
            elif newest:
                found = lib.newest_remembered(_newest_here())
                if found:
                    target, replace[job_param] = found
                    from hpcring.cli import output
                    output.info(f"job {found[1]} on {target.where}, the newest")
            if target is None:
                return fn(*args, **kwargs)
            own = ctx.params.get("timeout")   # stacks --timeout: the remote collection's own deadline
            timeout = None if any(ctx.params.get(f) for f in follows) else \
                max(lib.COMMAND_TIMEOUT_S, own + 60 if isinstance(own, (int, float)) else 0)
            with _interrupted(target):
                code = lib.forward(target, [ctx.command.name or ctx.info_name, *command_words(ctx, replace)],
                                   timeout=timeout)
            if code:
                raise typer.Exit(code)

        wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), extra])
        wrapper.__annotations__ = {**fn.__annotations__, "remote": Optional[str]}
        return wrapper
    return deco
