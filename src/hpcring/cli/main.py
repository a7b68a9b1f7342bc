"""The `hpcring` command: thin commands that parse, call the library, and print.

Exit codes: 0 ok, 1 error (or the failing job's own exit code with --wait), 2 usage.
Library errors (HpcringError) become `error: ...` on stderr; nothing else is caught.
"""
from __future__ import annotations

import functools
import sys
from typing import List, Optional

import typer

from hpcring import submit as lib
from hpcring.cli import output
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import HpcringError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="From one GPU to many on Slurm and LSF: submit, bootstrap, collectives.")
sites_app = typer.Typer(no_args_is_help=True, help="Site configs: list, show, validate.")
app.add_typer(sites_app, name="sites")

def command(target: typer.Typer, *args, **kwargs):
    """Register a command whose HpcringError becomes `error: ...` and the error's exit code."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            try:
                return fn(*a, **kw)
            except HpcringError as exc:
                output.error(str(exc))
                raise typer.Exit(exc.exit_code) from None
        return target.command(*args, **kwargs)(wrapper)
    return deco


SiteOpt = typer.Option(None, "--site", "-s", help="Site name or path to a site YAML (default: $HPCRING_SITE, else local).")




def _resolve(script, args, site, nodes, tasks_per_node, gpus_per_node, cpus_per_task, time, partition,
             account, qos, constraint, name, sched_arg, exclusive):
    s = load_site(site)
    cli = dict(nodes=nodes, tasks_per_node=tasks_per_node, gpus_per_node=gpus_per_node,
               cpus_per_task=cpus_per_task, time=time, partition=partition, account=account, qos=qos,
               constraint=constraint, name=name)
    return s, resolve_job(s, script, args or [], cli, sched_args=sched_arg or [], exclusive=exclusive)


_JOB_HELP = "Extra arguments after `--` go to the script."


@command(app, help="Submit SCRIPT to run on every rank. " + _JOB_HELP)
def submit(
    script: str = typer.Argument(..., help="Python script each rank runs."),
    args: Optional[List[str]] = typer.Argument(None, help="Arguments for the script (after --)."),
    site: Optional[str] = SiteOpt,
    nodes: Optional[int] = typer.Option(None, "--nodes", "-N", help="Number of nodes."),
    tasks_per_node: Optional[int] = typer.Option(None, "--tasks-per-node", help="Ranks per node (default: one per GPU, else 1)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="GPUs per node."),
    cpus_per_task: Optional[int] = typer.Option(None, "--cpus-per-task", help="CPUs per rank."),
    time: Optional[str] = typer.Option(None, "--time", "-t", help="Time limit: minutes, HH:MM:SS or D-HH:MM:SS."),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="Partition (Slurm) or queue (LSF)."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="Account or project to charge."),
    qos: Optional[str] = typer.Option(None, "--qos", help="Quality of service."),
    constraint: Optional[str] = typer.Option(None, "--constraint", "-C", help="Node features."),
    exclusive: Optional[bool] = typer.Option(None, "--exclusive/--shared", help="Whole nodes."),
    name: Optional[str] = typer.Option(None, "--name", "-J", help="Job name (default: script name)."),
    sched_arg: Optional[List[str]] = typer.Option(None, "--sched-arg", help="Extra scheduler flag, passed through (repeatable)."),
    template: Optional[str] = typer.Option(None, "--template", help="Own job-script template (.j2)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the job script; submit nothing."),
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow the job: states, rank-tagged output; exit with its exit code."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show where each setting came from."),
    timeline: bool = typer.Option(False, "--timeline", help="Record an hpcring.torch timeline on every rank "
                                  "(HPCRING_TIMELINE); merge it with `hpcring timeline JOB`."),
):
    s, job = _resolve(script, args, site, nodes, tasks_per_node, gpus_per_node, cpus_per_task, time,
                      partition, account, qos, constraint, name, sched_arg, exclusive)
    if timeline:
        job.env["HPCRING_TIMELINE"] = "job"
    if verbose:
        output.sources(s, job)
    if dry_run:
        sys.stdout.write(lib.preview(s, job, template))
        return
    rec = lib.submit(s, job, template)
    output.info(f"Submitted job {rec.job_id} ({job.ntasks} ranks on {job.nodes} node(s), site {s.name}); "
                f"logs in {rec.folder}")
    if wait:
        _wait(rec)


def _wait(rec) -> None:
    oc = lib.follow(rec, on_state=lambda st: output.info(f"job {rec.job_id}: {st.state}"),
                    on_line=lambda r, stream, line: output.line(lib.tag(r, stream, line), stream))
    if not oc.ok:
        raise lib.describe_failure(rec, oc)
    output.info(f"job {rec.job_id} COMPLETED: {rec.ntasks} ranks exited 0")


@command(app, help="Print the job script `submit` would use, without submitting. " + _JOB_HELP)
def render(
    script: str = typer.Argument(...),
    args: Optional[List[str]] = typer.Argument(None),
    site: Optional[str] = SiteOpt,
    nodes: Optional[int] = typer.Option(None, "--nodes", "-N"),
    tasks_per_node: Optional[int] = typer.Option(None, "--tasks-per-node"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node"),
    cpus_per_task: Optional[int] = typer.Option(None, "--cpus-per-task"),
    time: Optional[str] = typer.Option(None, "--time", "-t"),
    partition: Optional[str] = typer.Option(None, "--partition", "-p"),
    account: Optional[str] = typer.Option(None, "--account", "-A"),
    qos: Optional[str] = typer.Option(None, "--qos"),
    constraint: Optional[str] = typer.Option(None, "--constraint", "-C"),
    exclusive: Optional[bool] = typer.Option(None, "--exclusive/--shared"),
    name: Optional[str] = typer.Option(None, "--name", "-J"),
    sched_arg: Optional[List[str]] = typer.Option(None, "--sched-arg"),
    template: Optional[str] = typer.Option(None, "--template"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
):
    s, job = _resolve(script, args, site, nodes, tasks_per_node, gpus_per_node, cpus_per_task, time,
                      partition, account, qos, constraint, name, sched_arg, exclusive)
    if verbose:
        output.sources(s, job)
    sys.stdout.write(lib.preview(s, job, template))


@command(app, help="Show a job's state (from sacct, bjobs or the local backend) and its ranks.")
def status(job_id: str = typer.Argument(...)):
    rec = lib.record(job_id)
    st = lib.job_state(rec)
    output.status(rec, st, lib.outcome(rec, st) if st.finished else None)


@command(app, help="Print a job's output, tagged by rank.")
def logs(job_id: str = typer.Argument(...),
         rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Only this rank."),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
         raw: bool = typer.Option(False, "--raw", help="Keep submitit's own log lines.")):
    rec = lib.record(job_id)
    if follow:
        lib.follow(rec, on_state=lambda st: None, rank=rank,
                   on_line=lambda r, stream, line: output.line(lib.tag(r, stream, line), stream))
        return
    for r, stream, line in lib.LogTail(rec, rank, raw=raw).poll(final=True):
        output.line(lib.tag(r, stream, line), stream)


@command(app, help="Cancel a job.")
def cancel(job_id: str = typer.Argument(...)):
    rec = lib.record(job_id)
    lib.cancel(rec)
    output.info(f"cancel requested for job {job_id}")


@command(sites_app, "list", help="List known site configs (user dirs shadow bundled ones).")
def sites_list():
    from hpcring.config.site import available_sites
    output.sites_table(available_sites())


@command(sites_app, "show", help="Show a site config and the environment derived from its fabric.")
def sites_show(site: str = typer.Argument(..., help="Name or path.")):
    output.site_detail(load_site(site))


@command(sites_app, "validate", help="Validate site configs; lists every problem with file, line and key.")
def sites_validate(sites: Optional[List[str]] = typer.Argument(None, help="Names or paths (default: all known).")):
    from hpcring.config.site import available_sites
    refs = sites or [str(p) for _, p, _ in available_sites()]
    bad = 0
    for ref in refs:
        try:
            s = load_site(ref)
            output.info(f"ok    {s.path}")
        except HpcringError as exc:
            bad += 1
            output.error(str(exc))
    if bad:
        raise typer.Exit(1)


def _add_optional_subapps() -> None:
    """Sub-apps of other layers; each is optional so a partial build still runs."""
    for mod, name in (("hpcring.cli.hostlist_cmd", "hostlist"), ("hpcring.devcluster.cli", "devcluster")):
        try:
            sub = __import__(mod, fromlist=["app"]).app
        except ImportError:
            continue
        app.add_typer(sub, name=name)
    for mod in ("hpcring.cli.run_cmd", "hpcring.cli.bench_cmd", "hpcring.cli.stacks_cmd", "hpcring.cli.doctor_cmd",
                "hpcring.cli.timeline_cmd"):
        try:
            __import__(mod, fromlist=["register"]).register(app)
        except ImportError:
            pass


_add_optional_subapps()


def main() -> None:
    app()
