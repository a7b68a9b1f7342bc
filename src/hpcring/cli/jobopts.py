"""The job options `submit` and `render` share, defined once, and the typed request they become.

:func:`job_options` adds the options to a command's signature (typer reads signatures) and hands
the command one :class:`JobRequest` instead of fifteen parameters. Precedence is applied later,
by :func:`hpcring.config.jobspec.resolve_job`: CLI > environment > site config > defaults.
Imports nothing heavy: ``hpcring --help`` must stay fast.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, fields
from typing import List, Optional

import typer

from hpcring.cli.common import SITE_HELP
from hpcring.config.envvars import MAX_CPUS_PER_TASK, MAX_GPUS_PER_NODE, MAX_NODES, MAX_TASKS_PER_NODE

_KW = inspect.Parameter.KEYWORD_ONLY
# bounds are checked by config.jobspec (one message for the flag, the variable and the site key)
TIMEOUT_HELP = ("Deadline of every collective, seconds, > 0 (default: HPCRING_TIMEOUT, else the site's "
                "timeout, else 300); reaches the ranks as HPCRING_TIMEOUT.")


@dataclass(frozen=True)
class JobRequest:
    """What the user asked for on the command line (None: not given)."""
    script: str
    args: list[str] = field(default_factory=list)
    site: Optional[str] = None
    nodes: Optional[int] = None
    tasks_per_node: Optional[int] = None
    gpus_per_node: Optional[int] = None
    cpus_per_task: Optional[int] = None
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclusive: Optional[bool] = None
    name: Optional[str] = None
    timeout: Optional[float] = None      # the collective deadline, s (HPCRING_TIMEOUT in the ranks)
    sched_arg: list[str] = field(default_factory=list)
    template: Optional[str] = None
    container_image: Optional[str] = None
    container_mounts: list[str] = field(default_factory=list)
    no_container: Optional[bool] = None
    no_node_history: Optional[bool] = None   # nodehistory.leave_out: ignore the site's node history this once
    verbose: bool = False
    array: Optional[str] = None          # config/arrays.py: indices, sweeps, dependencies
    sweep: list[str] = field(default_factory=list)
    dependency: Optional[str] = None
    after: list[str] = field(default_factory=list)

    # the JobSpec fields the CLI can set (resolve_job's ``cli`` mapping)
    SPEC_FIELDS = ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "time", "partition",
                   "account", "qos", "constraint", "name", "timeout")

    def resolve(self):
        """(site, job spec): the site config loaded and every value merged by precedence."""
        from hpcring.config.jobspec import resolve_job
        from hpcring.config.site import load_site
        site = load_site(self.site)
        cli = {k: getattr(self, k) for k in self.SPEC_FIELDS}
        job = resolve_job(site, self.script, list(self.args), cli, sched_args=list(self.sched_arg),
                          exclusive=self.exclusive, array=self.array, sweep=list(self.sweep),
                          dependency=self.dependency, after=list(self.after))
        check_script(self.script)      # render and --dry-run too: a preview of a job that cannot run misleads
        job.container = container_of(site, self.container_image, self.container_mounts, self.no_container)
        if job.container is not None:
            job.sources.update(dict(job.container.sources))
        return site, job


def container_of(site, image: Optional[str], mounts: list[str], no_container: Optional[bool]):
    """The job's container (config.container.resolve: CLI > HPCRING_CONTAINER_IMAGE/_MOUNTS > site)."""
    from hpcring.config.container import resolve
    return resolve(site.config.container, image, mounts, no_container, site_name=site.name)


def check_script(script: str) -> None:
    """SCRIPT names a readable file; else a UsageError saying what it is instead."""
    import os
    from pathlib import Path

    from hpcring.config.envvars import check_text, shown
    from hpcring.errors import UsageError
    hint = "pass the path of the Python script each rank runs"
    try:
        check_text(script)
        path = Path(script)
        if path.is_dir():
            raise UsageError(f"script {shown(script)} is a directory, not a Python script", hint=hint)
        if not path.is_file():
            raise UsageError(f"script {shown(script)} does not exist (cwd {os.getcwd()})", hint=hint)
        if not os.access(path, os.R_OK):
            raise UsageError(f"script {shown(script)} is not readable", hint="check its permissions")
    except (ValueError, OSError) as exc:          # control characters, a name too long for the OS
        raise UsageError(f"script {shown(script)}: {exc}", hint=hint) from None


# name -> (annotation, typer option); the order is the order in --help
_OPTIONS = {
    "site": (Optional[str], typer.Option(None, "--site", "-s", help=SITE_HELP)),
    "nodes": (Optional[int], typer.Option(None, "--nodes", "-N", min=1, max=MAX_NODES, help="Number of nodes.")),
    "tasks_per_node": (Optional[int], typer.Option(None, "--tasks-per-node", min=1, max=MAX_TASKS_PER_NODE,
                                                   help="Ranks per node (default: one per GPU, else 1).")),
    "gpus_per_node": (Optional[int], typer.Option(None, "--gpus-per-node", min=0, max=MAX_GPUS_PER_NODE,
                                                  help="GPUs per node.")),
    "cpus_per_task": (Optional[int], typer.Option(None, "--cpus-per-task", min=1, max=MAX_CPUS_PER_TASK,
                                                  help="CPUs per rank.")),
    "time": (Optional[str], typer.Option(None, "--time", "-t",
                                         help="Time limit: minutes, HH:MM:SS or D-HH:MM:SS.")),
    "partition": (Optional[str], typer.Option(None, "--partition", "-p", help="Partition (Slurm) or queue (LSF).")),
    "account": (Optional[str], typer.Option(None, "--account", "-A", help="Account or project to charge.")),
    "qos": (Optional[str], typer.Option(None, "--qos", help="Quality of service.")),
    "constraint": (Optional[str], typer.Option(None, "--constraint", "-C", help="Node features.")),
    "exclusive": (Optional[bool], typer.Option(None, "--exclusive/--shared", help="Whole nodes.")),
    "name": (Optional[str], typer.Option(None, "--name", "-J", help="Job name (default: script name).")),
    "timeout": (Optional[float], typer.Option(None, "--timeout", help=TIMEOUT_HELP)),
    "sched_arg": (Optional[List[str]], typer.Option(None, "--sched-arg",
                                                    help="Extra scheduler flag, passed through (repeatable).")),
    "template": (Optional[str], typer.Option(None, "--template", help="Own job-script template (.j2).")),
    "container_image": (Optional[str], typer.Option(None, "--container-image",
                                                    help="Run every rank in this image (the site's container runtime).")),
    "container_mounts": (Optional[List[str]], typer.Option(None, "--container-mounts",
                                                           help="SRC[:DST[:OPTS]],... added to the site's mounts.")),
    "no_container": (Optional[bool], typer.Option(None, "--no-container", help="Run the ranks on the host.")),
    "no_node_history": (Optional[bool], typer.Option(None, "--no-node-history",
                                                     help="Use nodes the site's node history leaves out (blamed "
                                                          "by failed jobs again and again; `hpcring nodes list`).")),
    "verbose": (bool, typer.Option(False, "--verbose", "-v", help="Show where each setting came from.")),
    "array": (Optional[str], typer.Option(None, "--array", "-a",
                                          help="A job array: indices 0-15, 0-15:2, 1,3,8, each with %N to run at "
                                               "most N at once; every task is the whole job (HPCRING_ARRAY_TASK).")),
    "sweep": (Optional[List[str]], typer.Option(None, "--sweep", help="NAME=V1,V2: one array task per combination of "
                                                "all --sweep values, passed as --NAME VALUE (repeatable).")),
    "dependency": (Optional[str], typer.Option(None, "--dependency", "-d",
                                               help="Start after other jobs: afterok|afterany|afternotok|after:JOB[:JOB].")),
    "after": (Optional[List[str]], typer.Option(None, "--after", help="Start after JOB completed (afterok; repeatable).")),
}
_ARGUMENTS = {
    "script": (str, typer.Argument(..., help="Python script each rank runs.")),
    "args": (Optional[List[str]], typer.Argument(None, help="Arguments for the script (after --).")),
}
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
        req = JobRequest(**{**values, "args": list(bound.get("args") or []),
                            "sched_arg": list(bound.get("sched_arg") or []),
                            "sweep": list(bound.get("sweep") or []), "after": list(bound.get("after") or [])})
        return fn(req=req, **kwargs)
    wrapper.__signature__ = sig.replace(parameters=added[:2] + [p.replace(kind=_KW) for p in own] + added[2:])
    wrapper.__annotations__ = {**{n: a for n, (a, _) in {**_ARGUMENTS, **_OPTIONS}.items()},
                               **{p.name: p.annotation for p in own}}
    return wrapper
