"""Slurm (base.Scheduler): submission through submitit's SlurmExecutor with our rendered template;
states of many jobs from one sacct (and one squeue for those still alive); scancel, scontrol, and
srun's own lines; the srun line that starts the ranks (:func:`launch_argv`, for job scripts and
``hpcring run``) and the per-node probe step of ``hpcring stacks``."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import submitit

from hpcring.config.jobspec import JobSpec
from hpcring.config.schema import SiteConfig
from hpcring.config.site import Site
from hpcring.errors import HpcringError, JobNotFoundError, SchedulerError
from hpcring.schedulers.render import render_script
from hpcring.schedulers.base import COMMAND_TIMEOUT, TERMINAL, JobRecord, JobState, run_command
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
        return render_script(self._site, self._job, command, str(self.folder), self._template, python=self.python)


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


def rank_command(python: str, folder: str) -> str:
    """What every rank runs: submitit's task entry (srun writes the per-rank logs)."""
    return submitit_command(python, folder)


_ARRAY_ID = re.compile(r"(\d+)_\[([\d,\-]+)(?:%\d+)?\]\Z")


def _job_ids(field: str) -> list[str]:
    """sacct/squeue JobID -> the ids it stands for: ``38``, ``38_2``, and ``38_[2-5,9%2]`` (array
    tasks not started yet, one line for them all) -> ``38_2`` ... ``38_5``, ``38_9``."""
    m = _ARRAY_ID.match(field)
    if not m:
        return [field]
    out = []
    for part in m.group(2).split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            out += [f"{m.group(1)}_{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def _base(job_id: str) -> str:
    return job_id.split("_", 1)[0]


def states(recs: Sequence[JobRecord]) -> dict[str, JobState]:
    """The states of ``recs`` (plain jobs and array tasks, ``38_2``), keyed by job id, from ONE sacct
    for all of them, plus one squeue for those sacct does not show finished: accounting lags
    (sacct says PENDING for a while after the ranks started) and squeue forgets a job after
    MinJobAge, so a finished job is sacct's word and a live one squeue's."""
    wanted = list(dict.fromkeys(r.job_id for r in recs))
    if not wanted:
        return {}
    ids = ",".join(dict.fromkeys(_base(j) for j in wanted))
    r = _run(["sacct", "-X", "-n", "-P", "-j", ids, "-o", "JobID,State,ExitCode,NodeList"])
    acct: dict[str, JobState] = {}
    if r.returncode == 0:
        for line in r.stdout.splitlines():
            parts = line.split("|")
            if len(parts) >= 4:
                st = _normalize(parts[1])
                one = JobState(st, parts[1], exit_code(st, parts[2]), parts[3])
                if "[" not in parts[0]:
                    acct[parts[0]] = one
                else:              # 38_[1-2%1] still lists a task that has its own line once it started
                    for jid in _job_ids(parts[0]):
                        acct.setdefault(jid, one)
    live = [j for j in wanted if not (j in acct and acct[j].finished)]
    queue: dict[str, JobState] = {}
    q = None
    if live:
        q = _run(["squeue", "-h", "-r", "-j", ",".join(dict.fromkeys(_base(j) for j in live)), "-o", "%i|%T|%N"])
        if q.returncode == 0:
            for line in q.stdout.splitlines():
                jid, _, rest = line.strip().partition("|")
                st, _, nodes = rest.partition("|")
                for one in _job_ids(jid):
                    queue[one] = JobState(_normalize(st), st, None, nodes)
    out = {}
    for j in wanted:
        if j in acct and acct[j].finished:
            out[j] = acct[j]
        elif j in queue:
            out[j] = queue[j]
        elif j in acct:
            out[j] = acct[j]
        elif q is not None and ("Invalid job id" in q.stderr or q.returncode == 0):
            out[j] = JobState("UNKNOWN", (r.stderr or q.stderr).strip())
        else:
            raise SchedulerError(f"could not read the state of job {j}: {(r.stderr or (q.stderr if q else '')).strip()}")
    return out


def state(job_id: str) -> JobState:
    """One job's state (:func:`states`)."""
    return states([JobRecord(str(job_id), "slurm", "", "", 0, "", "", 0.0)])[str(job_id)]


def queued_at(rec: JobRecord | str) -> float | None:
    """When the job was last queued, in seconds since the epoch: sacct's Submit, which a requeue
    resets (its Start is None when the job is cancelled before the requeued run begins). Whatever
    the job folder holds from before then belongs to an earlier run."""
    job_id = rec.job_id if isinstance(rec, JobRecord) else str(rec)
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


def cancel(rec: JobRecord) -> None:
    """scancel the job: an array's id cancels every task, ``38_2`` one task."""
    r = _run(["scancel", rec.job_id])
    if r.returncode != 0:
        raise SchedulerError(f"scancel {rec.job_id} failed: {r.stderr.strip()}")


def release(rec: JobRecord) -> None:
    """Start a job submitted held (an array: its task folders now exist, see the template)."""
    r = _run(["scontrol", "release", rec.job_id])
    if r.returncode != 0:
        raise SchedulerError(f"scontrol release {rec.job_id} failed: {r.stderr.strip()}",
                             hint=f"release it by hand (`scontrol release {rec.job_id}`) or cancel it")


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


def never_fits(site, job) -> str | None:
    """None: sbatch itself refuses a job that no set of nodes can take ("Requested node
    configuration is not available"), --exclude included."""
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


# ---- srun's own lines, the end of a job, the stack probe ----------------------------------------

_SRUN_CASUALTY = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (Killed|Terminated|Segmentation fault|Aborted)")


def first_casualty(rec: JobRecord) -> str | None:
    """The first rank srun reported killed by a signal (its own line in rank 0's stderr log),
    e.g. "rank 3 (node2) was killed (srun: Killed)"; None when srun reported none."""
    path = Path(rec.folder) / f"{rec.job_id}_0_log.err"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    m = _SRUN_CASUALTY.search(text)
    if not m:
        return None
    node, ranks, how = m.groups()
    return f"rank{'s' if ',' in ranks or '-' in ranks else ''} {ranks} ({node}) {'was' if ranks.isdigit() else 'were'} killed first (srun: {how})"


def end_job_argv(environ: Mapping[str, str]) -> list[str] | None:
    """Inside a step: SIGKILL to every task of it (reaches stopped ones; the batch script's srun
    then fails, so the job ends FAILED). None outside a step (the batch script, a probe)."""
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_ID") not in (None, "", "batch", "extern"):
        return ["scancel", "--signal=KILL", f"{environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"]
    return None


def annotate_argv(headline: str, environ: Mapping[str, str]) -> list[str] | None:
    """The report's headline into the job's Comment (``scontrol show job``, ``squeue -o %k``)."""
    if environ.get("SLURM_JOB_ID"):
        text = " ".join(f"hpcring: {headline}".split())[:250]
        return ["scontrol", "update", f"JobId={environ['SLURM_JOB_ID']}", f"Comment={text}"]
    return None


def available() -> bool:
    """Is this a Slurm login node (squeue on PATH)?"""
    return shutil.which("squeue") is not None


PROBE_GRACE_S = 10.0     # srun's own start and teardown on top of the probes' deadline


def _running(job_id: str) -> tuple[int, str, str]:
    """(node count, nodelist, Slurm's own id: an array task's 38_2 has a job id of its own) of a
    RUNNING job; raises when it is not running."""
    r = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%D|%N|%A"])
    line = r.stdout.strip().splitlines()[0] if r.stdout.strip() else ""
    if r.returncode != 0 and "Invalid job id" not in r.stderr:
        raise SchedulerError(f"squeue -j {job_id} failed: {r.stderr.strip()}")
    if not line:
        raise JobNotFoundError(f"job {job_id} is not in squeue: it has finished or never existed",
                               hint=f"`hpcring status {job_id}` or `sacct -j {job_id}` for finished jobs")
    st, count, nodelist, own = (line.split("|") + ["", "", ""])[:4]
    if st != "RUNNING":
        raise HpcringError(f"job {job_id} is {st}, not RUNNING: there are no rank processes to look at",
                           hint="wait until it runs (`squeue -j " + job_id + "`)" if st == "PENDING" else None)
    return int(count), nodelist, own or job_id


def probe_argv(job_id: str, nodes: int, command: list[str]) -> list[str]:
    """The srun step that runs ``command`` once on every node of the running job."""
    return ["srun", f"--jobid={job_id}", "--overlap", f"-N{nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            "--job-name=hpcring-stacks", "--kill-on-bad-exit=0", "--quiet", *command]


def run_on_nodes(job_id: str, command, timeout: float) -> tuple[str, str, int, str]:
    """Run ``command(slurm_job_id)`` (the words, given the id the ranks see as SLURM_JOB_ID: an
    array task's own) once per node of the RUNNING job ``job_id`` (an srun step beside the job's
    own, ``--overlap``), at most ``timeout`` seconds: (stdout, stderr, exit code (124: too
    slow), the nodelist). Raises when the job is not running or srun is missing."""
    nodes, nodelist, own = _running(job_id)
    cmd = probe_argv(own, nodes, command(own))
    if shutil.which("timeout"):
        cmd = ["timeout", "-k", "5", f"{timeout:g}", *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15, stdin=subprocess.DEVNULL)
        return r.stdout, r.stderr, r.returncode, nodelist
    except FileNotFoundError:
        raise SchedulerError("`srun` is not on PATH", hint="run on the cluster's login node") from None
    except subprocess.TimeoutExpired as exc:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return text(exc.stdout), text(exc.stderr), 124, nodelist
