"""LSF: a submitit executor that submits hpcring's rendered bsub script, states from bjobs.

The interface of schedulers/base.py (:class:`~hpcring.schedulers.base.Scheduler`) plus a submitit plugin registered through the ``submitit`` entry points
(``executor`` = :class:`LsfExecutor`, ``job_environment`` = :class:`LsfJobEnvironment`):

* submission: ``bsub < script`` (bsub parses ``#BSUB`` lines from stdin; ``bsub script`` would not
  unless the site sets LSB_BSUB_PARSE_SCRIPT=Y); the id from ``Job <ID> is submitted to queue <Q>.``
* every rank runs ``python -m hpcring.schedulers.lsf_task FOLDER``, which writes the rank's
  ``<jobid>_<rank>_log.out/.err`` and runs submitit's task entry: one result per rank, for any
  number of tasks;
* states: one ``bjobs -o "jobid stat exit_code exec_host jobindex" -noheader ID...`` for many jobs;
  a suspended job (PSUSP, USUSP, SSUSP) is SUSPENDED, which is not finished (submitit's own
  watcher would take it for finished); array element ``ID[i+1]`` is hpcring's task ``ID_i``;
* cancel: ``bkill``; requeue on preemption or timeout (the -wa warning signal): ``brequeue``;
* the line that starts the ranks (:func:`launch_argv`, for job scripts and ``hpcring run``):
  jsrun resource sets, ``blaunch -u HOSTFILE`` or ``mpirun --hostfile HOSTFILE``; one node's
  workers of ``hpcring run --elastic``: ``blaunch -z HOST`` (:func:`node_step_argv`).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
import re
import shutil
import subprocess
import sys
import typing as tp
from pathlib import Path

from submitit.core import core, job_environment, logger

from hpcring.bootstrap.allocation_size import allocation
from hpcring.bootstrap.launchers import detect
from hpcring.config.jobspec import JobSpec, resolve_job
from hpcring.config.schema import SiteConfig
from hpcring.config.site import Site, load_site
from hpcring.errors import SchedulerError
from hpcring.jobdir import job_id as _job_id
from hpcring.schedulers.render import render_script
from hpcring.schedulers.base import COMMAND_TIMEOUT, JobRecord, JobState, run_command, state_dir
from hpcring.schedulers.launch_words import LaunchRequest, LaunchWords, remote_shell, submitit_command
from hpcring.schedulers.lsf_steps import QUERY_TIMEOUT_S, bhosts_text, host_table

COMMAND = "bsub"
BJOBS_FORMAT = "jobid stat exit_code exec_host jobindex"   # jobindex last: 0 unless an array element

# LSF's job states -> hpcring's normalized ones (base.TERMINAL decides what is finished).
# A suspended job is alive: never finished. ZOMBI (killed, host unreachable) and UNKWN (host
# unreachable) are not known to be over, so they stay unfinished too.
STATES = {
    "PEND": "PENDING", "WAIT": "PENDING",
    "RUN": "RUNNING",
    "PSUSP": "SUSPENDED", "USUSP": "SUSPENDED", "SSUSP": "SUSPENDED",
    "DONE": "COMPLETED", "EXIT": "FAILED",
    "ZOMBI": "UNKNOWN", "UNKWN": "UNKNOWN",
}
UNFINISHED = {"PENDING", "RUNNING", "SUSPENDED", "UNKNOWN", "REQUEUED"}

_SUBMITTED = re.compile(r"Job <(\d+)> is submitted to (?:default )?queue <([^>]*)>")


def job_id_from_output(text: str | bytes) -> str:
    """``Job <123> is submitted to queue <normal>.`` -> ``123``."""
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    m = _SUBMITTED.search(text)
    if not m:
        raise SchedulerError(f"could not find a job id in bsub's answer: {text.strip()!r}",
                             hint="bsub normally prints 'Job <ID> is submitted to queue <QUEUE>.'")
    return m.group(1)


def parse_bjobs(text: str | bytes) -> dict[str, dict[str, str]]:
    """Lines of ``bjobs -o "jobid stat exit_code exec_host jobindex" -noheader`` -> {jobid: fields};
    an array element's key is LSF's ``ID[index]`` (bjobs prints the array's id on every element)."""
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].split("[")[0].isdigit():
            continue  # "Job <1> is not found" and the like go to stderr; skip anything else
        stat = parts[1]
        code = parts[2] if len(parts) > 2 else "-"
        hosts = parts[3] if len(parts) > 3 else "-"
        index = parts[4] if len(parts) > 4 else "0"
        key = f"{parts[0]}[{index}]" if index.isdigit() and int(index) > 0 else parts[0]
        out[key] = {"stat": stat, "State": STATES.get(stat, "UNKNOWN"), "exit_code": code,
                         "nodes": _exec_hosts(hosts)}
    return out


def _exec_hosts(field: str) -> str:
    """``2*node1:2*node2`` -> ``node1,node2``."""
    if field in ("-", ""):
        return ""
    return ",".join(dict.fromkeys(h.split("*")[-1] for h in field.split(":") if h))


def _cancel_marker(job_id: str) -> Path:
    return state_dir() / f"{job_id}.lsf-cancelled"


# ------------------------------------------------------------------------------ submitit plugin

class LsfInfoWatcher(core.InfoWatcher):
    """Polls bjobs for all registered jobs at once; a suspended job is not done."""

    def _make_command(self) -> list[str] | None:
        ids = sorted(self._registered - self._finished)
        return ["bjobs", "-o", BJOBS_FORMAT, "-noheader", *ids] if ids else None

    def read_info(self, string: tp.Union[bytes, str]) -> dict[str, dict[str, str]]:
        return parse_bjobs(string)

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        return self.get_state(job_id, mode=mode).upper() not in UNFINISHED


class LsfJob(core.Job):
    _cancel_command = "bkill"
    watcher = LsfInfoWatcher(delay_s=30)


class LsfJobEnvironment(job_environment.JobEnvironment):
    """submitit's view of a rank inside an LSF job (jsrun, blaunch or mpirun started it).

    Ranks come from hpcring's launcher tables (JSM_NAMESPACE_*, OMPI_*, blaunch's
    LSF_PM_TASKID with the LSF slot list), the job id from LSB_JOBID.
    """

    _env = {"job_id": "LSB_JOBID"}

    @property
    def job_id(self) -> str:
        """``<LSB_JOBID>_<task>`` for an array task (0-based, as its folder is named), else LSB_JOBID."""
        return _job_id()

    def activated(self) -> bool:
        executor = os.environ.get("SUBMITIT_EXECUTOR", "")
        return executor == "lsf" or (not executor and "LSB_JOBID" in os.environ)

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def _topology():
        return detect()

    @property
    def hostnames(self) -> list[str]:
        alloc = allocation()   # the job's hosts from the slot list, a launch node left out
        return list(dict.fromkeys(alloc.slots)) if alloc and alloc.slots else [self.hostname]

    @property
    def num_tasks(self) -> int:
        return self._topology().size

    @property
    def num_nodes(self) -> int:
        n = self._topology().num_nodes
        return n if n > 0 else len(self.hostnames)

    @property
    def node(self) -> int:
        return max(0, self._topology().node_rank)

    @property
    def global_rank(self) -> int:
        return self._topology().rank

    @property
    def local_rank(self) -> int:
        return max(0, self._topology().local_rank)

    def _requeue(self, countdown: int) -> None:
        jid = _lsf_id(self.job_id)
        subprocess.check_call(["brequeue", jid], timeout=60)
        logger.get_logger().info(f"Requeued job {jid} ({countdown} remaining timeouts)")


class LsfExecutor(core.PicklingExecutor):
    """submitit executor for LSF. The bsub script is hpcring's template rendered for ``site``.

    Standalone use: ``LsfExecutor(folder, site="lsf-summit")`` then ``update_parameters(nodes=2,
    tasks_per_node=6, time=60, partition="batch")``, then ``submit(fn)``: ``job.results()`` has
    one result per rank. hpcring's CLI passes a resolved JobSpec instead.
    """

    job_class = LsfJob

    def __init__(self, folder: tp.Union[str, Path], site: Site | str | None = None,
                 job: JobSpec | None = None, template: str | None = None, python: str | None = None,
                 max_num_timeout: int = 3) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout)
        self._site = site if isinstance(site, Site) else load_site(site or os.environ.get("HPCRING_SITE"))
        if self._site.config.scheduler != "lsf":
            raise SchedulerError(f"site {self._site.name!r} ({self._site.path}) is a "
                                 f"{self._site.config.scheduler} site, not an LSF one",
                                 hint="pass an LSF site config to LsfExecutor")
        self._job, self._template = job, template
        self.python = python or sys.executable
        self.parameters["timeout_min"] = (job or self._spec()).time_min

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {"nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "time", "partition",
                "account", "name", "timeout_min"}

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        bad = set(kwargs) - self._valid_parameters()
        if bad:
            raise ValueError(f"unknown LSF executor parameter(s) {sorted(bad)}; "
                             f"valid: {sorted(self._valid_parameters())}")
        if "timeout_min" in kwargs and "time" not in kwargs:
            kwargs["time"] = kwargs["timeout_min"]
        self.parameters.update(kwargs)
        self._job = None
        self.parameters["timeout_min"] = self._spec().time_min

    def _spec(self) -> JobSpec:
        if self._job is not None:
            return self._job
        cli = {k: v for k, v in self.parameters.items() if k != "timeout_min"}
        return resolve_job(self._site, cli.pop("name", None) or "submitit", [], cli, environ={})

    @property
    def _submitit_command_str(self) -> str:
        return rank_command(self.python, str(self.folder))

    def _num_tasks(self) -> int:
        return self._spec().ntasks

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_script(self._site, self._spec(), command, str(self.folder), self._template,
                             python=self.python)

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        # bsub reads #BSUB lines only from stdin: `bsub < file`.
        return ["/bin/sh", "-c", 'exec bsub < "$1"', "bsub", str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: tp.Union[bytes, str]) -> str:
        return job_id_from_output(string)


def rank_command(python: str, folder: str) -> str:
    """What every rank runs: hpcring's LSF task entry (per-rank logs), then submitit's."""
    return submitit_command(python, folder, module="hpcring.schedulers.lsf_task")


# ------------------------------------------------------------------------------ hpcring hooks

def launch_argv(site: SiteConfig, req: LaunchRequest) -> LaunchWords:
    """The launcher line for ``req.ntasks`` ranks, per ``site.launcher.kind``.

    jsrun: one resource set per rank, each with ``cpus_per_task`` CPUs (bound packed) and one GPU
    when the job has GPUs. blaunch: one task per line of ``req.hostfile``; it joins its words and
    runs them through a shell on each host, so they get one more level of quoting. mpirun:
    ``tasks_per_node`` per host of ``req.hostfile``. Per-rank logs are not launcher options here
    (lsf_task writes them from HPCRING_LOG_PATTERN), so ``req.logs`` is not used.
    """
    lau = site.launcher
    args, cmd = lau.args, req.launched()   # the command, after the container's prefix if any
    if lau.kind == "jsrun":
        head = ("jsrun", "-n", str(req.ntasks), "-r", str(req.tasks_per_node), "-a", "1",
                "-c", str(req.cpus_per_task), "-g", "1" if req.gpus_per_node else "0",
                "-b", f"packed:{req.cpus_per_task}")
    elif lau.kind == "blaunch":
        head = ("blaunch", "-u", req.hostfile)
        args, cmd = remote_shell(args), (remote_shell(req.command_words()),)
    elif lau.kind == "mpirun":
        head = ("mpirun", "-np", str(req.ntasks), "--hostfile", req.hostfile,
                "--map-by", f"ppr:{req.tasks_per_node}:node")
    else:   # the site schema refuses other kinds for LSF; a programming error if reached
        raise SchedulerError(f"launcher kind {lau.kind!r} does not run under LSF")
    return LaunchWords((head, *((a,) for a in args), *cmd))


# What a node's elastic step asks of LSF (lsb.applications, overridable from the job's environment):
# a task that crashes or a host that stops answering ends that host's tasks, not the whole job (by
# default LSF shuts the job down when it loses a task's RES), as salloc --no-kill does on Slurm.
KEEP_JOB_ENV = (("LSB_DJOB_COMMFAIL_ACTION", "KILL_TASKS"), ("LSB_DJOB_RTASK_GONE_ACTION", "IGNORE_TASKCRASH"))


def node_step_argv(host: str, tasks_per_node: int, command: Sequence[str]) -> list[str]:
    """``tasks_per_node`` tasks of ``command`` on ``host`` alone, through one ``blaunch -z``
    (hpcring run --elastic: a node's workers); their failure ends neither the job nor the other
    hosts' tasks (:data:`KEEP_JOB_ENV`). blaunch runs its words through a shell on the host, so
    each gets one more level of quoting."""
    if tasks_per_node < 1 or not host or any(c.isspace() for c in host):
        raise ValueError(f"a node step needs one host name and tasks_per_node >= 1, not {host!r} x {tasks_per_node}")
    keep = [f"{k}={v}" for k, v in KEEP_JOB_ENV]
    return ["env", *keep, "blaunch", "-z", " ".join([host] * tasks_per_node), *remote_shell(list(command))]


def make_executor(site: Site, job: JobSpec, folder: Path, template: str | None, python: str) -> LsfExecutor:
    if shutil.which("bsub") is None:
        raise SchedulerError(f"site {site.name!r} uses LSF but `bsub` is not on PATH on this machine",
                             hint="run on the cluster's login node (source LSF's profile.lsf), or use --site local")
    return LsfExecutor(folder, site=site, job=job, template=template, python=python)


def _run(cmd: list[str], timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    return run_command(cmd, timeout=timeout, missing_hint="run on the cluster's login node (source profile.lsf)",
                       slow_hint="is mbatchd up? try `bjobs` and `bhosts`")


def _lsf_id(job_id: str) -> str:
    """hpcring's id -> LSF's: array task ``12_0`` is ``12[1]`` (LSF's indices start at 1)."""
    head, sep, task = job_id.partition("_")
    return f"{head}[{int(task) + 1}]" if sep else head


def _hpcring_id(lsf_id: str) -> str:
    head, sep, index = lsf_id.partition("[")
    return f"{head}_{int(index.rstrip(']')) - 1}" if sep and index.rstrip("]").isdigit() else lsf_id


def states(recs: Sequence[JobRecord]) -> dict[str, JobState]:
    """The states of ``recs`` from ONE bjobs for all of them (bjobs keeps finished jobs for
    CLEAN_PERIOD, 1 h by default)."""
    wanted = list(dict.fromkeys(r.job_id for r in recs))
    if not wanted:
        return {}
    r = _run(["bjobs", "-o", BJOBS_FORMAT, "-noheader", *(_lsf_id(j) for j in wanted)])
    found = {_hpcring_id(k): v for k, v in parse_bjobs(r.stdout).items()}
    out = {}
    for job_id in wanted:
        info = found.get(job_id)
        if info is None:
            if "not found" in r.stderr or found:
                out[job_id] = JobState("UNKNOWN", r.stderr.strip())
                continue
            raise SchedulerError(f"could not read the state of job {job_id}: {(r.stderr or r.stdout).strip()}")
        st = info["State"]
        if st == "FAILED" and (_cancel_marker(job_id).exists() or _cancel_marker(job_id.split("_")[0]).exists()):
            st = "CANCELLED"
        code = info["exit_code"]
        exit_code = int(code) if code.isdigit() else (0 if info["stat"] == "DONE" else None)
        out[job_id] = JobState(st, info["stat"], exit_code, info["nodes"])
    return out


def state(job_id: str) -> JobState:
    """One job's state (:func:`states`)."""
    return states([JobRecord(str(job_id), "lsf", "", "", 0, "", "", 0.0)])[str(job_id)]


def cancel(rec: JobRecord | str) -> None:
    """bkill the job (an array's id: every task; ``12_0``: one task)."""
    job_id = rec.job_id if isinstance(rec, JobRecord) else str(rec)
    _cancel_marker(job_id).touch()
    r = _run(["bkill", _lsf_id(job_id)])
    if r.returncode != 0 and "already finished" not in r.stderr:
        _cancel_marker(job_id).unlink(missing_ok=True)
        raise SchedulerError(f"bkill {job_id} failed: {(r.stderr or r.stdout).strip()}")


def release(rec: JobRecord) -> None:
    """Nothing to release: LSF arrays are not submitted held (lsf_task makes the task folders)."""


def queued_at(rec: JobRecord) -> float | None:
    """Not asked of LSF: a requeued job's folder is told apart by rank 0's requeue count alone."""
    return None


def cluster_name(site: Site) -> str:
    return site.name


def first_casualty(rec: JobRecord) -> str | None:
    """blaunch, jsrun and mpirun write no line that hpcring reads as a casualty."""
    return None


def end_job_argv(environ: Mapping[str, str]) -> list[str] | None:
    """bkill the whole job: blaunch waits for every task, so one frozen task would hold the job
    until its run limit. None in a step of the job script's step loop (HPCRING_LSF_STEP set): the
    loop watches the hang report and ends the step itself, then restarts; a bkill would end it."""
    if environ.get("HPCRING_LSF_STEP"):
        return None
    return ["bkill", _lsf_id(_environment_job_id(environ))] if environ.get("LSB_JOBID") else None


def _environment_job_id(environ: Mapping[str, str]) -> str:
    return _job_id(environ)


def annotate_argv(headline: str, environ: Mapping[str, str]) -> list[str] | None:
    return None                # LSF has no comment field hpcring writes


def run_on_nodes(job_id: str, command, timeout: float) -> tuple[str, str, int, str]:
    raise SchedulerError(f"job {job_id} is an LSF job; running a probe on its nodes is supported on Slurm "
                         "and the local backend only",
                         hint="on a node of the job: `py-spy dump --pid PID`")


def explain_refusal(stderr: str) -> str | None:
    """A hint for bsub's most common refusals."""
    s = stderr.lower()
    if "no such queue" in s:
        return "the queue does not exist on this cluster: list them with `bqueues` and fix --partition or the site config"
    if "project" in s and ("not" in s or "invalid" in s):
        return "check --account (the LSF project, -P)"
    if "runlimit" in s or "run limit" in s or "-w " in s:
        return "the --time is above the queue's RUNLIMIT: see `bqueues -l QUEUE`"
    if "illegal option" in s:
        return "an option in the script or in --sched-arg is not one this bsub knows"
    if "ptile" in s or "span" in s or "slots" in s:
        return "fewer hosts/slots exist than requested: see `bhosts`"
    return None


# bhosts states of a host that takes no job until an administrator or a repair acts; the others
# (ok, closed_Full, closed_Busy, closed_Excl, closed_Wind, ...) pass with time
_SHUT = re.compile(r"^(unavail|unreach|closed_(Adm|Lock|LIM|EGO))$", re.I)


def never_fits(site: Site, job: JobSpec) -> str | None:
    """Why bsub would take ``job`` and leave it pending for ever (LSF accepts a job that excludes
    too many hosts; sbatch refuses one): fewer hosts that can ever take it (not excluded, not
    closed by an administrator or down, with slots for its tasks per host) than it asks for, its
    spares included. None when it may start, or when ``bhosts`` cannot say (absent, slow: one
    bounded query), or for CSM's whole-node (-nnodes) jobs, which bhosts does not describe."""
    if site.config.lsf.nnodes:
        return None
    table = host_table(bhosts_text(timeout=QUERY_TIMEOUT_S) or "")
    if not table:
        return None
    why = {}
    for h, (status, slots) in table.items():
        if h in job.exclude:
            why[h] = "excluded"
        elif _SHUT.match(status):
            why[h] = status
        elif slots is not None and slots < job.tasks_per_node:
            why[h] = f"{slots} slots"
    fit, need = len(table) - len(why), job.alloc_nodes
    if fit >= need:
        return None
    asks = f"{need} hosts" + (f" ({job.nodes} and {job.spare_nodes} spare)" if job.spare_nodes else "")
    left = ", ".join(f"{h} ({w})" for h, w in list(why.items())[:8]) + (", ..." if len(why) > 8 else "")
    return (f"it asks for {asks} with {job.tasks_per_node} slots each, and {fit} of the cluster's "
            f"{len(table)} hosts can ever take it (bhosts; left out: {left})")


def run_ending(job_id: str, timeout: float = COMMAND_TIMEOUT) -> str | None:
    """Why LSF is ending this run of the job (``brequeue``, ``bkill``, the run limit), or None
    while bjobs says RUN. ``job_id``: hpcring's (an array task's ``12_0`` is element ``12[1]``).
    Raises SchedulerError when bjobs cannot be asked."""
    r = _run(["bjobs", "-o", BJOBS_FORMAT, "-noheader", _lsf_id(str(job_id))], timeout)
    info = parse_bjobs(r.stdout).get(_lsf_id(str(job_id)))
    if info is None:
        raise SchedulerError(f"bjobs {job_id}: {(r.stderr or r.stdout).strip()}")
    return None if info["stat"] == "RUN" else f"LSF is ending job {job_id} (state {info['stat']})"
