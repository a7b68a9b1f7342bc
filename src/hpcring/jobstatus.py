"""A submitted job's state and outcome: the scheduler's word on one job or many (an array's as one
state), the ranks' records, and what a failure says (`hpcring status`, `submit --wait`, `logs -f`).

Nothing here prints.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from hpcring import schedulers
from hpcring.ranks import rank_ranges
from hpcring.errors import HpcringError, JobFailedError
from hpcring.bootstrap.auth import delete_secret_file
from hpcring.jobdir import hang_headline as diag_hang_headline
from hpcring.outcome import Outcome, rank_failure, read_records, summarize
from hpcring.schedulers.base import JobRecord, JobState, TERMINAL, recent_records
from hpcring.steps_record import final_size


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


# ---- outcome --------------------------------------------------------------------------------

def rank_statuses(rec: JobRecord) -> dict[int, dict]:
    return read_records(rec.folder, rec.job_id, ranks_of(rec))


def ranks_of(rec: JobRecord) -> int:
    """The ranks of the job's last run: fewer than submitted when a restart inside the allocation
    went on with fewer nodes (``--min-nodes``; hpcring.steps)."""
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
    return diag_hang_headline(Path(rec.folder) / "diag", since=run_started(rec))


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
