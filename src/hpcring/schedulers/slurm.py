"""Slurm: submission through submitit's SlurmExecutor with our rendered template; state from sacct;
the srun line that starts the ranks (:func:`launch_argv`, for job scripts and ``hpcring run``)."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import submitit

from hpcring.config.jobspec import JobSpec
from hpcring.config.schema import SiteConfig
from hpcring.config.site import Site
from hpcring.errors import SchedulerError
from hpcring.render import render_script
from hpcring.schedulers.base import COMMAND_TIMEOUT, TERMINAL, JobState, run_command
from hpcring.schedulers.container import srun_options
from hpcring.schedulers.launch_words import LaunchRequest, LaunchWords, Shell, submitit_command

COMMAND = "sbatch"


class Executor(submitit.SlurmExecutor):
    """submitit's Slurm executor, but the sbatch file is hpcring's template for the site."""

    def __init__(self, folder: Path, site: Site, job: JobSpec, template: str | None, python: str) -> None:
        super().__init__(folder=folder, python=python)
        self._site, self._job, self._template = site, job, template
        self.parameters["time"] = job.time_min  # submitit's timeout bookkeeping (requeues)
        self.parameters["nodes"] = job.nodes
        self.parameters["ntasks_per_node"] = job.tasks_per_node

    @property
    def _submitit_command_str(self) -> str:
        return submitit_command(self.python, str(self.folder))   # submitit's leaves python unquoted

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_script(self._site, self._job, command, str(self.folder), self._template)


def launch_argv(site: SiteConfig, req: LaunchRequest) -> LaunchWords:
    """One srun step of ``req.ntasks`` tasks running ``req.command``.

    ``--kill-on-bad-exit=1``: a rank that exits non-zero (the watchdog after a diagnosed failure,
    a crash) ends the step, so no rank frozen or waiting on a dead peer holds the allocation.
    ``req.logs``: each task writes ``<logs>.out/.err`` (``%t`` = rank), as submitit expects.
    """
    lau = site.launcher
    lines = [("srun", "--unbuffered", "--kill-on-bad-exit=1")]
    if req.size_step:
        lines.append((f"--nodes={req.nodes}", f"--ntasks-per-node={req.tasks_per_node}", f"--ntasks={req.ntasks}"))
    if req.logs is not None:
        lines.append((f"--output={req.logs}.out", f"--error={req.logs}.err"))
    if lau.mpi:
        lines.append((f"--mpi={lau.mpi}",))
    lines += [(a,) for a in lau.args]
    pyxis = srun_options(req.container)
    if pyxis:
        lines.append(pyxis)
    lines += req.launched()
    return LaunchWords(tuple(lines))


def make_executor(site: Site, job: JobSpec, folder: Path, template: str | None, python: str):
    if shutil.which("sbatch") is None:
        raise SchedulerError(f"site {site.name!r} uses Slurm but `sbatch` is not on PATH on this machine",
                             hint="run on the cluster's login node, or use --site local")
    return Executor(folder, site, job, template, python)


def _run(cmd: list[str], timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    return run_command(cmd, timeout=timeout, missing_hint="run on the cluster's login node",
                       slow_hint="is slurmctld (or slurmdbd) up? try `sinfo`")


def _normalize(raw: str) -> str:
    word = raw.split()[0] if raw.split() else "UNKNOWN"
    return word.rstrip("+")


def exit_code(state: str, field: str) -> int | None:
    """sacct's ``ExitCode`` (``code:signal``) in the shell's convention (a signal N is 128 + N);
    None while the job runs (sacct says 0:0 then) and for a ``0:0`` of a job that did not
    complete (TIMEOUT, CANCELLED, a requeue): no exit code to show there, not a success."""
    if state not in TERMINAL:
        return None
    code, _, sig = field.partition(":")
    if not code.isdigit():
        return None
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return int(code) if int(code) or state == "COMPLETED" else None


def state(job_id: str) -> JobState:
    """sacct for a finished job (squeue forgets it after MinJobAge); squeue for a live one, since
    accounting lags behind (sacct says PENDING for a while after the ranks started)."""
    r = _run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "JobID,State,ExitCode,NodeList"])
    acct = None
    if r.returncode == 0:
        for line in r.stdout.splitlines():
            parts = line.split("|")
            if len(parts) >= 4 and parts[0] == str(job_id):
                st = _normalize(parts[1])
                acct = JobState(st, parts[1], exit_code(st, parts[2]), parts[3])
                break
    if acct is not None and acct.finished:
        return acct
    q = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%N"])
    if q.returncode == 0 and q.stdout.strip():
        st, _, nodes = q.stdout.strip().splitlines()[0].partition("|")
        return JobState(_normalize(st), st, None, nodes)
    if acct is not None:
        return acct
    if "Invalid job id" in q.stderr or q.returncode == 0:
        return JobState("UNKNOWN", (r.stderr or q.stderr).strip())
    raise SchedulerError(f"could not read the state of job {job_id}: {(r.stderr or q.stderr).strip()}")


def queued_at(job_id: str) -> float | None:
    """When the job was last queued, in seconds since the epoch: sacct's Submit, which a requeue
    resets (its Start is None when the job is cancelled before the requeued run begins). Whatever
    the job folder holds from before then belongs to an earlier run."""
    try:
        r = _run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "JobID,Submit"])
    except SchedulerError:
        return None
    for line in r.stdout.splitlines():
        jid, _, submit = line.partition("|")
        if jid == str(job_id):
            try:
                return time.mktime(time.strptime(submit.strip(), "%Y-%m-%dT%H:%M:%S"))
            except ValueError:
                return None
    return None


def cluster_name(site: Site) -> str:
    """Slurm's ClusterName (job ids are per cluster); the site's name when scontrol cannot say."""
    try:
        r = _run(["scontrol", "show", "config"])
    except SchedulerError:
        return site.name
    m = re.search(r"^ClusterName\s*=\s*(\S+)", r.stdout, re.M)
    return m.group(1) if m else site.name


def cancel(job_id: str) -> None:
    r = _run(["scancel", str(job_id)])
    if r.returncode != 0:
        raise SchedulerError(f"scancel {job_id} failed: {r.stderr.strip()}")


def explain_refusal(stderr: str) -> str | None:
    """A hint for sbatch's most common refusals."""
    s = stderr.lower()
    if "invalid partition" in s:
        return "the partition does not exist on this cluster: list them with `sinfo -s` and fix --partition or the site config"
    if "invalid account" in s:
        return "check --account (see `sacctmgr show assoc user=$USER`)"
    if "node count specification invalid" in s or "requested node configuration is not available" in s:
        return "fewer nodes/CPUs/GPUs exist than requested: see `sinfo -o '%P %D %c %G'`"
    if "time limit" in s:
        return "the --time is above the partition's limit"
    return None




def run_ending(job_id: str, restart_count: int, timeout: float = COMMAND_TIMEOUT) -> str | None:
    """Why Slurm is ending this run of the job (``scontrol requeue``, cancel, time limit, a node
    failure), or None while the run is RUNNING as far as Slurm knows. ``restart_count`` is this
    run's SLURM_RESTART_COUNT: a job already restarted past it belongs to a later run.
    Raises SchedulerError when slurmctld cannot be asked."""
    r = _run(["scontrol", "-o", "show", "job", str(job_id)], timeout)
    if r.returncode != 0:
        raise SchedulerError(f"scontrol show job {job_id}: {r.stderr.strip()}")
    fields = dict(w.split("=", 1) for w in r.stdout.split() if "=" in w)
    st, restarts = fields.get("JobState", "UNKNOWN"), fields.get("Restarts", "0")
    if restarts.isdigit() and int(restarts) > restart_count:
        return f"Slurm requeued job {job_id} (restart {restarts}; state {st})"
    if st != "RUNNING":
        return f"Slurm is ending job {job_id} (state {st})"
    return None
