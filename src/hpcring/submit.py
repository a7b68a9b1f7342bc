"""Submitting, following and inspecting jobs: the library behind `hpcring submit|status|logs|cancel`.

Nothing here prints: callers pass callbacks for state changes and log lines.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from submitit.core.utils import FailedJobError

from hpcring import schedulers
from hpcring.bootstrap import auth
from hpcring.config.jobspec import JobSpec, job_root as jobspec_root
from hpcring.config.site import Site
from hpcring.ranks import rank_ranges
from hpcring.errors import HpcringError, JobFailedError, JobNotFoundError, SchedulerError, UsageError
from hpcring.bootstrap.auth import delete_secret_file
from hpcring.job import RunScript
from hpcring.outcome import Outcome, hang_headline as outcome_hang_headline, rank_failure, read_records, summarize
from hpcring.schedulers.render import render_script
from hpcring.config.arrays import sweep_args
from hpcring.fsutil import write_json
from hpcring.schedulers.base import (JobRecord, JobState, TERMINAL, load_record, new_record, recent_records,
                                     state_dir)



def job_root(job: JobSpec) -> Path:
    return jobspec_root(job.job_dir)


def _check_script(job: JobSpec) -> Path:
    p = Path(job.script)
    if not p.is_file():
        raise UsageError(f"script {job.script!r} does not exist (cwd {os.getcwd()})",
                         hint="pass the path of the Python script each rank runs")
    return p.resolve()


def _python(site: Site) -> str:
    return site.config.python or sys.executable


def preview(site: Site, job: JobSpec, template: str | None = None, warn: bool = True) -> str:
    """The exact script `submit` would hand to the scheduler (job id still a placeholder)."""
    folder = str(job_root(job) / "%j")
    command = schedulers.get(site.config.scheduler).rank_command(_python(site), folder)   # as the executors do
    return render_script(site, job, command, folder, template, python=_python(site), warn=warn)


NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/user")   # private to each node on most clusters


def node_local_warnings(site: Site, job: JobSpec, cwd: str | None = None) -> list[str]:
    """Why the ranks may not find the job's working directory or script: they lie under a folder
    that is private to each node on most clusters. Empty for the local backend (one machine). A
    warning, not an error: a site may share such a folder, and the ranks name what they miss."""
    if site.config.scheduler == "local":
        return []
    out = []
    for what, path in (("working directory", cwd or os.getcwd()), ("script", str(Path(job.script).resolve()))):
        for d in NODE_LOCAL_DIRS:
            if path == d or path.startswith(d + "/"):
                out.append(f"the job's {what} {path} is under {d}, which is private to each node on most "
                           f"clusters: if the nodes do not see it, every rank fails at start (submit from a "
                           f"shared file system)")
                break
    return out


def submit(site: Site, job: JobSpec, template: str | None = None, entry=None) -> JobRecord:
    """Submit through submitit; returns the record saved for status/logs/cancel.

    ``entry``: what every rank calls (pickled by submitit): by default ``RunScript`` of
    ``job.script``; ``hpcring.Executor`` passes a ``RunFunction`` (``job.script`` is then its label).
    What can be checked here is checked before the scheduler sees the job, and a submission that
    fails leaves no job folder, secret or submitit file behind."""
    script = str(_check_script(job)) if entry is None else job.script
    preview(site, job, template, warn=False)   # a template that fails or is no job script: nothing made
    state_dir()                                # where the record goes: an unusable one is refused now
    mod = schedulers.get(site.config.scheduler)
    root = job_root(job)
    ex = mod.make_executor(site, job, root / "%j", template, _python(site))   # makes nothing (no sbatch: refused)
    if entry is None:
        sweep = ({str(i): sweep_args(v) for i, v in zip(job.array.indices, job.sweep)} if job.sweep else None)
        entry = RunScript(script, job.args, os.getcwd(), job.gpus_per_node, sweep=sweep)
    with _cleared_on_failure(root, job):
        try:
            sjob = ex.submit(entry)
        except FailedJobError as exc:
            text = str(exc).strip()
            raise SchedulerError(f"{mod.COMMAND} refused the job: {text}",
                                 hint=mod.explain_refusal(text) or "see the scheduler's message above") from None
    folder = str(root / str(sjob.job_id))
    array = {} if job.array is None else {"array": list(job.array.indices), "array_limit": job.array.limit,
                                          "sweep": job.sweep}
    rec = new_record(str(sjob.job_id), site.config.scheduler, str(site.path), folder, job.ntasks,
                     job.name, script, mod.cluster_name(site), job.env["HPCRING_SECRET_FILE"], **array)
    if job.array is not None:
        _start_tasks(mod, rec)
    return rec


@contextlib.contextmanager
def _cleared_on_failure(root: Path, job: JobSpec):
    """Make the job root (a UsageError naming it when it cannot be made or written) and the job's
    secret; if the block fails, remove what this submission left: the secret (when made here),
    submitit's temporary files (``<uuid>.pkl``, ``.submission_file_<uuid>.sh``) and the folders
    made here."""
    where = job.sources.get("job_dir", "job_dir")
    missing, p = [], root
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    made = [d for d in reversed(missing)] + ([] if os.path.lexists(root / ".secrets") else [root / ".secrets"])
    before: set[str] = set()
    new_secret = "HPCRING_SECRET_FILE" not in job.env   # a restart resubmits with the first attempt's

    def undo() -> None:
        if new_secret:
            delete_secret_file(job.env.pop("HPCRING_SECRET_FILE", None))
        try:
            for entry in root.iterdir():
                if entry.name not in before and entry.is_file() and (
                        entry.name.startswith(".submission_file_") or entry.suffix == ".pkl"):
                    entry.unlink(missing_ok=True)
        except OSError:
            pass
        for d in reversed(made):      # innermost first; only when nothing else is in there
            try:
                d.rmdir()
            except OSError:
                pass
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hpcring-probe-", dir=root)   # as root too: a read-only mount
        os.close(fd)
        os.unlink(probe)
        before = {e.name for e in root.iterdir()}
        if new_secret:
            job.env["HPCRING_SECRET_FILE"] = str(auth.new_job_secret(root))
    except OSError as exc:
        undo()
        raise UsageError(f"cannot use the job folder {root} ({where}): {exc.strerror or exc}",
                         hint="set job_dir in the site config, HPCRING_JOB_DIR or Executor(folder=) to a "
                              "writable shared path") from None
    try:
        yield
    except BaseException:
        undo()
        raise


def _start_tasks(mod, rec: JobRecord) -> None:
    """Give every array task its folder and submitit's pickle (the ranks look for
    ``<id>_<task>/<id>_<task>_submitted.pkl``), record which task has which values, then let the
    scheduler start them (Slurm's array was submitted held: it opens its --output in these folders)."""
    pickle = Path(rec.folder) / f"{rec.job_id}_submitted.pkl"
    write_json(Path(rec.folder) / "array.json", {"tasks": rec.array, "limit": rec.array_limit,
                                                 "sweep": rec.sweep})
    for task in rec.tasks():
        folder = Path(task.folder)
        folder.mkdir(parents=True, exist_ok=True)
        _install_pickle(pickle, folder / f"{task.job_id}_submitted.pkl")
    mod.release(rec)


def _install_pickle(pickle: Path, target: Path) -> None:
    """Make ``target`` this job's pickle, replacing whatever is there in one step. A pickle already
    there is another job's: job ids of clusters that share a job_dir overlap (the dev cluster's Slurm
    and its LSF emulation both start at 1), and keeping it made the task run that job's function.
    A rank waiting for the file (submitit polls for it) sees either nothing or the whole new one."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(pickle, tmp)
        except OSError:                # a file system without hard links
            import shutil
            shutil.copyfile(pickle, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def record(job_id: str) -> JobRecord:
    return load_record(job_id)


def newest() -> JobRecord:
    """The most recently submitted job's record."""
    recs = recent_records(1)
    if not recs:
        raise JobNotFoundError("no job was submitted through hpcring from this account yet",
                               hint="submit one with `hpcring submit SCRIPT`, or pass a job id")
    return recs[0]


def recent(limit: int = 10) -> list[tuple[JobRecord, JobState | None, str | None]]:
    """The newest ``limit`` jobs with their states: (record, state, None), or (record, None, why)
    when the scheduler could not say (its commands missing or failing). One query per scheduler
    for all of them (an array's state is :func:`array_state` of its tasks')."""
    recs = recent_records(limit)
    known, why = job_states(recs)
    out = []
    for rec in recs:
        if rec.job_id in why:
            out.append((rec, None, why[rec.job_id].message))
        elif rec.array is not None:
            out.append((rec, array_state({t.job_id: known[t.job_id] for t in rec.tasks()}), None))
        else:
            out.append((rec, known[rec.job_id], None))
    return out


def job_states(recs: list[JobRecord]) -> tuple[dict[str, JobState], dict[str, HpcringError]]:
    """(states by job id, the error of a scheduler that could not say, by job id) of ``recs``,
    array tasks included: ONE ``states`` call per scheduler for all of them."""
    by_sched: dict[str, list[JobRecord]] = {}
    for rec in recs:
        by_sched.setdefault(rec.scheduler, []).extend(rec.tasks() if rec.array is not None else [rec])
    known: dict[str, JobState] = {}
    why: dict[str, HpcringError] = {}
    parents = {t.job_id: r.job_id for r in recs if r.array is not None for t in r.tasks()}
    for name, group in by_sched.items():
        try:
            known.update(schedulers.get(name).states(group))
        except HpcringError as exc:
            for r in group:
                why[parents.get(r.job_id, r.job_id)] = exc
    for rec in recs:               # over for good (a requeued job is not): its secret goes; an array's
        if rec.parent:             # tasks share one, kept until the last task has ended
            continue
        ones = rec.tasks() if rec.array is not None else [rec]
        if all(o.job_id in known and known[o.job_id].finished for o in ones):
            delete_secret_file(rec.secret_file)
    return known, why


def job_state(rec: JobRecord) -> JobState:
    """One job's state (an array's: :func:`array_state`); raises when the scheduler cannot say."""
    known, why = job_states([rec])
    if rec.job_id in why:
        raise why[rec.job_id]              # with the scheduler's own hint
    if rec.array is not None:
        return array_state({t.job_id: known[t.job_id] for t in rec.tasks()})
    return known[rec.job_id]


_ORDER = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "RUNNING", "SUSPENDED", "PENDING")


def summary(states: dict[str, JobState]) -> str:
    """``4 COMPLETED, 2 RUNNING, 10 PENDING``: one part per state, finished ones first."""
    counts: dict[str, int] = {}
    for st in states.values():
        counts[st.state] = counts.get(st.state, 0) + 1
    keys = sorted(counts, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))
    return ", ".join(f"{counts[k]} {k}" for k in keys)


def array_state(states: dict[str, JobState]) -> JobState:
    """An array as one state: RUNNING/PENDING while a task is, else COMPLETED when every task did,
    else the first other ending (FAILED, CANCELLED, ...); ``raw`` is :func:`summary`; the exit
    code is the first failing task's."""
    words = [st.state for st in states.values()]
    if any(w not in TERMINAL for w in words):
        word = "RUNNING" if any(w == "RUNNING" for w in words) else next(w for w in words if w not in TERMINAL)
    else:
        word = next((w for w in words if w != "COMPLETED"), "COMPLETED")
    code = next((st.exit_code for st in states.values() if st.state != "COMPLETED" and st.exit_code), None)
    return JobState(word, summary(states), code if word in TERMINAL else None,
                    ",".join(dict.fromkeys(st.nodelist for st in states.values() if st.nodelist)))


def wait_array(rec: JobRecord, on_change: Callable[[JobState], None], poll_s: float = 1.0) -> JobState:
    """Until every task of the array has ended: one query per round, rounds further apart
    (x1.5, at most STATE_POLL_MAX_S) while nothing changes; ``on_change`` gets each new summary."""
    last, interval = None, poll_s
    while True:
        st = job_state(rec)
        if st.raw != last:
            on_change(st)
            last, interval = st.raw, poll_s
        else:
            interval = min(interval * 1.5, max(poll_s, STATE_POLL_MAX_S))
        if st.finished:
            return st
        time.sleep(interval)


def cancel(rec: JobRecord) -> JobState | None:
    """Cancel the job (an array: every task; a task record: that task); returns its state instead
    when it had already ended (nothing to cancel)."""
    mod = schedulers.get(rec.scheduler)
    try:
        st = job_state(rec)
    except HpcringError:
        st = None                  # the scheduler cannot say: ask it to cancel anyway
    if st is not None and st.finished:
        return st
    mod.cancel(rec)
    return None


# ---- logs ---------------------------------------------------------------------------------

_NOISE = ("submitit INFO",)
# Slurm's own messages are not the ranks' output: srun's land in rank 0's log (the batch script's
# --error is %j_0_log.err, as submitit expects), slurmstepd's ("slurmstepd-node1: error: *** STEP
# 5.0 ON node1 CANCELLED ...") in the log of a rank on that node.
_SRUN_LINE = "srun: "
_STEPD_LINE = "slurmstepd"
LAUNCHER = "slurm"     # the tag of those lines: [slurm]<stderr>:srun: ...


def log_files(rec: JobRecord, rank: int | None = None) -> list[tuple[int, str, Path]]:
    ranks = range(rec.ntasks) if rank is None else [rank]
    if rank is not None and not 0 <= rank < rec.ntasks:
        raise UsageError(f"--rank {rank} is out of range: job {rec.job_id} has ranks 0-{rec.ntasks - 1}",
                         hint=f"pass a rank from 0 to {rec.ntasks - 1}, or drop --rank for every rank")
    folder = Path(rec.folder)
    return [(r, s, folder / f"{rec.job_id}_{r}_log.{ext}") for r in ranks for s, ext in
            (("stdout", "out"), ("stderr", "err"))]


class LogTail:
    """Incremental reader of every rank's log files; yields whole lines tagged by rank (or
    ``LAUNCHER`` for Slurm's own lines)."""

    def __init__(self, rec: JobRecord, rank: int | None = None, raw: bool = False) -> None:
        self.files = log_files(rec, rank)
        self.pos = {p: 0 for _, _, p in self.files}
        self.partial = {p: b"" for _, _, p in self.files}
        self.raw = raw

    def poll(self, final: bool = False) -> Iterator[tuple[int, str, str]]:
        for r, stream, path in self.files:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.pos[path])
                    data = fh.read()
                    self.pos[path] = fh.tell()
            except FileNotFoundError:
                continue
            buf = self.partial[path] + data
            *lines, rest = buf.split(b"\n")
            if final and rest:
                lines, rest = lines + [rest], b""
            self.partial[path] = rest
            for line in lines:
                text = line.decode(errors="replace")
                if not self.raw and text.startswith(_NOISE):
                    continue
                if stream == "stderr" and (text.startswith(_STEPD_LINE) or (r == 0 and text.startswith(_SRUN_LINE))):
                    yield LAUNCHER, stream, text
                    continue
                yield r, stream, text


def tag(rank: int | str, stream: str, line: str) -> str:
    """mpirun --tag-output style: ``[rank]<stdout>:line``."""
    return f"[{rank}]<{stream}>:{line}"


def tagged_lines(rec: JobRecord, rank: int | None = None, raw: bool = False) -> Iterator[str]:
    """Every line the job's ranks wrote so far, tagged (:func:`tag`); an array's task by task,
    tagged ``[task:rank]`` (``hpcring logs`` and ``hpcring.Job.logs()``)."""
    for one in rec.tasks() if rec.array is not None else [rec]:
        for r, stream, line in LogTail(one, rank, raw=raw).poll(final=True):
            yield tag(r if one is rec else f"{one.task_index}:{r}", stream, line)


# ---- outcome --------------------------------------------------------------------------------

def rank_statuses(rec: JobRecord) -> dict[int, dict]:
    return read_records(rec.folder, rec.job_id, ranks_of(rec))


def ranks_of(rec: JobRecord) -> int:
    """The ranks of the job's last run: fewer than submitted when a restart inside the allocation
    went on with fewer nodes (``--min-nodes``; hpcring.steps)."""
    from hpcring.steps import final_size
    return final_size(rec.folder, rec.ntasks)


def outcome(rec: JobRecord, st: JobState) -> Outcome:
    return summarize(rank_statuses(rec), ranks_of(rec), st)


def first_casualty(rec: JobRecord) -> str | None:
    """The launcher's own word on the first rank killed by a signal (srun's), or None."""
    return schedulers.get(rec.scheduler).first_casualty(rec)


def hang_headline(rec: JobRecord) -> tuple[str, Path] | None:
    """(headline, report path) of the hang report (``<folder>/diag/hang-report.json``) of the
    job's latest run: a requeued job keeps its folder, and a report older than the run's start
    (rank 0's requeue count, written at each start) belongs to an earlier run."""
    return outcome_hang_headline(Path(rec.folder) / "diag", since=run_started(rec))


def run_started(rec: JobRecord) -> float | None:
    """When the job's latest run started (the mtime of rank 0's requeue count), or was queued
    again (the scheduler's ``queued_at``: a requeued job cancelled before it ran again has no
    newer start), or None."""
    times = []
    try:
        times.append((Path(rec.folder) / f"{rec.job_id}_requeues.json").stat().st_mtime)
    except OSError:
        pass
    try:
        times.append(schedulers.get(rec.scheduler).queued_at(rec))
    except HpcringError:
        pass
    return max((t for t in times if t is not None), default=None)


def requeues(rec: JobRecord) -> int:
    """How many times the job was requeued (rank 0 writes the count at each start)."""
    try:
        return int(json.loads((Path(rec.folder) / f"{rec.job_id}_requeues.json").read_text())["count"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def preempt_warning(rec: JobRecord) -> dict | None:
    """{"signal", "at"} when the scheduler warned the job (time limit or preemption)."""
    try:
        return json.loads((Path(rec.folder) / f"{rec.job_id}_preempt.json").read_text())
    except (OSError, ValueError):
        return None


def describe_failure(rec: JobRecord, oc: Outcome) -> JobFailedError:
    parts = []
    hang = hang_headline(rec)
    warned = preempt_warning(rec)
    if oc.state.state in ("TIMEOUT", "PREEMPTED", "DEADLINE"):
        # The scheduler ended it; whatever the collectives saw while ranks were being killed is noise.
        why = "reached its time limit" if oc.state.state != "PREEMPTED" else "was preempted"
        told = (f" after the {warned['signal']} warning at {time.strftime('%H:%M:%S', time.localtime(warned['at']))};"
                " the script did not stop (check hpcring.preempted(comm) and raise hpcring.Preempted)"
                if warned else "")
        hint = ("the local backend neither warns nor requeues: raise --time (or HPCRING_TIME)"
                if rec.scheduler == "local" else "checkpoint on the warning to be requeued: see docs/preemption.md")
        return JobFailedError(f"job {rec.job_id} ({rec.name}) {oc.state.state}: the job {why}{told}",
                              exit_code=oc.state.exit_code or 1, hint=hint)
    if hang:         # the watchdog's diagnosis says more than "every rank exited with 1"
        parts.append(f"collective failure: {hang[0]} (report: {hang[1]})")
    elif not oc.failed and (casualty := first_casualty(rec)) is not None:
        # only when no rank recorded its own failure: after one does, hpcring's teardown kills
        # the step, and srun's "Killed" lines are that consequence, not the cause
        parts.append(casualty)
    if oc.failed:  # the first failure in full; the others by rank and host (often the same cause)
        s = oc.failed[0]
        parts.append(rank_failure(s))
        others = [f"{o['rank']} ({o.get('host', '?')})" for o in oc.failed[1:]]
        if others:
            parts.append(f"also failed: rank{'s' if len(others) > 1 else ''} {', '.join(others)}")
    if oc.missing and oc.state.state != "COMPLETED":
        parts.append(f"rank{'s' if len(oc.missing) > 1 else ''} {rank_ranges(oc.missing)} did not finish")
    code = oc.exit_code or 1
    msg = f"job {rec.job_id} ({rec.name}) {oc.state.state}" + (": " + "; ".join(parts) if parts else "")
    return JobFailedError(msg, exit_code=code,
                          hint=f"see `hpcring logs {rec.job_id}" + (f" --rank {oc.failed[0]['rank']}`" if oc.failed else "`"))


class SameTracebackOnce:
    """Passes lines on to ``emit``, except a traceback that another rank already showed word for
    word: that one becomes a single line naming the rank and the exception. A failure on every
    rank is then read once, not once per rank."""

    HEADER = "Traceback (most recent call last):"

    def __init__(self, emit: Callable[[int | str, str, str], None]) -> None:
        self.emit = emit
        self.shown: dict[str, int | str] = {}        # traceback text -> the rank that showed it
        self.open: dict[tuple, list[str]] = {}       # (rank, stream) -> a traceback being read

    def __call__(self, rank: int | str, stream: str, line: str) -> None:
        key = (rank, stream)
        block = self.open.get(key)
        if block is None:
            if line == self.HEADER:
                self.open[key] = [line]
            else:
                self.emit(rank, stream, line)
            return
        block.append(line)
        if line and not line[0].isspace():           # the exception line ends the traceback
            self._close(key)

    def flush(self) -> None:
        """Show what is left of tracebacks cut short (a rank killed while printing)."""
        for key in list(self.open):
            self._close(key, complete=False)

    def _close(self, key: tuple, complete: bool = True) -> None:
        block = self.open.pop(key)
        first = self.shown.setdefault("\n".join(block), key[0]) if complete else key[0]
        if first != key[0]:
            self.emit(key[0], key[1], f"Traceback: the same as rank {first}'s ({block[-1]})")
            return
        for line in block:
            self.emit(key[0], key[1], line)


STATE_POLL_MAX_S = 4.0   # follow's longest wait between two scheduler queries while nothing changes


def follow(rec: JobRecord, on_state: Callable[[JobState], None], on_line: Callable[[int, str, str], None],
           poll_s: float = 1.0, rank: int | None = None, tracebacks_once: bool = False) -> Outcome:
    """Stream tagged output and state changes until the job ends; return its outcome.
    ``tracebacks_once``: a traceback that another rank showed already is one line
    (:class:`SameTracebackOnce`). The logs are read every ``poll_s``; the scheduler is asked
    less often while the state stays the same (x1.5 each time, at most STATE_POLL_MAX_S)."""
    if rec.array is not None:
        raise UsageError(f"job {rec.job_id} is an array of {len(rec.array)} tasks: follow one task",
                         hint=f"`hpcring logs -f {rec.job_id}_{rec.array[0]}`; `hpcring status {rec.job_id}` "
                              "summarises them all")
    sink = SameTracebackOnce(on_line) if tracebacks_once else None
    on_line = sink or on_line
    # Lines are read before the state: each state line then goes where it happened. A job seen
    # RUNNING ran while it wrote them (its state first); seen in any other state (ended, requeued),
    # it wrote them before it got there (its state after them).
    tail = LogTail(rec, rank)
    last = None
    interval, next_query, st = poll_s, 0.0, None
    while True:
        lines = list(tail.poll())
        if time.monotonic() < next_query and st is not None:
            for item in lines:
                on_line(*item)
            time.sleep(poll_s)
            continue
        st = job_state(rec)
        interval = poll_s if st.state != last else min(interval * 1.5, max(poll_s, STATE_POLL_MAX_S))
        next_query = time.monotonic() + interval
        if st.finished:
            time.sleep(0.3)  # let the last bytes land on shared storage
            for item in lines + list(tail.poll(final=True)):
                on_line(*item)
            if sink is not None:
                sink.flush()
            on_state(st)
            return outcome(rec, st)
        changed, last = st.state != last, st.state
        if changed and st.state == "RUNNING":
            on_state(st)
        for item in lines:
            on_line(*item)
        if changed and st.state != "RUNNING":
            on_state(st)
        time.sleep(poll_s)
