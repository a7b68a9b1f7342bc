"""A job's resolved settings, and where each came from.

Precedence, highest first: CLI flag > environment (HPCRING_*) > site config > built-in default.
``JobSpec.sources`` records the winner for each field so ``--verbose`` can show it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hpcring.config.arrays import ArraySpec, Dependency, parse_array, parse_dependency, parse_sweep
from hpcring.config.schema import minutes_to_lsf, minutes_to_slurm, time_to_minutes
from hpcring.config.text import control_character, shown
from hpcring.config import envvars
from hpcring.config.jobopts import INT_BOUNDS
from hpcring.config.site import Site
from hpcring.errors import UsageError
from hpcring.config.container import resolve as container_of

# field -> environment variable that may set it
ENV_VARS: dict[str, str] = {
    "nodes": "HPCRING_NODES",
    "spare_nodes": "HPCRING_SPARE_NODES",
    "min_nodes": "HPCRING_MIN_NODES",
    "tasks_per_node": "HPCRING_TASKS_PER_NODE",
    "gpus_per_node": "HPCRING_GPUS_PER_NODE",
    "cpus_per_task": "HPCRING_CPUS_PER_TASK",
    "time": "HPCRING_TIME",
    "partition": "HPCRING_PARTITION",
    "account": "HPCRING_ACCOUNT",
    "qos": "HPCRING_QOS",
    "constraint": "HPCRING_CONSTRAINT",
    "name": "HPCRING_JOB_NAME",
    "job_dir": "HPCRING_JOB_DIR",
    "timeout": "HPCRING_TIMEOUT",
}
# whole-number fields -> (lowest, highest) allowed: the job options' own bounds (config/jobopts.py)
_INTS = INT_BOUNDS
# text fields that end up in a job script: quoted there, but a line break or a control character
# would still start a new script line (or an #SBATCH line), so they are refused here
MAX_NODES_ALLOC = envvars.MAX_NODES     # the job's nodes and its spares together
_TEXTS = ("partition", "account", "qos", "constraint", "name", "job_dir")


def check_script_value(what: str, value: str, where: str) -> str:
    """Refuse a value with a line break or another control character (it would reach a job script)."""
    bad = control_character(value)
    if bad:
        raise UsageError(f"{where}: {what} {shown(value)} contains the control character {bad[1]!r} "
                         f"at position {bad[0]}",
                         hint=f"use a {what} without line breaks, tabs or control characters")
    if not value.strip():
        raise UsageError(f"{where}: {what} is empty", hint=f"give a non-empty {what} or leave it out")
    return value


@dataclass
class JobSpec:
    script: str
    args: list[str]
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    time_min: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    exclusive: bool
    name: str
    job_dir: str
    timeout: float
    sched_args: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # per-job additions (e.g. HPCRING_SECRET_FILE)
    container: Any = None   # config.container.ContainerRun: the image the ranks start in, or None
    array: ArraySpec | None = None       # --array / --sweep: each task a whole job (config/arrays.py)
    sweep: list[dict] | None = None      # per task index: the values passed as --NAME VALUE
    dependency: Dependency | None = None
    exclude: list[str] = field(default_factory=list)   # nodes not to run on (restarts.py: a restart's bad nodes;
                                                       # nodehistory.py: nodes blamed again and again)
    spare_nodes: int = 0              # held beside ``nodes`` for restarts inside the allocation (hpcring.steps)
    min_nodes: int | None = None      # with no spare left, go on with this few (None: ``nodes``)
    step_restarts: int = 0            # restarts the job script's step loop makes
    preflight: bool = False           # the gang check before the script (hpcring.preflight)
    preflight_min_gbps: float = 0.0

    @property
    def step_loop(self) -> bool:
        """The job script runs its ranks under hpcring.steps (restarts inside the allocation, preflight)."""
        return bool(self.step_restarts or self.preflight)

    @property
    def alloc_nodes(self) -> int:
        """Nodes the scheduler allocates: the job's and its spares."""
        return self.nodes + self.spare_nodes

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def time_slurm(self) -> str:
        return minutes_to_slurm(self.time_min)

    @property
    def time_lsf(self) -> str:
        return minutes_to_lsf(self.time_min)


DEFAULT_JOB_DIR = "~/hpcring-jobs"


def job_root(job_dir: str) -> Path:
    """The folder a job_dir names (``~`` expanded, absolute): job folders, secrets and the site's
    shared state (``.hpcring/``: the node history) live there."""
    return Path(os.path.expanduser(job_dir)).resolve()


def job_dir_of(site: Site, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(job_dir, where it came from) as :func:`resolve_job` picks it (HPCRING_JOB_DIR > site
    ``job_dir`` > default), for commands that use a site's folder without a job (``hpcring nodes``)."""
    env = os.environ if environ is None else environ
    var = ENV_VARS["job_dir"]
    if env.get(var) not in (None, ""):
        return parse_field("job_dir", env[var], f"${var}"), f"env {var}"
    if site.config.job_dir is not None:
        return parse_field("job_dir", site.config.job_dir, f"site {site.path}"), f"site {site.name}"
    return DEFAULT_JOB_DIR, "default"


def _site_value(site: Site, name: str, partition: str | None) -> Any:
    c = site.config
    part = c.partitions.get(partition) if partition else None
    if name == "gpus_per_node":
        return part.gpus_per_node if part and part.gpus_per_node is not None else c.gpus_per_node
    if name == "qos":
        return part.qos if part and part.qos else c.qos
    if name in ("account", "constraint", "job_dir", "timeout"):
        return getattr(c, name)
    if name in ("nodes", "tasks_per_node", "cpus_per_task", "time", "partition", "exclusive", "spare_nodes",
                "min_nodes"):
        return getattr(c.defaults, name)
    return None


def parse_field(name: str, raw: Any, where: str) -> Any:
    """One job field's value from ``raw`` (a flag, a variable or a site value: ``where`` says which),
    checked as submit checks it; UsageError naming ``where`` and the field."""
    if raw is None:
        return None
    flag = name.replace('_', '-')
    if name in _INTS:
        lo, hi = _INTS[name]
        try:
            v = int(raw.strip(), 10) if isinstance(raw, str) else int(raw)
        except (TypeError, ValueError):
            raise UsageError(f"{where}: {flag} must be a whole number, got {raw!r}",
                             hint=f"give {flag} as a whole number from {lo} to {hi}") from None
        if not lo <= v <= hi:
            raise UsageError(f"{where}: {flag} must be at least {lo} and at most {hi}, got {v}",
                             hint=f"give {flag} as a whole number from {lo} to {hi}")
        return v
    if name == "time":
        try:
            return time_to_minutes(raw)
        except ValueError as exc:
            raise UsageError(f"{where}: {exc}",
                             hint="Slurm time syntax: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS") from None
    if name == "timeout":
        return envvars.check_number(f"{where}: timeout", raw, lo=0, lo_open=True, hi=envvars.MAX_TIMEOUT,
                                    hint="the per-collective deadline is seconds, e.g. 300")
    if name in _TEXTS:
        return check_script_value(flag.replace("-", " "), str(raw), where)
    return raw


# who gave a job's own values -> the source recorded for them (--verbose, messages): the flags, or
# hpcring.Executor.update_parameters
GIVEN = {"cli": "cli", "python": "update_parameters"}


def given_as(name: str, source: str) -> str:
    """How a given value's field is named in messages: ``--tasks-per-node`` (a flag, or any other
    source) or ``tasks_per_node=`` (``update_parameters``; ``source`` is a key or a label of GIVEN)."""
    return f"{name}=" if source in ("python", GIVEN["python"]) else f"--{name.replace('_', '-')}"


def resolve_job(site: Site, script: str, args: list[str] | None = None,
                cli: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None,
                sched_args: list[str] | None = None,
                exclusive: bool | None = None,
                array: str | None = None, sweep: list[str] | None = None,
                dependency: str | None = None, after: list[str] | None = None,
                given: str = "cli", default_name: str | None = None) -> JobSpec:
    """Merge the given values, HPCRING_* variables, the site config and defaults into a JobSpec.

    ``cli`` maps field names to the values given (flags, or ``update_parameters``: ``given`` says
    which, the source recorded and the spelling in messages), None meaning "not given".
    ``default_name``: the job's name when nothing sets one (else the script's stem). Raises
    UsageError for bad values and for requests the site's partition limits forbid.
    """
    assert given in GIVEN, given
    cli = dict(cli or {})
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def pick(name: str, default: Any) -> None:
        if cli.get(name) is not None:
            values[name], sources[name] = parse_field(name, cli[name], given_as(name, given)), GIVEN[given]
        elif ENV_VARS.get(name) and env.get(ENV_VARS[name]) not in (None, ""):
            var = ENV_VARS[name]
            values[name], sources[name] = parse_field(name, env[var], f"${var}"), f"env {var}"
        elif _site_value(site, name, values.get("partition")) is not None:
            values[name] = parse_field(name, _site_value(site, name, values.get("partition")), f"site {site.path}")
            sources[name] = f"site {site.name}"
        else:
            values[name], sources[name] = default, "default"

    pick("partition", None)
    for name, default in (("nodes", 1), ("spare_nodes", 0), ("min_nodes", None), ("gpus_per_node", 0), ("cpus_per_task", 1), ("time", 30),
                          ("account", None), ("qos", None), ("constraint", None),
                          ("job_dir", DEFAULT_JOB_DIR), ("timeout", envvars.DEFAULT_TIMEOUT)):
        pick(name, default)
    pick("tasks_per_node", max(1, values["gpus_per_node"]))
    if sources["tasks_per_node"] == "default" and values["gpus_per_node"]:
        sources["tasks_per_node"] = "default (one per GPU)"
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", default_name or Path(script).stem) or "job"
    pick("name", stem)
    if exclusive is not None:
        values["exclusive"], sources["exclusive"] = exclusive, GIVEN[given]
    else:
        values["exclusive"], sources["exclusive"] = site.config.defaults.exclusive, f"site {site.name}"

    for i, a in enumerate(args or []):
        if "\x00" in a:
            raise UsageError(f"script argument {i + 1} {a!r} contains a NUL byte",
                             hint="a command-line argument cannot carry NUL bytes")
    for i, a in enumerate(sched_args or []):
        check_script_value("scheduler argument", a, f"--sched-arg #{i + 1}")
    spec = JobSpec(script=script, args=list(args or []), nodes=values["nodes"],
                   tasks_per_node=values["tasks_per_node"], gpus_per_node=values["gpus_per_node"],
                   cpus_per_task=values["cpus_per_task"], time_min=values["time"],
                   partition=values["partition"], account=values["account"], qos=values["qos"],
                   constraint=values["constraint"], exclusive=values["exclusive"], name=values["name"],
                   job_dir=values["job_dir"], timeout=values["timeout"],
                   sched_args=list(site.config.sched_args) + list(sched_args or []), sources=sources,
                   spare_nodes=values["spare_nodes"], min_nodes=values["min_nodes"])
    combos = parse_sweep(list(sweep)) if sweep else None
    if combos is not None or array is not None:
        spec.array = (parse_array(array, tasks=len(combos) if combos else None) if array is not None
                      else ArraySpec(tuple(range(len(combos)))))
        spec.sweep = combos
        spec.sources["array"] = GIVEN[given]
    spec.dependency = parse_dependency(dependency, after)
    check_limits(site, spec)
    # the image from HPCRING_CONTAINER_IMAGE or the site (JobRequest.resolve puts the flags on top);
    # imported here: the container words live beside the launcher's, in schedulers/
    spec.container = container_of(site.config.container, environ=env, site_name=site.name)
    return spec


MAX_RESTARTS = 100


def max_restarts(cli: int | None, site: Site, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(N, where it came from): ``--max-restarts`` > HPCRING_MAX_RESTARTS > site
    ``defaults.max_restarts`` > 0."""
    if cli is not None:
        return envvars.check_number("--max-restarts", cli, lo=0, hi=MAX_RESTARTS, integer=True), "cli"
    env = envvars.get("HPCRING_MAX_RESTARTS", environ, default=None)
    if env is not None:
        return env, "env HPCRING_MAX_RESTARTS"
    n = getattr(site.config.defaults, "max_restarts", 0)
    return (n, f"site {site.name}") if n else (0, "default")


STEP_LOOP_SITES = "Slurm sites and LSF sites whose launcher is blaunch (a step is one srun or one blaunch -z)"


def step_loop_runs(site: Site) -> bool:
    """Whether the job script's step loop (hpcring.steps) can pin a step to chosen hosts here: srun
    on Slurm; blaunch -z on LSF (jsrun's resource sets and mpirun's host file have no such step)."""
    c = site.config
    return c.scheduler == "slurm" or (c.scheduler == "lsf" and c.launcher.kind == "blaunch" and not c.lsf.nnodes)


def _site_kind(site: Site) -> str:
    c = site.config
    return f"uses {c.scheduler}" if c.scheduler != "lsf" else \
        f"is an LSF site launching with {c.launcher.kind}" + (" and -nnodes" if c.lsf.nnodes else "")


def plan_preflight(site: Site, job: JobSpec, cli: bool | None, given: str = "cli",
                   environ: Mapping[str, str] | None = None) -> None:
    """``job.preflight`` by precedence: ``--preflight`` > HPCRING_PREFLIGHT > site ``defaults.preflight``;
    the bandwidth floor: HPCRING_PREFLIGHT_MIN_GBPS > site ``defaults.preflight_min_gbps`` > 0."""
    env = envvars.get("HPCRING_PREFLIGHT", environ, default=None)
    if cli is not None:
        job.preflight, job.sources["preflight"] = bool(cli), GIVEN[given]
    elif env is not None:
        job.preflight, job.sources["preflight"] = bool(env), "env HPCRING_PREFLIGHT"
    else:
        job.preflight, job.sources["preflight"] = site.config.defaults.preflight, f"site {site.name}"
    gbps = envvars.get("HPCRING_PREFLIGHT_MIN_GBPS", environ, default=None)
    job.preflight_min_gbps = float(gbps if gbps is not None else site.config.defaults.preflight_min_gbps or 0.0)
    if job.preflight and not step_loop_runs(site):
        raise UsageError(f"{given_as('preflight', given)}: the preflight runs in the job script's step loop, on "
                         f"{STEP_LOOP_SITES}; site {site.name!r} {_site_kind(site)}",
                         hint="leave --preflight out there (`hpcring doctor` checks a node by hand)")
    if job.preflight and job.array is not None:
        raise UsageError(f"{given_as('preflight', given)}: not for an array's tasks",
                         hint="leave --preflight out for an array")


def plan_step_restarts(site: Site, job: JobSpec, cli_restarts: int | None, given: str = "cli",
                       environ: Mapping[str, str] | None = None) -> None:
    """A job with spares (or a ``min_nodes`` below ``nodes``) restarts inside its allocation: set
    ``job.step_restarts`` from the max-restarts precedence, or refuse what cannot work (no restart
    allowed: the spares would only idle; an array; a scheduler without the step loop)."""
    shrink = job.min_nodes is not None and job.min_nodes < job.nodes
    if not (job.spare_nodes or shrink):
        return
    what = f"{given_as('spare_nodes', given)}{'=' if given == 'python' else ' '}{job.spare_nodes}" if job.spare_nodes \
        else f"{given_as('min_nodes', given)}{'=' if given == 'python' else ' '}{job.min_nodes}"
    if not step_loop_runs(site):
        raise UsageError(f"{what}: restarts inside the allocation run on {STEP_LOOP_SITES}; site {site.name!r} "
                         f"{_site_kind(site)}",
                         hint="follow the job with `submit --wait --max-restarts N` (each restart is a "
                              "resubmission), or leave --spare-nodes/--min-nodes out")
    if job.array is not None:
        raise UsageError(f"{what}: an array's tasks are not restarted", hint="leave --spare-nodes/--min-nodes out "
                                                                               "for an array")
    n, where = max_restarts(cli_restarts, site, environ)
    if not n:
        raise UsageError(f"{what} but max-restarts is 0 ({where}): spares serve restarts only",
                         hint=f"add {given_as('max_restarts', given)}{'=' if given == 'python' else ' '}N (N >= 1: "
                              "restarts after a node-level fault), or leave the spares out")
    job.step_restarts = n
    job.sources["step_restarts"] = where


def check_local_ranks(nodes: int, per_node: int, hint: str, where: str = "") -> None:
    """Refuse more ranks than the local backend starts on one machine (``hpcring run`` outside an
    allocation, ``submit`` to a local site): a typo must not fork 10^8 processes."""
    if nodes * per_node > envvars.MAX_LOCAL_RANKS:
        raise UsageError(f"--nodes {nodes} x --tasks-per-node {per_node} is {nodes * per_node} ranks{where}; the "
                         f"local backend starts every rank on this machine, at most {envvars.MAX_LOCAL_RANKS}",
                         hint=hint)


def check_limits(site: Site, spec: JobSpec) -> None:
    """Refuse, before the scheduler does, what the site config says cannot run."""
    c = site.config
    if c.scheduler == "local":
        check_local_ranks(spec.nodes, spec.tasks_per_node,
                          hint=f"lower --nodes or --tasks-per-node, or submit to a cluster site (site {site.path} "
                               "has no scheduler)",
                          where=f" (nodes: {spec.sources.get('nodes')}, tasks per node: "
                                f"{spec.sources.get('tasks_per_node')})")
    if spec.partition and c.partitions and spec.partition not in c.partitions:
        raise UsageError(f"partition {spec.partition!r} ({spec.sources['partition']}) is not defined in site "
                         f"{c.name!r} ({site.path}); partitions there: {', '.join(sorted(c.partitions))}",
                         hint="pick one of those, or leave the partition out for the site's default "
                              f"(`hpcring sites show {c.name}`)")
    part = c.partitions.get(spec.partition) if spec.partition else None

    def named(name: str) -> str:         # --nodes 8, or nodes=8 when update_parameters gave it
        flag = given_as(name, spec.sources.get(name, "cli"))
        value = spec.time_slurm if name == "time" else getattr(spec, name)
        return f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}"
    if spec.min_nodes is not None and spec.min_nodes > spec.nodes:
        raise UsageError(f"{named('min_nodes')} is above {named('nodes')}: a restart never needs more nodes than "
                         "the job", hint="give --min-nodes at most --nodes (it is how few a restart may go on with)")
    if (spec.spare_nodes or spec.min_nodes) and c.scheduler == "local":
        what = named("spare_nodes") if spec.spare_nodes else named("min_nodes")
        raise UsageError(f"{what}: site {c.name!r} ({site.path}) runs every rank on this machine, which has no "
                         "spare node", hint="submit to a cluster site, or leave --spare-nodes/--min-nodes out")
    if spec.spare_nodes and spec.nodes + spec.spare_nodes > MAX_NODES_ALLOC:
        raise UsageError(f"{named('nodes')} with {named('spare_nodes')} is {spec.nodes + spec.spare_nodes} nodes, "
                         f"more than {MAX_NODES_ALLOC}", hint="fewer spares")
    if part and part.max_nodes and spec.spare_nodes and spec.nodes + spec.spare_nodes > part.max_nodes:
        raise UsageError(f"{named('nodes')} and {named('spare_nodes')} are {spec.nodes + spec.spare_nodes} nodes, "
                         f"more than partition {spec.partition!r} max_nodes {part.max_nodes} (site {site.path})",
                         hint=f"at most {part.max_nodes} nodes with the spares there: fewer spares, or fewer nodes")
    if part and part.max_nodes and spec.nodes > part.max_nodes:
        raise UsageError(f"{named('nodes')} exceeds partition {spec.partition!r} max_nodes {part.max_nodes} "
                         f"(site {site.path})",
                         hint=f"ask for at most {part.max_nodes} nodes there, or a partition that allows more")
    if part and part.max_time and spec.time_min > time_to_minutes(part.max_time):
        raise UsageError(f"{named('time')} exceeds partition {spec.partition!r} max_time "
                         f"{part.max_time} (site {site.path})",
                         hint=f"ask for at most {part.max_time} there, or a partition with a longer max_time")
    gpus_avail = part.gpus_per_node if part and part.gpus_per_node is not None else c.gpus_per_node
    if spec.gpus_per_node > gpus_avail:
        raise UsageError(f"{named('gpus_per_node')} but site {c.name!r}"
                         + (f" partition {spec.partition!r}" if part else "") + f" has {gpus_avail} GPUs per node",
                         hint=f"ask for at most {gpus_avail} GPUs per node" + (", or a partition with more GPUs"
                                                                               if c.partitions else ""))
    cpus = (part.cpus_per_node if part and part.cpus_per_node else None) or c.cpus_per_node
    if cpus and spec.tasks_per_node * spec.cpus_per_task > cpus:
        raise UsageError(f"{spec.tasks_per_node} tasks x {spec.cpus_per_task} CPUs per task need "
                         f"{spec.tasks_per_node * spec.cpus_per_task} CPUs per node; site {c.name!r} has {cpus}",
                         hint=f"fewer tasks per node or CPUs per task: their product at most {cpus}")
