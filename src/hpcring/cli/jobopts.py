"""The job options `submit` and `render` share, as typer options, and the typed request they become.

The options themselves (names, kinds, bounds, help) are defined once, in
:data:`hpcring.config.jobopts.OPTIONS`, which ``hpcring.Executor.update_parameters`` reads too.
:func:`job_options` adds them to a command's signature (typer reads signatures) and hands the
command one :class:`JobRequest` instead of fifteen parameters. Precedence is applied later, by
:func:`hpcring.config.jobspec.resolve_job`: CLI > environment > site config > defaults.
Imports nothing heavy: ``hpcring --help`` must stay fast.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import fields
from typing import List, Optional

import typer

from hpcring.config.jobopts import CLI_OPTIONS, TIMEOUT_HELP, JobOption, JobRequest, check_script  # noqa: F401

_KW = inspect.Parameter.KEYWORD_ONLY


def container_of(site, image: Optional[str], mounts: list[str], no_container: Optional[bool]):
    """The job's container (config.container.resolve: CLI > HPCRING_CONTAINER_IMAGE/_MOUNTS > site)."""
    from hpcring.config.container import resolve
    return resolve(site.config.container, image, mounts, no_container, site_name=site.name)


_ANNOTATIONS = {"int": Optional[int], "float": Optional[float], "time": Optional[str], "text": Optional[str],
                "bool": Optional[bool], "list": Optional[List[str]], "flag": bool}


def _typer_option(o: JobOption):
    """(annotation, typer option) of one option of the table; bounds as typer's min/max, which
    cli/common.py's strict reading checks before typer converts."""
    bounds = {"min": int(o.lo), "max": int(o.hi)} if o.kind == "int" else {}
    return _ANNOTATIONS[o.kind], typer.Option(False if o.kind == "flag" else None, *o.decls, help=o.help, **bounds)


# name -> (annotation, typer option); the order is the order in --help
_OPTIONS = {o.name: _typer_option(o) for o in CLI_OPTIONS}
_ARGUMENTS = {
    "script": (str, typer.Argument(..., help="Python script each rank runs.")),
    "args": (Optional[List[str]], typer.Argument(None, help="Arguments for the script (after --).")),
}
_LISTS = ("args", *(o.name for o in CLI_OPTIONS if o.kind == "list"))   # repeatable: a list, never None
assert set(_OPTIONS) | set(_ARGUMENTS) == {f.name for f in fields(JobRequest)}


def job_options(fn):
    """Decorate ``fn(req: JobRequest, **own_options)``: the command gets SCRIPT, ARGS and every
    job option, and ``fn`` one JobRequest built from them."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name != "req"]
    added = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=a)
             for n, (a, d) in _ARGUMENTS.items()]
    added += [inspect.Parameter(n, _KW, default=d, annotation=a) for n, (a, d) in _OPTIONS.items()]
    names = [p.name for p in added]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update({k: kwargs.pop(k) for k in list(kwargs) if k in names})
        values = {k: v for k, v in bound.items() if v is not None}
        req = JobRequest(**{**values, **{k: list(bound.get(k) or []) for k in _LISTS}})
        return fn(req=req, **kwargs)
    wrapper.__signature__ = sig.replace(parameters=added[:2] + [p.replace(kind=_KW) for p in own] + added[2:])
    wrapper.__annotations__ = {**{n: a for n, (a, _) in {**_ARGUMENTS, **_OPTIONS}.items()},
                               **{p.name: p.annotation for p in own}}
    return wrapper
