"""Job scripts from templates: a pure function of (site, job, command, folder).

Templates render with StrictUndefined, so a typo in a template is an error, not an empty string.
A site may point at its own template (``template:`` relative to the site file); a user may pass
``--template``. Templates may include partials from the bundled ``templates/`` folder, and write
the line that starts the ranks with ``{{ launch_command(logs=...) }}``: the scheduler module's
``launch_argv`` (the same words ``hpcring run`` executes, see schedulers/launch_words.py).

A job-script template is a UTF-8 Jinja file that renders a script whose first line is an
interpreter line (``#!/bin/bash``: sbatch refuses a script without one) and that starts the ranks:
it uses ``launch_command(...)``, ``command`` or ``in_container(command)``, itself or in a template
it includes. Any other readable file given as a template is refused, saying so (:func:`check_job_script`).
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.meta

from hpcring import __version__
from hpcring.config.fabric import bootstrap_spec, fabric_env
from hpcring.config.jobspec import JobSpec, check_script_value
from hpcring.config.schema import slurm_signal_spec
from hpcring.config.site import Site
from hpcring.config.text import shown
from hpcring.errors import TemplateError
from hpcring.resources import templates_dir
from hpcring.schedulers.launch_words import LaunchRequest, LaunchWords, Shell, quote_path
from hpcring.schedulers import get

SCHEDULER_TEMPLATES = {"slurm": "slurm.sh.j2", "lsf": "lsf.sh.j2", "local": "local.sh.j2"}


def job_env(site: Site, job: JobSpec) -> dict[str, str]:
    """Every variable the job script exports: fabric-derived, then the site's env (wins), then hpcring's."""
    env = fabric_env(site.config.fabric)
    spec = bootstrap_spec(site.config.fabric)
    if spec:  # which interfaces hpcring's own rendezvous and ring may use (verified at init)
        env["HPCRING_IFNAME"] = spec
    env.update(site.config.env)
    env["SUBMITIT_EXECUTOR"] = site.config.scheduler  # how submitit's task entry finds its environment
    env["HPCRING_SITE"] = site.name if site.origin == "bundled" else str(site.path)
    short = f"{job.timeout:g}"     # 300, not 300.0; repr where :g would round (123456.7)
    env["HPCRING_TIMEOUT"] = short if float(short) == job.timeout else repr(job.timeout)
    if job.gpus_per_node:
        env["HPCRING_GPUS_PER_NODE"] = str(job.gpus_per_node)
    if site.config.scheduler == "lsf" and site.config.lsf.drop_launch_node:
        # the launcher's host file leaves the launch node out; the ranks' slot lists must too
        env["HPCRING_LSF_DROP_LAUNCH_NODE"] = "1"
    env.update(job.env)
    return env


def launch_command(site: Site, job: JobSpec, command: str, logs: str | None = None,
                   folder: str | None = None, python: str | None = None) -> str:
    """The job script's launcher line: the site scheduler's ``launch_argv`` for the whole job.

    ``command`` is shell text (submitit's, already quoted); ``logs`` the per-rank log prefix;
    ``folder`` the job folder (bound into the job's container, if it has one).
    """
    build = getattr(get(site.config.scheduler), "launch_argv", None)
    if build is None:
        raise TemplateError(f"launch_command(): the {site.config.scheduler} scheduler has no launcher line",
                            hint="a local-site template runs hpcring.schedulers.local_run instead")
    req = LaunchRequest(nodes=job.nodes, tasks_per_node=job.tasks_per_node, command=Shell(command),
                        cpus_per_task=job.cpus_per_task, gpus_per_node=job.gpus_per_node, logs=logs,
                        container=job_container(job, folder or "/"))
    words = build(site.config, req)
    if job.step_loop:
        cluster = get(site.config.scheduler).cluster_name(site) if site.config.scheduler == "lsf" else ""
        words = LaunchWords((step_loop_words(job, python or "python3", folder or ".", site.config.scheduler, cluster),
                             *words.lines))
    return words.script()


def step_loop_words(job: JobSpec, python: str, folder: str, scheduler: str = "slurm",
                    cluster: str = "") -> tuple[str, ...]:
    """The words that put the launcher under hpcring's step loop (hpcring.steps): restarts inside
    the allocation on spare nodes, or on fewer (``--min-nodes``). ``cluster``: the job record's
    cluster name where the job's environment has none (LSF: the site's), for the node history."""
    return (python, "-u", "-m", "hpcring.steps", f"--nodes={job.nodes}",
            f"--min-nodes={job.min_nodes or job.nodes}", f"--tasks-per-node={job.tasks_per_node}",
            f"--max-restarts={job.step_restarts}", f"--folder={folder}",
            *([f"--scheduler={scheduler}"] if scheduler != "slurm" else []),
            *([f"--cluster={cluster}"] if cluster else []),
            *([f"--preflight-min-gbps={job.preflight_min_gbps:g}"] if job.preflight else []),
            *(["--preflight", f"--gpus={job.gpus_per_node}"] if job.preflight else []), "--")


def job_container(job: JobSpec, folder: str):
    """The job's container with the job folder's parent bound at its own path: the job folder
    (``%j`` expands later) and the per-job secret file beside it reach every rank unchanged."""
    return job.container.with_bind(str(Path(folder).parent)) if job.container is not None else None


def in_container(site: Site, job: JobSpec, command: str, folder: str) -> str:
    """``command`` (shell text) inside the job's container: for templates that start ranks
    without a launcher line (the local backend's)."""
    req = LaunchRequest(nodes=job.nodes, tasks_per_node=job.tasks_per_node, command=Shell(command),
                        gpus_per_node=job.gpus_per_node, container=job_container(job, folder))
    pre = req.container_prefix()
    return " ".join([*(shlex.quote(w) for w in pre), command]) if pre else command


# scheduler flags that set the job's warning signal: the last one wins, so a user's flag silently
# replaces the site's (and hpcring's own time-limit warning with it)
_SIGNAL_FLAGS = {
    "slurm": [(re.compile(r"--signal(?:=|\s+)(\S+)"), "slurm.signal", lambda c: c.slurm.signal)],
    "lsf": [(re.compile(r"-wa\s*(\S+)"), "lsf.warning_signal", lambda c: c.lsf.warning_signal),
            (re.compile(r"-wt\s*(\S+)"), "lsf.warning_time", lambda c: c.lsf.warning_time)],
}


def _bare(spec: str) -> str:
    return re.sub(r"\bSIG", "", spec.strip("'\""))


def signal_overrides(site: Site, job: JobSpec) -> list[str]:
    """Warnings for scheduler arguments that replace the site's warning signal (or its time)."""
    out = []
    own = len(site.config.sched_args)
    plan = slurm_warning(site, job) if site.config.scheduler == "slurm" else None
    if plan is not None and plan.forward:
        flags = [a for a in job.sched_args if a not in plan.sched_args]
        return [f"{', '.join(map(repr, flags))} and the site's slurm.signal {site.config.slurm.signal!r}: Slurm "
                f"keeps one --signal per job, so it warns the job script (--signal={plan.directive}) and the "
                f"script hands every rank {' and '.join(plan.forward)} (hpcring's warning is "
                f"{plan.listen}; a script's own handler, such as Lightning's requeue, gets its own signal)"]
    for i, arg in enumerate(job.sched_args):
        for pattern, key, value in _SIGNAL_FLAGS.get(site.config.scheduler, []):
            m = pattern.fullmatch(arg.strip())
            site_value = value(site.config)
            if plan is not None and m and arg not in plan.sched_args:
                continue                     # the same signal, merged into one directive
            if m and site_value is not None and _bare(m.group(1)) != _bare(str(site_value)):
                source = f"site sched_args {arg!r}" if i < own else f"--sched-arg {arg!r}"
                out.append(f"{source} replaces the site's {key} {str(site_value)!r} with {m.group(1)!r}: the "
                           f"scheduler keeps the last one, so hpcring's time-limit and preemption warning "
                           f"changes with it; drop the flag, or change {key} in {site.path}")
    return out


@dataclass(frozen=True)
class SlurmWarning:
    """How a Slurm job gets its warning signals (``--signal``). Slurm keeps one ``--signal`` per
    job; when a user's ``--sched-arg=--signal=...`` (Lightning's ``SIGUSR1@90``) names another
    signal than the site's (hpcring's, USR2), both are wanted: Slurm then warns the batch shell
    (``B:``) at the earlier of the two times, and the job script hands every rank each signal."""
    directive: str | None            # the one --signal value rendered, or None
    forward: tuple[str, ...] = ()    # signals the batch shell sends every rank (empty: Slurm does)
    listen: str = "USR2"             # the signal hpcring's ranks take as their warning
    sched_args: tuple[str, ...] = () # the job's scheduler flags, less a --signal merged here


_SLURM_SIGNAL = re.compile(r"--signal(?:=|\s+)(\S+)")


def _signal_spec(spec: str) -> tuple[str, str, int] | None:
    return slurm_signal_spec(spec.strip("'\""))


def slurm_warning(site: Site, job: JobSpec) -> SlurmWarning:
    site_spec = _signal_spec(site.config.slurm.signal) if site.config.slurm.signal else None
    listen = site_spec[1] if site_spec else "USR2"
    own = [(i, a) for i, a in enumerate(job.sched_args) if _SLURM_SIGNAL.fullmatch(a.strip())]
    if site_spec is None or site_spec[0] or not own:
        return SlurmWarning(site.config.slurm.signal, (), listen, tuple(job.sched_args))
    i, arg = own[-1]                         # Slurm keeps the last --signal
    user = _signal_spec(_SLURM_SIGNAL.fullmatch(arg.strip()).group(1))
    if user is None or user[0]:              # unreadable, or the user's own B:/R: choice: theirs
        return SlurmWarning(site.config.slurm.signal, (), listen, tuple(job.sched_args))
    rest = tuple(a for j, a in enumerate(job.sched_args) if (j, a) not in own)
    signals = tuple(dict.fromkeys([user[1], site_spec[1]]))
    secs = max(user[2], site_spec[2])
    if len(signals) == 1:                    # the same signal: one directive, the earlier time
        return SlurmWarning(f"{signals[0]}@{secs}", (), listen, rest)
    # hpcring's own first: its handler only takes note, while the script's (Lightning's) may start
    # a child (`scontrol requeue`) that a later signal of the step would kill
    return SlurmWarning(f"B:{signals[0]}@{secs}", (site_spec[1], user[1]), listen, rest)


def template_path(site: Site, override: str | Path | None = None) -> Path:
    if override:
        p = Path(override).expanduser()
    elif site.config.template:
        p = (site.path.parent / site.config.template).expanduser()
    else:
        p = templates_dir() / SCHEDULER_TEMPLATES[site.config.scheduler]
    if not p.is_file():
        where = "--template" if override else f"{site.path} key 'template'"
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise TemplateError(f"job-script template {p} ({where}) {what}",
                            hint="point at an existing .j2 file, or remove the setting to use the bundled one")
    return p


# the names through which a template starts the job's ranks (render_script's globals and variables)
STARTS_RANKS = ("launch_command", "command", "in_container")


def _template_where(site: Site, path: Path, override) -> str:
    return "--template" if override else (f"{site.path} key 'template'" if site.config.template else "bundled")


def _names_used(jenv: jinja2.Environment, name: str, seen: set[str]) -> set[str] | None:
    """Every variable and function ``name`` and the templates it includes, imports or extends use
    (None: one of them is chosen at render time, so not every name can be known). ``jenv`` holds
    no globals (jinja2.meta leaves those out)."""
    if name in seen:
        return set()
    seen.add(name)
    source, _, _ = jenv.loader.get_source(jenv, name)
    tree = jenv.parse(source)
    used = set(jinja2.meta.find_undeclared_variables(tree))
    for ref in jinja2.meta.find_referenced_templates(tree):
        more = _names_used(jenv, ref, seen) if ref is not None else None
        if more is None:
            return None
        used |= more
    return used


def check_job_script(path: Path, where: str, text: str | None, used: set[str] | None, scheduler: str,
                     render_error: str | None = None) -> None:
    """Refuse a template that is no job-script template: ``text`` (its rendering; None when it did
    not render, ``render_error`` saying why) does not start with an interpreter line, or ``used``
    (the names it uses) holds none that starts the ranks. TemplateError saying what was expected."""
    missing = []
    if text is not None and not text.startswith("#!"):
        missing.append("its first line is not an interpreter line such as #!/bin/bash (it is "
                       f"{shown(text.split(chr(10), 1)[0], 40)})")
    if used is not None and not used & set(STARTS_RANKS):
        missing.append("it never starts the ranks (it uses neither launch_command(...) nor command)")
    if missing and render_error:
        missing.append(f"and it does not render ({render_error})")
    if missing:
        raise TemplateError(f"{where} {path} is not a job-script template: " + "; ".join(missing),
                            hint="a job-script template is a Jinja file that renders a script starting with "
                                 "#!/bin/bash and starts the ranks with {{ launch_command(logs=...) }} (or runs "
                                 f"{{{{ command }}}}); copy templates/{SCHEDULER_TEMPLATES[scheduler]} and edit it")


def _template_error(path: Path, exc: jinja2.TemplateError) -> TemplateError:
    line = getattr(exc, "lineno", None)
    at = f"{path}:{line}" if line else str(path)
    return TemplateError(f"template {at}: {exc}",
                         hint="every variable a template uses must be defined (StrictUndefined)")


def render_script(site: Site, job: JobSpec, command: str, folder: str,
                  template: str | Path | None = None, python: str | None = None, warn: bool = True) -> str:
    """Render the job script. Pure: reads templates, touches nothing else (a scheduler argument that
    replaces the site's warning signal is named on stderr, unless ``warn`` is False).

    Values reach the script shell-quoted (``shquote``); a line break would still end a comment or
    an ``#SBATCH`` line, so every text value is checked for control characters first.
    """
    for what, value in (("script path", job.script), ("job folder", folder), ("site path", str(site.path)),
                        ("python", python or "python3"), ("command", command)):
        check_script_value(what, value, "job script")
    path = template_path(site, template)
    where = _template_where(site, path, template)
    loader = jinja2.FileSystemLoader([str(path.parent), str(templates_dir())])
    jenv = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)
    jenv.filters["shquote"] = lambda v: shlex.quote(str(v))
    jenv.filters["shquote_path"] = lambda v: quote_path(str(v))   # keeps a leading ~ expandable
    jenv.globals["launch_command"] = lambda logs=None: launch_command(site, job, command, logs, folder, python)
    jenv.globals["slurm_warning"] = lambda: slurm_warning(site, job)
    jenv.globals["in_container"] = lambda cmd: in_container(site, job, cmd, folder)
    try:
        bare = jinja2.Environment(loader=loader)       # the same filters, no globals: to read the names used
        bare.filters.update(jenv.filters)
        used = _names_used(bare, path.name, set())
        tmpl = jenv.get_template(path.name)
    except jinja2.TemplateError as exc:
        raise _template_error(path, exc) from None
    except (UnicodeDecodeError, OSError) as exc:     # binary, unreadable
        why = "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else f"cannot be read ({exc})"
        raise TemplateError(f"{where} {path} {why}: not a job-script template",
                            hint="point at a Jinja job-script template (.j2), e.g. a copy of templates/"
                                 f"{SCHEDULER_TEMPLATES[site.config.scheduler]}") from None
    try:
        text = tmpl.render(
            site=site.config, site_path=site.path.name if site.origin == "bundled" else str(site.path),
            job=job, command=command, folder=folder, env=job_env(site, job), hpcring_version=__version__,
            python=python or "python3")
    except jinja2.TemplateError as exc:
        # a file that is no job-script template at all: that, rather than the first name it lacks
        check_job_script(path, where, None, used, site.config.scheduler, render_error=str(exc))
        raise _template_error(path, exc) from None
    check_job_script(path, where, text, used, site.config.scheduler)
    if warn:
        for warning in signal_overrides(site, job):   # render and submit alike; stderr keeps stdout the script
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return text
