"""The job options, defined once: what ``hpcring submit``/``render`` take as flags and
``hpcring.Executor.update_parameters`` takes as keywords, under the same names.

:data:`OPTIONS` is the one table. Each :class:`JobOption` says its Python name (the flag is that
name with ``-`` for ``_``), its kind, its bounds and its help; ``cli/jobopts.py`` turns it into
typer options, ``hpcring.executor`` into ``update_parameters``' valid names, and
:class:`JobRequest` (what either side asked for) is generated from it. Precedence is applied once,
later, by :func:`hpcring.config.jobspec.resolve_job` (given value > environment > site > default),
whichever side gave the value.

Values reach this module as text from the command line (typer converts them; ``cli/common.py``
makes that strict) or as Python objects from ``update_parameters``: :func:`check_value` refuses a
Python value of the wrong type, then both sides meet the same checks (``jobspec.parse_field``:
bounds, time syntax, deadlines, control characters, blank text).

Standard library only: the CLI imports this at start-up.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, make_dataclass
from typing import Any, List, Optional

from hpcring.config.arrays import MAX_ARRAY_TASKS
from hpcring.config.envvars import (MAX_CPUS_PER_TASK, MAX_GPUS_PER_NODE, MAX_NODES, MAX_TASKS_PER_NODE,
                                    MAX_TIMEOUT)
from hpcring.config.text import MAX_TEXT, control_character, shown, check_text
from hpcring.errors import InvalidParameterError, UsageError
from hpcring.config.container import ENV_IMAGE, ENV_MOUNTS, ENV_NONE, resolve as container_resolve

SITE_HELP = ("Site name or path to a site YAML (default: $HPCRING_SITE, else the site named like the Slurm "
             "cluster you are in, else local).")
TIMEOUT_HELP = ("Deadline of every collective, seconds, > 0 (default: HPCRING_TIMEOUT, else the site's "
                "timeout, else 300); reaches the ranks as HPCRING_TIMEOUT.")

KINDS = ("int", "float", "time", "text", "bool", "list", "flag")


@dataclass(frozen=True)
class JobOption:
    """One job option.

    ``kind``: ``int`` (a whole number in ``lo..hi``), ``float`` (finite, > ``lo``, <= ``hi``),
    ``time`` (a Slurm time limit: text, or whole minutes from Python), ``text``, ``bool`` (a
    switch that may be left unset), ``list`` (repeatable text), ``flag`` (CLI only, False unless
    given). ``decls``: typer's declarations (``--exclusive/--shared`` for a switch with an off
    form); empty: no flag (a Python-only parameter). ``spec``: a JobSpec field that
    ``resolve_job`` applies by precedence. ``python``: ``update_parameters`` takes it; else
    ``python_hint`` says what to do in Python instead.
    """

    name: str
    kind: str
    decls: tuple[str, ...]
    help: str
    lo: float | None = None
    hi: float | None = None
    spec: bool = False
    python: bool = True
    python_hint: str = ""

    @property
    def flag(self) -> str | None:
        """The long flag (``--tasks-per-node``), or None for a Python-only parameter."""
        return self.decls[0].split("/")[0] if self.decls else None

    @property
    def cli(self) -> bool:
        return bool(self.decls)

    def allowed(self) -> str:
        """What a value must be, in words (messages and docs)."""
        if self.kind == "int":
            return f"a whole number (int) from {_num(self.lo)} to {_num(self.hi)}"
        if self.kind == "float":
            return f"a finite number (int or float) > {_num(self.lo)} and <= {_num(self.hi)}"
        if self.kind == "time":
            return "a time limit: whole minutes (int) or Slurm's MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]] (str)"
        if self.kind == "bool":
            return "True or False"
        if self.kind == "list":
            return f"a str or a list of str, each one line of at most {MAX_TEXT} characters"
        return f"a non-empty str of one line, at most {MAX_TEXT} characters"


def _num(x: float | None) -> str:
    return "?" if x is None else str(int(x)) if float(x).is_integer() else f"{x:g}"


def _o(name: str, kind: str, decls: tuple[str, ...], help: str, **kw) -> JobOption:
    return JobOption(name, kind, decls, help, **kw)


_ARRAYS = "map_array(fn, *iterables) instead: one task per item"
# The order is the order of --help. Bounds are the job-size bounds of config/envvars (shared with the
# environment and the site schema); jobspec.parse_field checks every source against them.
OPTIONS: tuple[JobOption, ...] = (
    _o("site", "text", ("--site", "-s"), SITE_HELP, python=False,
       python_hint="give the site to the constructor: hpcring.Executor(site=...)"),
    _o("nodes", "int", ("--nodes", "-N"), "Number of nodes.", lo=1, hi=MAX_NODES, spec=True),
    _o("spare_nodes", "int", ("--spare-nodes",),
       "Nodes held beside --nodes: with --max-restarts, a node fault restarts the job inside the allocation on "
       "them (no queue; the job script's step loop).", lo=0, hi=MAX_NODES, spec=True),
    _o("min_nodes", "int", ("--min-nodes",),
       "With no spare left, restart inside the allocation on as few as this many nodes (the world size shrinks).",
       lo=1, hi=MAX_NODES, spec=True),
    _o("max_restarts", "int", ("--max-restarts",),
       "After a node-level fault (a rank dead or unreachable, a stalled link, NODE_FAIL): with --spare-nodes or "
       "--min-nodes, restart inside the allocation on the healthy nodes; with --wait, resubmit excluding the "
       "blamed nodes; at most N times (HPCRING_MAX_RESTARTS; site defaults.max_restarts).", lo=0, hi=100),
    _o("tasks_per_node", "int", ("--tasks-per-node",), "Ranks per node (default: one per GPU, else 1).",
       lo=1, hi=MAX_TASKS_PER_NODE, spec=True),
    _o("gpus_per_node", "int", ("--gpus-per-node",), "GPUs per node.", lo=0, hi=MAX_GPUS_PER_NODE, spec=True),
    _o("cpus_per_task", "int", ("--cpus-per-task",), "CPUs per rank.", lo=1, hi=MAX_CPUS_PER_TASK, spec=True),
    _o("time", "time", ("--time", "-t"), "Time limit: minutes, HH:MM:SS or D-HH:MM:SS.", spec=True),
    _o("partition", "text", ("--partition", "-p"), "Partition (Slurm) or queue (LSF).", spec=True),
    _o("account", "text", ("--account", "-A"), "Account or project to charge.", spec=True),
    _o("qos", "text", ("--qos",), "Quality of service.", spec=True),
    _o("constraint", "text", ("--constraint", "-C"), "Node features.", spec=True),
    _o("exclusive", "bool", ("--exclusive/--shared",), "Whole nodes."),
    _o("name", "text", ("--name", "-J"), "Job name (default: script name).", spec=True),
    _o("timeout", "float", ("--timeout",), TIMEOUT_HELP, lo=0, hi=MAX_TIMEOUT, spec=True),
    _o("sched_arg", "list", ("--sched-arg",), "Extra scheduler flag, passed through (repeatable)."),
    _o("template", "text", ("--template",), "Own job-script template (.j2)."),
    _o("container_image", "text", ("--container-image",),
       "Run every rank in this image (the site's container runtime)."),
    _o("container_mounts", "list", ("--container-mounts",), "SRC[:DST[:OPTS]],... added to the site's mounts."),
    _o("no_container", "bool", ("--no-container",), "Run the ranks on the host."),
    _o("preflight", "bool", ("--preflight/--no-preflight",),
       "Before the script, every node runs a gang check of at most 30 s (versions, all pairs connect on the "
       "chosen interface, ring link bandwidth, GPUs); a failing node is left out, a spare taking its place "
       "(HPCRING_PREFLIGHT; site defaults.preflight)."),
    _o("no_node_history", "bool", ("--no-node-history",),
       "Use nodes the site's node history leaves out (blamed by failed jobs again and again; "
       "`hpcring nodes list`)."),
    _o("verbose", "flag", ("--verbose", "-v"), "Show where each setting came from.", python=False,
       python_hint="the sources of each value are in the resolved job: Executor.render() shows the script"),
    _o("array", "text", ("--array", "-a"),
       "A job array: indices 0-15, 0-15:2, 1,3,8, each with %N to run at most N at once; every task is the "
       "whole job (HPCRING_ARRAY_TASK).", python=False, python_hint=_ARRAYS + "; array_parallelism=N is %N"),
    _o("sweep", "list", ("--sweep",), "NAME=V1,V2: one array task per combination of all --sweep values, "
       "passed as --NAME VALUE (repeatable).", python=False, python_hint=_ARRAYS),
    _o("dependency", "text", ("--dependency", "-d"),
       "Start after other jobs: afterok|afterany|afternotok|after:JOB[:JOB]."),
    _o("after", "list", ("--after",), "Start after JOB completed (afterok; repeatable)."),
    # Python only: --array's %N (the CLI writes the limit inside --array)
    _o("array_parallelism", "int", (), "map_array: at most this many tasks at once (--array's %N).",
       lo=1, hi=MAX_ARRAY_TASKS),
)
BY_NAME: dict[str, JobOption] = {o.name: o for o in OPTIONS}
CLI_OPTIONS = tuple(o for o in OPTIONS if o.cli)
PYTHON_OPTIONS = tuple(o for o in OPTIONS if o.python)
SPEC_FIELDS = tuple(o.name for o in OPTIONS if o.spec)    # resolve_job's ``given`` mapping
INT_BOUNDS = {o.name: (int(o.lo), int(o.hi)) for o in OPTIONS if o.spec and o.kind == "int"}
assert all(o.kind in KINDS for o in OPTIONS) and all(o.python or o.python_hint for o in OPTIONS)

# submitit's own names, which a submitit user will try first: what they are here
SUBMITIT_NAMES = {
    "timeout_min": "the time limit is time= (whole minutes or HH:MM:SS); timeout= is hpcring's collective "
                   "deadline in seconds",
    "slurm_time": "the time limit is time=", "slurm_partition": "partition=", "slurm_account": "account=",
    "slurm_qos": "qos=", "slurm_constraint": "constraint=", "slurm_job_name": "name=",
    "slurm_array_parallelism": "array_parallelism=", "slurm_additional_parameters": "sched_arg=['--flag=value']",
    "slurm_exclusive": "exclusive=", "ntasks_per_node": "tasks_per_node=", "slurm_ntasks_per_node": "tasks_per_node=",
    "gpus_per_task": "gpus_per_node= (hpcring gives each local rank one GPU)",
    "slurm_gpus_per_node": "gpus_per_node=", "mem_gb": "no memory option: sched_arg=['--mem=16G'] on Slurm",
    "slurm_mem": "no memory option: sched_arg=['--mem=16G'] on Slurm",
}


def where(name: str, value: Any) -> str:
    """How a Python-given value is named in messages: ``update_parameters(nodes=0)``."""
    return f"update_parameters({name}={shown(value)})"


def check_value(name: str, value: Any, at: str | None = None) -> Any:
    """A value given to ``update_parameters`` for option ``name``, of the right Python type and,
    for what is not a JobSpec field, one line of text; returns it normalised (a list for ``list``,
    ``int`` for numbers). JobSpec fields then go through ``jobspec.parse_field`` as every other
    source does. Raises InvalidParameterError naming the parameter, the value and what it must be;
    ``at`` names where the value was given (default :func:`where`: ``update_parameters(nodes=0)``)."""
    opt = BY_NAME[name]
    at = where(name, value) if at is None else at

    def refuse(why: str) -> InvalidParameterError:
        return InvalidParameterError(f"{at}: {why}; {name} must be {opt.allowed()}",
                                     hint=f"{opt.help} Same as the CLI's {opt.flag}." if opt.flag else opt.help)
    kind = opt.kind
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise refuse(f"not a whole number ({type(value).__name__})")
        value = int(value)
        if not opt.lo <= value <= opt.hi:
            raise refuse("out of range")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise refuse(f"not a number ({type(value).__name__})")
        return float(value)            # finite and in bounds: parse_field (envvars.check_number)
    if kind == "time":
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
            raise refuse(f"not minutes or a time string ({type(value).__name__})")
        return int(value) if isinstance(value, numbers.Integral) else _text(value, refuse)
    if kind == "bool":
        if not isinstance(value, bool):
            raise refuse(f"not a bool ({type(value).__name__})")
        return value
    if kind == "list":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise refuse(f"not a str or a list of str ({type(value).__name__})")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise refuse(f"item {i} is not a str ({type(item).__name__})")
            _text(item, refuse, f"item {i} ")
        return list(items)
    if not isinstance(value, str):
        raise refuse(f"not a str ({type(value).__name__})")
    return _text(value, refuse)


def _text(value: str, refuse, what: str = "") -> str:
    """One line of text, as the CLI's strict flags take it (cli/common.py): no control character,
    not blank, at most MAX_TEXT characters."""
    bad = control_character(value)
    if bad:
        raise refuse(f"{what}contains the control character {bad[1]!r} at position {bad[0]}")
    if not value.strip():
        raise refuse(f"{what}is empty")
    if len(value) > MAX_TEXT:
        raise refuse(f"{what}is too long ({len(value)} characters)")
    return value


def unknown_parameters(names, valid: list[str], what: str = "update_parameters") -> InvalidParameterError:
    """The error for keywords ``update_parameters`` does not take (as submitit's: each name, then the
    valid ones), with what to do instead where the name means something here or in submitit.
    ``what``: who was given them (the Hydra launcher: ``hydra.launcher``)."""
    notes = []
    for n in names:
        if n in BY_NAME and not BY_NAME[n].python:
            notes.append(f"{n}: {BY_NAME[n].python_hint}")
        elif n in SUBMITIT_NAMES:
            notes.append(f"{n} is submitit's: here {SUBMITIT_NAMES[n]}")
    listed = ", ".join(repr(n) for n in names)
    return InvalidParameterError(
        f"{what}: unknown parameter{'s' if len(names) > 1 else ''} {listed}; valid parameters: "
        + ", ".join(valid) + ("".join(f"\n  - {note}" for note in notes)),
        hint="the same names as hpcring submit's flags, with _ for - (docs/python-api.md)")


# ---- the request ------------------------------------------------------------------------------

def _annotation(o: JobOption):
    return {"int": Optional[int], "float": Optional[float], "time": Optional[str], "text": Optional[str],
            "bool": Optional[bool], "list": List[str], "flag": bool}[o.kind]


def _default(o: JobOption):
    if o.kind == "list":
        return field(default_factory=list)
    return field(default=False if o.kind == "flag" else None)


def _resolve(self, *, given: str = "cli", script_file: bool = True, default_name: str | None = None):
    """(site, job spec): the site config loaded and every value merged by precedence.

    ``given``: who gave the values (``cli`` or ``python``: how sources and messages name them).
    ``script_file``: ``script`` is a file the ranks run (else a label: a function's job).
    ``default_name``: the job name when nothing sets one (else the script's stem)."""
    from hpcring.config.jobspec import resolve_job  # deferred: pulls pydantic, yaml
    from hpcring.config.site import load_site  # deferred: pulls pydantic, yaml
    site = load_site(self.site)
    values = {k: getattr(self, k) for k in SPEC_FIELDS}
    job = resolve_job(site, self.script, list(self.args), values, sched_args=list(self.sched_arg),
                      exclusive=self.exclusive, array=self.array, sweep=list(self.sweep),
                      dependency=self.dependency, after=list(self.after), given=given, default_name=default_name)
    from hpcring.config.jobspec import plan_preflight, plan_step_restarts  # deferred: pulls pydantic, yaml
    plan_preflight(site, job, self.preflight, given)
    plan_step_restarts(site, job, self.max_restarts, given)
    if script_file:
        check_script(self.script)      # render and --dry-run too: a preview of a job that cannot run misleads
    job.container = container_resolve(site.config.container, self.container_image, list(self.container_mounts),
                                      self.no_container, site_name=site.name)
    if job.container is not None:
        job.sources.update(dict(job.container.sources))
    return site, job


def check_script(script: str) -> None:
    """SCRIPT names a readable file; else a UsageError saying what it is instead."""
    import os
    from pathlib import Path

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


JobRequest = make_dataclass(
    "JobRequest",
    [("script", str), ("args", List[str], field(default_factory=list))]
    + [(o.name, _annotation(o), _default(o)) for o in CLI_OPTIONS],
    namespace={"resolve": _resolve, "SPEC_FIELDS": SPEC_FIELDS, "__module__": __name__,
               "__doc__": "What was asked for, flag by flag (None: not given): every CLI option of OPTIONS, "
                          "the script and its arguments. From the command line (cli/jobopts.job_options) "
                          "or from hpcring.Executor."},
    frozen=True)


# ---- the docs' table --------------------------------------------------------------------------

BEGIN, END = "<!-- jobopts:begin (generated: python -m hpcring.config.jobopts) -->", "<!-- jobopts:end -->"


def markdown_table() -> str:
    """Every ``update_parameters`` parameter: its flag, its variable, its values, its meaning
    (docs/python-api.md embeds it between the markers)."""
    from hpcring.config.jobspec import ENV_VARS  # deferred: pulls pydantic, yaml
    variables = {**ENV_VARS, "container_image": ENV_IMAGE, "container_mounts": ENV_MOUNTS, "no_container": ENV_NONE}

    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    rows = ["| Parameter | Flag | Variable | Value | Meaning |", "|---|---|---|---|---|"]
    for o in PYTHON_OPTIONS:
        flag = " / ".join(f"`{d}`" for d in o.decls[0].split("/")) if o.decls else "— (`--array`'s `%N`)"
        var = f"`{variables[o.name]}`" if o.name in variables else "—"
        rows.append(f"| `{o.name}` | {flag} | {var} | {cell(o.allowed())} | {cell(o.help)} |")
    return "\n".join(rows) + "\n"


def render_doc(text: str) -> str:
    """``text`` with the table between the markers replaced by the current one."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + BEGIN + "\n" + markdown_table() + END + tail


if __name__ == "__main__":   # regenerate docs/python-api.md's table in place
    import sys
    from pathlib import Path
    doc = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/python-api.md")
    doc.write_text(render_doc(doc.read_text()))
    print(f"wrote {doc}")
