"""The `hpcring` command: thin commands that parse, call the library, and print.

Exit codes: 0 ok, 1 error (or the failing job's own exit code with --wait), 2 usage.
Library errors (HpcringError) become `error: ...` on stderr (hpcring.cli.common.command); nothing
else is caught.
"""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

from hpcring.cli import output
from hpcring.cli.common import StrictGroup, command, newest_job
from hpcring.cli.jobopts import JobRequest, job_options
from hpcring.cli.remote_opts import remote_aware, remote_option, submit_remote
from hpcring.config.envvars import MAX_RANKS
from hpcring.errors import HpcringError, JobFailedError

# The library is imported inside each command: `hpcring --help` and `hpcring hostlist` must not
# pay for submitit, pydantic or numpy.

# StrictGroup: every flag of every command below, sub-apps included, is read strictly (cli/common.py)
app = typer.Typer(cls=StrictGroup, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="From one GPU to many on Slurm and LSF: submit, bootstrap, collectives.")
sites_app = typer.Typer(no_args_is_help=True, help="Site configs: list, show, validate.")
app.add_typer(sites_app, name="sites")

_JOB_HELP = "Extra arguments after `--` go to the script."


@command(app, help="Submit SCRIPT to run on every rank. " + _JOB_HELP)
@job_options
def submit(req: JobRequest,
           dry_run: bool = typer.Option(False, "--dry-run", help="Print the job script; submit nothing."),
           wait: bool = typer.Option(False, "--wait", "-w",
                                     help="Follow the job: states, rank-tagged output; exit with its exit code."),
           timeline: bool = typer.Option(False, "--timeline",
                                         help="Record an hpcring.torch timeline on every rank (HPCRING_TIMELINE); "
                                              "merge it with `hpcring timeline JOB`."),
           remote: Optional[str] = remote_option()):
    if submit_remote(req, remote):     # a login node named: copied and submitted there (docs/remote.md)
        return
    from hpcring import submit as lib
    s, job, left_out = _resolve(req)
    if timeline:
        job.env["HPCRING_TIMELINE"] = "job"
    if req.verbose:
        output.sources(s, job)
    if dry_run:
        for note in left_out:
            output.info(note)
        sys.stdout.write(lib.preview(s, job, req.template))
        return
    lib.preview(s, job, req.template, warn=False)   # a template that fails or is no job script: refused here
    warnings = lib.node_local_warnings(s, job)
    from hpcring.restarts import restarts_to_make
    restarts, notes = restarts_to_make(req.max_restarts, s, job, wait)   # refused here, before submitting
    for note in notes:
        output.info(note)
    try:
        rec = lib.submit(s, job, req.template)
    except HpcringError:
        for note in left_out:          # a refusal may be about the nodes left out: say which first
            output.info(note)
        raise
    output.info(f"Submitted job {rec.job_id} [{rec.key}] ({job.ntasks} ranks on {job.nodes} node(s), site {s.name}); "
                f"logs in {rec.folder}" + (f"; an array of {len(rec.array)} tasks, each the whole job: "
                                           f"{rec.job_id}_{rec.array[0]} ..." if rec.array is not None else ""))
    for note in left_out:              # after the "Submitted job" line: scripts read the id from the first line
        output.info(note)
    for warning in warnings:
        output.info(f"warning: {warning}")
    if wait:
        _wait(rec, s, job, restarts, req.template)
    else:
        output.info(f"follow it with `hpcring logs -f {rec.job_id}`; its state: `hpcring status {rec.job_id}`")


def _resolve(req: JobRequest):
    """(site, job spec, lines for stderr): the request resolved, then the nodes the site's node
    history leaves out added to the job's exclusion (unless --no-node-history; hpcring.nodehistory)."""
    from hpcring import nodehistory
    s, job = req.resolve()
    return s, job, nodehistory.leave_out(s, job, ignore=bool(req.no_node_history))


def _settle(rec, oc) -> None:
    """A job seen ending (submit --wait, logs --follow, status): the nodes its diagnosis blamed go
    into the site's node history, once per job (hpcring.nodehistory); what was recorded, or why it
    could not be, on stderr. The job's own outcome is not changed."""
    from hpcring import nodehistory
    for note in nodehistory.record_ended(rec, oc):
        output.info(note)


def _settle_tasks(rec, states) -> None:
    """:func:`_settle` for each task of an array that ended other than COMPLETED."""
    from hpcring import jobstatus
    for task in rec.tasks():
        st = states.get(task.job_id)
        if st is not None and st.finished and st.state != "COMPLETED":
            _settle(task, jobstatus.outcome(task, st))


def _wait(rec, site=None, job=None, restarts: int = 0, template=None) -> None:
    from hpcring import jobfollow, jobstatus
    if rec.array is not None:
        try:
            st = jobfollow.wait_array(rec, on_change=lambda st: output.info(f"job {rec.job_id}: {st.raw}"))
        except KeyboardInterrupt:       # as for one job: stop following, not the tasks
            output.info(f"\nstopped following array job {rec.job_id}; its tasks keep running. "
                        f"`hpcring status {rec.key}` shows them, `hpcring cancel {rec.key}` stops them.")
            raise typer.Exit(130) from None
        if st.state != "COMPLETED":
            states, _ = jobstatus.job_states([rec])
            _settle_tasks(rec, states)
            raise JobFailedError(f"array job {rec.job_id} ({rec.name}) {st.state}: {st.raw}",
                                 exit_code=st.exit_code or 1, hint=f"`hpcring status {rec.job_id}` names each task")
        output.info(f"job {rec.job_id} COMPLETED: {len(rec.array)} tasks")
        return
    now = [rec]                        # the attempt being followed (a restart is another job)

    def follow(rec):
        now[0] = rec
        oc = jobfollow.follow(rec, on_state=lambda st: output.info(f"job {rec.job_id}: {st.state}"),
                              tracebacks_once=True,
                              on_line=lambda r, stream, line: output.line(jobfollow.tag(r, stream, line)))
        _settle(rec, oc)               # before a restart is decided: its blame is on record
        return oc
    try:
        if restarts:                   # hpcring.restarts: resubmit after a node-level fault, bad nodes excluded
            from hpcring import submit as lib
            from hpcring.restarts import follow_restarting
            rec, oc = follow_restarting(site, job, rec, restarts, submit=lib.submit, follow=follow,
                                        info=output.info, template=template)
        else:
            oc = follow(rec)
    except KeyboardInterrupt:
        # Ctrl-C stops following, not the job (as with sbatch then squeue): say so, and how to stop it.
        rec = now[0]
        output.info(f"\nstopped following job {rec.job_id}; it keeps running" + (" (and is not restarted after "
                    "a node fault: nothing follows it)" if restarts else "") + ". "
                    f"Follow it again with `hpcring logs -f {rec.key}`, stop it with `hpcring cancel {rec.key}`.")
        raise typer.Exit(130) from None
    if not oc.ok:
        raise jobstatus.describe_failure(rec, oc)
    output.info(f"job {rec.job_id} COMPLETED: {rec.ntasks} ranks exited 0")


@command(app, help="Print the job script `submit` would use, without submitting. " + _JOB_HELP)
@job_options
def render(req: JobRequest):
    from hpcring import submit as lib
    s, job, left_out = _resolve(req)
    if req.verbose:
        output.sources(s, job)
    for note in left_out:
        output.info(note)
    sys.stdout.write(lib.preview(s, job, req.template))


@command(app, help="Show a job's state (from sacct, bjobs or the local backend) and its ranks; an array's "
                   "tasks summarised by state (JOB) or one task (JOB_TASK).")
@remote_aware()
def status(job_id: Optional[str] = typer.Argument(None, help="A job id or record name; none: list the newest jobs."),
           last: int = typer.Option(10, "--last", "-n", min=1, help="How many jobs to list without JOB_ID.")):
    from hpcring import jobstatus, submit as lib
    if job_id is None:
        output.jobs_table(jobstatus.recent(last))
        return
    rec = lib.record(job_id)
    if rec.array is not None:          # one line per state, then one per task
        states, why = jobstatus.job_states([rec])
        if why:
            raise why[rec.job_id]
        output.array_status(rec, jobstatus.array_state(states), states)
        _settle_tasks(rec, states)
        return
    st = jobstatus.job_state(rec)
    oc = jobstatus.outcome(rec, st) if st.finished else None
    output.status(rec, st, oc, jobstatus.requeues(rec))
    _settle(rec, oc)
    from hpcring.restarts import status_lines
    output.restart_chain(status_lines(rec, oc))    # restarts after node faults (--max-restarts)


@command(app, help="Print a job's output, tagged by rank.")
@remote_aware(newest=True)
def logs(job_id: Optional[str] = typer.Argument(None, help="A job id or record name (default: the newest job)."),
         rank: Optional[int] = typer.Option(None, "--rank", "-r", min=0, max=MAX_RANKS - 1,
                                            help="Only this rank (0 to the job's size - 1)."),
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
         raw: bool = typer.Option(False, "--raw", help="Keep submitit's own log lines.")):
    from hpcring import jobfollow, jobstatus, submit as lib
    rec = lib.record(job_id) if job_id is not None else newest_job()
    if follow:
        oc = jobfollow.follow(rec, on_state=lambda st: None, rank=rank, tracebacks_once=True,
                              on_line=lambda r, stream, line: output.line(jobfollow.tag(r, stream, line)))
        _settle(rec, oc)
        if not oc.ok:      # as `submit --wait`: the verdict, and the failing rank's exit code
            raise jobstatus.describe_failure(rec, oc)
        return
    for line in jobfollow.tagged_lines(rec, rank, raw=raw):    # an array: every task, task by task
        output.line(line)


@command(app, help="Cancel a job (JOB: every task of an array; JOB_TASK: one task).")
@remote_aware()
def cancel(job_id: str = typer.Argument(...)):
    from hpcring import submit as lib
    rec = lib.record(job_id)
    ended = lib.cancel(rec)
    if ended is not None:
        output.info(f"job {job_id} has already ended ({ended.state}): nothing to cancel")
    else:
        output.info(f"cancel requested for job {job_id}")


@command(sites_app, "list", help="List known site configs (user dirs shadow bundled ones).")
def sites_list():
    from hpcring.config.site import available_sites
    output.sites_table(available_sites())


def _named_site(ref: str) -> str:
    """A site NAME|PATH argument: an empty one is refused (it would show the default site)."""
    if not ref.strip():
        from hpcring.errors import UsageError
        raise UsageError(f"site {ref!r} is empty", hint="give a site name (`hpcring sites list`) or the path of a "
                                                         "site YAML; leave it out of `sites validate` for all")
    return ref


@command(sites_app, "show", help="Show a site config and the environment derived from its fabric.")
def sites_show(site: str = typer.Argument(..., help="Name or path.")):
    from hpcring.config.site import load_site
    output.site_detail(load_site(_named_site(site)))


@command(sites_app, "validate", help="Validate site configs; lists every problem with file, line and key.")
def sites_validate(sites: Optional[List[str]] = typer.Argument(None, help="Names or paths (default: all known).")):
    from hpcring.config.site import available_sites, load_site
    refs = [_named_site(ref) for ref in sites] if sites else [str(p) for _, p, _ in available_sites()]
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


def _add_subapps() -> None:
    """The other layers' commands (each module imports its library only when it runs)."""
    from hpcring.cli import (bench_cmd, devcluster_cmd, doctor_cmd, hostlist_cmd, nodes_cmd, report_cmd, run_cmd,
                             stacks_cmd, timeline_cmd, top_cmd)
    app.add_typer(hostlist_cmd.app, name="hostlist")
    app.add_typer(nodes_cmd.app, name="nodes")
    app.add_typer(devcluster_cmd.app, name="devcluster")
    for mod in (run_cmd, bench_cmd, stacks_cmd, doctor_cmd, timeline_cmd, report_cmd, top_cmd):
        mod.register(app)


_add_subapps()


def main() -> None:
    app()
