"""``hpcring report JOB``: where a job's time went, from what its folder already holds.

Sources, all in the job folder (and, for a restarted job, in every attempt's folder):
the status records (``outcome.py``: each rank's start and end, exit code), the ranks' time
summaries (``diag/summary-rank<r>.json``, :mod:`hpcring.diagnostics.rank_summary`: the flight
recorder's totals and its last collectives), the hang report (``diag/hang-report.json``), the
restart chain (``restarts.json``, :mod:`hpcring.restarts`) and the requeue count.

Per rank, its wall time (its process's start to its end) is split into four parts that add up
to it exactly:

* startup: before its first collective (interpreter, imports, rendezvous, data loading);
* waiting: inside a collective before the last rank arrived (and inside one that failed);
* communication: inside a collective after the last rank arrived;
* compute: the rest, between collectives and after the last one.

Waiting needs every rank's arrival at each collective. For the last :data:`rank_summary.TAIL`
collectives of each communicator the summaries hold the times, and the split is exact (on one
clock: ranks on different hosts are as far apart as their clocks). For older ones each rank keeps
only sums; the latest arrival summed over them is at least the largest sum of arrivals of any
rank (exact when the same rank always arrives last, the straggler case) and is taken as that plus
the tail's share of arrivals that no single rank's sum shows (jitter), scaled to their number:
``waiting_method`` says ``estimated`` then. Productive time is compute and communication; an
attempt that ended other than COMPLETED keeps only the part before the last checkpoint its ranks
noted (``hpcring.checkpoint_saved``); the effective ratio is productive over allocated (ranks times
wall time) over all attempts. The JSON's fields are documented in docs/diagnostics.md.
"""
from __future__ import annotations

import json
import re
import textwrap
import time
from pathlib import Path

from hpcring.diagnostics import rank_summary
from hpcring.errors import HpcringError
from hpcring.outcome import read_records
from hpcring.ranks import rank_ranges

SCHEMA = "hpcring-report/1"
PARTS = ("startup", "compute", "communication", "waiting")
_STATUS = re.compile(r"(.+)_(\d+)_status\.json")


class ReportError(HpcringError):
    """Nothing to report, or records that cannot be read (the message names the files)."""


# ---- one attempt: the ranks' split ----------------------------------------------------------------

def _round(v, nd: int = 3):
    return None if v is None else round(float(v), nd)


def _waiting(members: dict[int, dict]) -> tuple[dict[int, float], str | None, str | None]:
    """({rank: waiting s} over the done collectives of one communicator, method, why not split).
    ``members``: {global rank: the communicator's summary entry}."""
    if len(members) < 2:
        return {r: 0.0 for r in members}, "exact", None
    done = {r: c["totals"]["done"] for r, c in members.items()}
    uneven = len(set(done.values())) > 1
    if uneven and any(len(c["tail"]["seq"]) < done[r] for r, c in members.items()):
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(done.items()))
        return {}, None, f"ranks ended different numbers of collectives ({counts}), more than the summaries match"
    t0 = min(c["totals"]["base"] for c in members.values())
    tails = {}
    for r, c in members.items():
        shift = c["totals"]["base"] - t0
        tail = c["tail"]
        tails[r] = {s: (a + shift, e + shift) for s, a, e in zip(tail["seq"], tail["started"], tail["ended"])}
    common = set.intersection(*(set(t) for t in tails.values()))
    wait = {r: 0.0 for r in members}
    sum_w = {r: 0.0 for r in members}          # the tail's arrivals and time inside, per rank
    in_w = {r: 0.0 for r in members}
    latest_w = 0.0
    for s in common:
        last = max(tails[r][s][0] for r in members)
        latest_w += last
        for r in members:
            a, e = tails[r][s]
            wait[r] += min(max(0.0, last - a), max(0.0, e - a))
            sum_w[r] += a
            in_w[r] += e - a
    if uneven:       # a failed run: collectives some ranks completed and others did not are communication
        return wait, "partial", None
    n_old = next(iter(done.values())) - len(common)
    if n_old <= 0:
        return wait, "exact", None
    arrivals = {r: c["totals"]["sum_started"] + done[r] * (c["totals"]["base"] - t0) - sum_w[r]
                for r, c in members.items()}
    jitter = (latest_w - max(sum_w.values())) * n_old / len(common) if common else 0.0
    latest = max(arrivals.values()) + max(0.0, jitter)
    for r, c in members.items():
        inside_old = max(0.0, c["totals"]["sum_inside"] - in_w[r])
        wait[r] += min(max(0.0, latest - arrivals[r]), inside_old)
    return wait, "estimated", None


def _last_done(summary: dict) -> float | None:
    """When this rank's last collective that completed ended (epoch s)."""
    ends = [c["totals"]["base"] + c["tail"]["ended"][-1] for c in summary["comms"] if c["tail"]["ended"]]
    return max(ends, default=None)


def split_attempt(statuses: dict[int, dict], summaries: dict[int, dict], ntasks: int,
                  now: float | None = None, finished: bool = False, run_start: float | None = None) -> dict:
    """The per-rank split of one attempt (``ranks``, ``collectives``, ``started``, ``ended``,
    ``wall_s``, ``time_to_first_step_s``, ``productive_rank_s``, ``last_done``); see the module doc.
    ``finished``: the attempt is over (a rank with no end then ended with the job, not now);
    ``run_start``: when the run started, for ranks of a running job that wrote nothing yet."""
    now = time.time() if now is None else now
    stale = [r for r, sm in summaries.items() if isinstance((statuses.get(r) or {}).get("started"), (int, float))
             and sm["written"] < statuses[r]["started"]]
    summaries = {r: sm for r, sm in summaries.items() if r not in stale}     # an earlier run's (a requeue)
    known_ends = [st["ended"] for st in statuses.values() if isinstance(st.get("ended"), (int, float))]
    known_ends += [sm["written"] for sm in summaries.values()]
    job_end = max(known_ends, default=None)
    by_comm: dict[str, dict[int, dict]] = {}
    for r, sm in summaries.items():
        for c in sm["comms"]:
            by_comm.setdefault(c["name"], {})[r] = c
    waits: dict[int, float] = {}
    methods: dict[int, set] = {}
    collectives = {}
    for name, members in sorted(by_comm.items()):
        w, method, why = _waiting(members)
        collectives[name] = {"ranks": sorted(members), "done": max(c["totals"]["done"] for c in members.values()),
                             "waiting_method": method, "not_split": why}
        for r in members:
            if why is None:
                waits[r] = waits.get(r, 0.0) + w[r]
                methods.setdefault(r, set()).add(method)
            else:
                methods.setdefault(r, set()).add(None)
    ranks = []
    for r in range(ntasks):
        st, sm = statuses.get(r) or {}, summaries.get(r)
        notes = ["its time summary is an earlier run's (requeued): left out"] if r in stale else []
        starts = [t for t in (st.get("started"), sm and sm.get("process_started")) if isinstance(t, (int, float))]
        start = min(starts) if starts else (run_start if not finished else None)
        end = st.get("ended") if isinstance(st.get("ended"), (int, float)) else None
        if end is None and sm is not None:
            end = sm["written"]
            notes.append(f"no end in its status record: numbers as of its summary ({sm['why']})")
        running = end is None and start is not None and not finished
        if running:
            end = now
        elif end is None and start is not None and job_end is not None:
            end = max(start, job_end)
            notes.append("no end recorded (killed?): taken as the job's last")
        entry = {"rank": r, "host": st.get("host") or (sm or {}).get("host"), "started": start, "ended": end,
                 "exit_code": st.get("exit_code"), "summary": sm["why"] if sm else None,
                 "wall_s": None, **{f"{p}_s": None for p in PARTS},
                 "collectives": None, "failed_collectives": None, "first_collective": None,
                 "waiting_method": None, "running": running, "notes": notes}
        if start is not None and end is not None:
            entry["wall_s"] = max(0.0, end - start)
        if sm is None:
            notes.append("no time summary" + (" yet (written at the rank's exit)" if running else
                                               " (killed before its exit? HPCRING_WATCHDOG=0?)"))
        if sm is not None and entry["wall_s"] is not None:
            wall = entry["wall_s"]
            tots = [c["totals"] for c in sm["comms"]]
            n = sum(t["done"] for t in tots)
            # collectives it was inside when its summary was written (a dump's rank is stuck in
            # one): time inside them up to its end is waiting; once it or the job has ended, they
            # failed (before, a live dump's rank may still finish them)
            open_ = [t0 for c in sm["comms"] for t0 in c.get("in_flight") or () if t0 <= end]
            stuck = sum(end - t0 for t0 in open_)
            over = finished or isinstance(st.get("ended"), (int, float))
            nf = sum(t["failed"] for t in tots) + (len(open_) if over else 0)
            entry["collectives"], entry["failed_collectives"] = n, nf
            inside = sum(t["sum_inside"] + t["sum_failed"] for t in tots) + stuck
            firsts = [t["first_started"] for t in tots if t["done"] + t["failed"]] + open_
            if firsts:
                entry["first_collective"] = min(firsts)
                startup = min(wall, max(0.0, min(firsts) - start))
            else:
                startup = 0.0
                notes.append("no collective recorded: all of it counts as compute")
            m = methods.get(r, set())
            if None in m:
                waited = sum(t["sum_failed"] for t in tots) + stuck
                notes.append("waiting not split from communication: " + "; ".join(
                    c["not_split"] for c in collectives.values() if c["not_split"] and r in c["ranks"]))
            else:
                waited = waits.get(r, 0.0) + sum(t["sum_failed"] for t in tots) + stuck
                entry["waiting_method"] = "partial" if "partial" in m else "estimated" if "estimated" in m else "exact"
            inside = min(inside, wall - startup)
            waited = min(waited, inside)
            compute = wall - startup - inside
            entry.update(startup_s=startup, compute_s=compute, communication_s=inside - waited, waiting_s=waited)
        ranks.append(entry)
    starts = [e["started"] for e in ranks if e["started"] is not None]
    ends = [e["ended"] for e in ranks if e["ended"] is not None]
    firsts = [e["first_collective"] for e in ranks if e["first_collective"] is not None]
    out = {"started": min(starts, default=None), "ended": max(ends, default=None), "ranks": ranks,
           "collectives": collectives, "running": any(e["running"] for e in ranks)}
    out["wall_s"] = (out["ended"] - out["started"]) if starts and ends else None
    complete = len(firsts) == ntasks
    out["time_to_first_step_s"] = (max(firsts) - out["started"]) if firsts and complete else None
    split = [e for e in ranks if e["compute_s"] is not None]
    out["productive_rank_s"] = sum(e["compute_s"] + e["communication_s"] for e in split) if split else None
    lasts = [t for sm in summaries.values() if (t := _last_done(sm)) is not None]
    out["last_done"] = min(lasts, default=None)      # the last time every rank had made progress
    cps = [sm["checkpoints"] for sm in summaries.values() if sm.get("checkpoints")]
    out["checkpoints"] = None if not cps else {
        "count": max(c["count"] for c in cps),
        "last_step": max((c["last_step"] for c in cps if isinstance(c.get("last_step"), int)), default=None),
        "last_at": max((c["last_at"] for c in cps if c.get("last_at") is not None), default=None),
        "seconds": max((c["seconds"] for c in cps if c.get("seconds") is not None), default=None)}
    return out


# ---- the job folder ----------------------------------------------------------------------------

def read_attempt(folder: Path, job_id: str, ntasks: int, now: float | None = None,
                 finished: bool = False, run_start: float | None = None) -> tuple[dict, list[str], list[str]]:
    """(split_attempt of the folder, corrupt files (errors), missing records (notes))."""
    corrupt: list[str] = []
    statuses = read_records(folder, job_id, ntasks, corrupt)
    summaries, bad = rank_summary.read_dir(folder / "diag")
    corrupt += bad
    out_of_range = sorted(r for r in summaries if r >= ntasks)
    for r in out_of_range:
        corrupt.append(f"{folder / 'diag' / rank_summary.file_name(r)}: rank {r}, but the job has {ntasks} ranks")
        del summaries[r]
    att = split_attempt(statuses, summaries, ntasks, now, finished, run_start)
    missing = []
    no_status = [r for r in range(ntasks) if r not in statuses]
    no_summary = [r for r in range(ntasks) if r not in summaries]
    if not finished and not statuses and not summaries:
        no_status = no_summary = []
        missing.append("no rank has written its status record or time summary yet: they do at their exit "
                       "(a summary also on SIGRTMIN+7)")
    if no_status:
        missing.append(f"{folder}: no status record of rank{'s' if len(no_status) > 1 else ''} "
                       f"{rank_ranges(no_status)}")
    if no_summary:
        missing.append(f"{folder / 'diag'}: no time summary of rank{'s' if len(no_summary) > 1 else ''} "
                       f"{rank_ranges(no_summary)}")
    att["has_records"] = bool(statuses or summaries)
    att["hang"] = _hang(folder, att)
    return att, corrupt, missing


def _hang(folder: Path, att: dict) -> dict | None:
    """{headline, since, lost_s}: the attempt's hang report, and the time from the start of the
    stuck collective (else the last collective every rank had completed) to the attempt's end."""
    path = folder / "diag" / "hang-report.json"
    try:
        data = json.loads(path.read_text())
        headline = str(data["headline"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return {"headline": f"(a hang report that cannot be read: {path})", "since": None, "lost_s": None}
    op = data.get("op") if isinstance(data.get("op"), dict) else {}
    since = op.get("t_started") if isinstance(op.get("t_started"), (int, float)) else att["last_done"]
    lost = max(0.0, att["ended"] - since) if att["ended"] and since else None
    return {"headline": headline, "since": since, "lost_s": lost}


def folder_job(folder: Path) -> tuple[str, int]:
    """(job id, ranks) of a job folder given by path: from its status records' names and sizes,
    else from its summaries."""
    ids: dict[str, set] = {}
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError as exc:
        raise ReportError(f"job folder {folder} cannot be read: {exc.strerror or exc}",
                          hint="pass a job id (`hpcring status` lists them) or an existing job folder") from None
    for name in names:
        m = _STATUS.fullmatch(name)
        if m:
            ids.setdefault(m.group(1), set()).add(int(m.group(2)))
    summaries, _ = rank_summary.read_dir(folder / "diag")
    sizes = [s["size"] for s in summaries.values()]
    if len(ids) > 1:
        raise ReportError(f"{folder} holds status records of {len(ids)} jobs ({', '.join(sorted(ids))})",
                          hint="pass the job's own folder, `<job_dir>/<job id>`, or its job id")
    if not ids and not summaries:
        raise ReportError(f"{folder} holds no status records and no time summaries: nothing to report",
                          hint="pass the folder of a job (`<job_dir>/<job id>`, printed by `hpcring submit`) "
                               "or its job id")
    job_id = next(iter(ids)) if ids else folder.name
    size = 0
    for path in folder.glob(f"{job_id}_*_status.json"):
        try:
            v = json.loads(path.read_text()).get("size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(v, int) and v > 0:
            size = max(size, v)
    size = max([size, *sizes, *(max(r) + 1 for r in ids.values())])
    return job_id, size


# ---- the report ----------------------------------------------------------------------------------

def build(rec=None, folder: Path | None = None, *, state: str | None = None, finished: bool = False,
          requeues: int = 0, run_start: float | None = None, now: float | None = None) -> dict:
    """The report (a JSON-able dict, schema :data:`SCHEMA`, docs/report.schema.json) of job record
    ``rec`` (a schedulers.base.JobRecord) or of a job ``folder`` given by path. ``state``: the
    scheduler's word for the job (None: not known); ``finished``: whether that state is final;
    ``run_start``: when its latest run started (jobstatus.run_started), for a running job whose
    ranks wrote nothing yet. Raises :class:`ReportError` when there is nothing to report or a
    record is corrupt."""
    from hpcring.restarts import CHAIN_FILE, read_chain  # deferred: pulls pydantic, yaml
    now = time.time() if now is None else now
    if rec is not None:
        folder = Path(rec.folder)
        job_id, ntasks = rec.job_id, rec.ntasks
        job = {"id": rec.job_id, "key": rec.key, "name": rec.name, "scheduler": rec.scheduler, "site": rec.site,
               "folder": str(folder), "ranks": ntasks}
    else:
        job_id, ntasks = folder_job(folder)
        job = {"id": job_id, "key": None, "name": None, "scheduler": None, "site": None, "folder": str(folder),
               "ranks": ntasks}
    if not folder.is_dir():
        raise ReportError(f"job {job_id}'s folder {folder} does not exist" + (" (yet: the job has not started)"
                                                                              if state == "PENDING" else ""),
                          hint="it was moved or deleted; `hpcring status " + job_id + "` shows the job")
    chain = read_chain(folder)
    if not chain and (folder / CHAIN_FILE).exists():
        raise ReportError(f"{folder / CHAIN_FILE}: the restart chain cannot be read (corrupt)",
                          hint=f"move it away to report this attempt alone; `hpcring status {job_id}` shows the job")
    if not chain:
        chain = [{"attempt": 0, "job": job_id, "folder": str(folder), "cause": None}]
    attempts, corrupt, problems = [], [], []
    for i, a in enumerate(chain):
        f = Path(str(a.get("folder") or ""))
        aid = str(a.get("job") or "?")
        last = i == len(chain) - 1
        if not f.is_dir():
            problems.append(f"attempt {a.get('attempt', i)} (job {aid}): its folder {f} is gone")
            att = split_attempt({}, {}, ntasks, now, True)
            att.update(hang=None, has_records=False)
        else:
            att, bad, missing = read_attempt(f, aid, ntasks, now, finished or not last,
                                             run_start if last and state == "RUNNING" else None)
            corrupt += bad
            problems += missing
        cause = a.get("cause")
        att_state = state if (last and aid == job_id) else (cause.split(":", 1)[0] if cause else None)
        att.update(attempt=a.get("attempt", i), job=aid, folder=str(f), state=att_state, cause=cause,
                   excluded=list(a.get("excluded") or []))
        attempts.append(att)
    if corrupt:
        raise ReportError(f"job {job_id}: {len(corrupt)} record(s) cannot be read:\n    " + "\n    ".join(corrupt),
                          hint="a rank killed mid-write leaves no file, never half of one: these were damaged "
                               "after; move them away to report the job without them")
    if not any(a["has_records"] for a in attempts) and not attempts[-1]["running"]:
        raise ReportError(f"job {job_id} left no status records and no time summaries in {folder}"
                          + (": it has not started yet" if state == "PENDING" else ""),
                          hint="ranks write them as they start and end (summaries need hpcring's watchdog, "
                               "HPCRING_WATCHDOG not 0); a job submitted by an older hpcring has none")
    _lost(attempts)
    stragglers = []
    for a in attempts:
        entries, bad = read_stragglers(Path(a["folder"]))
        stragglers += [{**e, "attempt": a["attempt"]} for e in entries]
        problems += bad
    final = attempts[-1]
    if len(attempts) > 1:     # a restart's count is also in requeue_count (preempt.py): not a requeue
        requeues = max(0, requeues - int(final.get("attempt") or 0))
    allocated = sum(a["allocated_rank_s"] or 0.0 for a in attempts)
    kept = [a["kept_rank_s"] for a in attempts if a["kept_rank_s"] is not None]
    walls = [a["wall_s"] for a in attempts if a["wall_s"] is not None]
    firsts = [a["time_to_first_step_s"] for a in attempts if a["time_to_first_step_s"] is not None]
    report = {
        "schema": SCHEMA, "generated": now, "job": job, "state": state, "running": final["running"],
        "requeues": requeues,
        "started": attempts[0]["started"], "ended": final["ended"],
        "wall_s": (final["ended"] - attempts[0]["started"]) if final["ended"] and attempts[0]["started"] else None,
        "rank_hours": sum(walls) * ntasks / 3600 if walls else None,
        "time_to_first_step_s": firsts[-1] if firsts else None,
        "ranks": final["ranks"],
        "split_rank_s": _sum_split(final["ranks"]),
        "attempts": attempts,
        "lost": {"hangs_s": sum((a["hang"]["lost_s"] or 0.0 for a in attempts if a["hang"]), 0.0),
                 "restarts_s": (sum(a["lost_s"] or 0.0 for a in attempts[:-1])
                                + sum(a["gap_s"] or 0.0 for a in attempts)),
                 "unfinished_s": final["lost_s"] or 0.0},
        "checkpoints": final["checkpoints"],
        "productive_rank_s": sum(kept) if kept else None,
        "allocated_rank_s": allocated or None,
        "effective_ratio": (sum(kept) / allocated) if kept and allocated else None,
        "stragglers": stragglers,
        "problems": problems,
    }
    return _rounded(report)


def read_stragglers(folder: Path) -> tuple[list[dict], list[str]]:
    """The straggler verdicts recorded in ``<folder>/diag/stragglers.jsonl`` (rank 0's, job-wide)
    and ``stragglers-<group>.jsonl`` (each group's rank 0's;
    :mod:`hpcring.diagnostics.straggler_watch`), oldest first: ``at``, ``line`` and ``verdict``
    (None when the straggler cleared); and a problem for each line that cannot be read."""
    entries, problems = [], []
    for path in sorted((folder / "diag").glob("stragglers*.jsonl")):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue
        except OSError as e:
            problems.append(f"{path}: cannot be read ({e.strerror})")
            continue
        for n, line in enumerate(text.splitlines(), 1):
            try:
                e = json.loads(line)
                entries.append({"at": float(e["at"]), "line": str(e["line"]), "verdict": e.get("verdict")})
            except (ValueError, KeyError, TypeError):
                problems.append(f"{path}:{n}: not a straggler record (left out)")
    entries.sort(key=lambda e: e["at"])
    return entries, problems


def _sum_split(ranks: list[dict]) -> dict | None:
    split = [e for e in ranks if e["compute_s"] is not None]
    if not split:
        return None
    return {p: sum(e[f"{p}_s"] for e in split) for p in PARTS}


def _lost(attempts: list[dict]) -> None:
    """Each attempt's allocated, kept (productive and not lost) and lost time, and the gap before
    it (resubmission, queue): an attempt that did not complete keeps the work before its last
    checkpoint noted, a running or completed one all of it."""
    prev_end = None
    for a in attempts:
        n = len(a["ranks"])
        a["allocated_rank_s"] = a["wall_s"] * n if a["wall_s"] is not None else None
        a["gap_s"] = max(0.0, a["started"] - prev_end) if a["started"] and prev_end else None
        prev_end = a["ended"] or prev_end
        ok = a["running"] or a["state"] in (None, "COMPLETED", "RUNNING")
        cp = a["checkpoints"]
        if a["wall_s"] is None or a["productive_rank_s"] is None:
            a["kept_rank_s"], a["lost_s"] = None, a["wall_s"]
            continue
        if ok:
            a["kept_rank_s"], a["lost_s"] = a["productive_rank_s"], 0.0
            continue
        upto = cp["last_at"] if cp and cp.get("last_at") and a["started"] <= cp["last_at"] <= a["ended"] else None
        frac = (upto - a["started"]) / a["wall_s"] if upto is not None and a["wall_s"] > 0 else 0.0
        a["kept_rank_s"] = a["productive_rank_s"] * frac
        a["lost_s"] = a["wall_s"] * (1.0 - frac)


def _rounded(v):
    if isinstance(v, float):          # to the microsecond (epoch times and durations alike)
        return round(v, 6)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


# ---- text ------------------------------------------------------------------------------------------

def fmt_s(s: float | None) -> str:
    """``0.42 s``, ``12.4 s``, ``3 min 05 s``, ``2 h 03 min``; ``-`` for none."""
    if s is None:
        return "-"
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def _clock(t: float | None) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


BAR = {"startup": "-", "compute": "#", "communication": "=", "waiting": "."}


def bar(entry: dict, width: int = 30) -> str:
    """The rank's split as ``width`` characters (BAR's letters), largest remainders rounded."""
    wall = entry["wall_s"] or 0.0
    if entry["compute_s"] is None or wall <= 0:
        return " " * width
    shares = [(p, entry[f"{p}_s"] / wall * width) for p in PARTS]
    cells = {p: int(x) for p, x in shares}
    for p, x in sorted(shares, key=lambda t: t[1] - int(t[1]), reverse=True)[:width - sum(cells.values())]:
        cells[p] += 1
    return "".join(BAR[p] * cells[p] for p in PARTS)


def _pct(part: float | None, whole: float | None) -> str:
    return "" if part is None or not whole else f"{100 * part / whole:3.0f}%"


def text(report: dict) -> str:
    """The one-page text report."""
    j = report["job"]
    final = report["attempts"][-1]
    name = f" ({j['name']})" if j.get("name") else ""
    where = f", {j['scheduler']}" if j.get("scheduler") else ""
    state = report["state"] or ("running" if report["running"] else "state unknown")
    lines = [f"hpcring report: job {j['id']}{name}{where}, {j['ranks']} ranks, {state}"]
    if report["running"]:
        lines.append("  (running: numbers so far; a rank writes its time summary at exit, or now on "
                     "SIGRTMIN+7: `kill -s RTMIN+7 PID`, `scancel --signal=41 JOB`)")
    lines.append(f"  wall time     : {fmt_s(report['wall_s'])} ({_clock(report['started'])} to "
                 f"{_clock(report['ended'])}), {report['rank_hours'] or 0:.4g} rank-hours")
    lines.append(f"  first step    : {fmt_s(report['time_to_first_step_s'])} after the start (every rank in its "
                 "first collective)")
    colls = final["collectives"]
    if colls:
        parts = []
        for n, c in colls.items():
            how = c["waiting_method"] or "waiting not split"
            parts.append(f"{c['done']} on {n} ({how})")
        lines.append(f"  collectives   : {', '.join(parts)} per rank")
    else:
        lines.append("  collectives   : none recorded")
    if report["effective_ratio"] is not None:
        kept = " kept" if len(report["attempts"]) > 1 or report["lost"]["unfinished_s"] else ""
        lines.append(f"  effective     : {100 * report['effective_ratio']:.0f}% of the allocated rank time was "
                     f"productive (compute + communication{kept}: "
                     f"{fmt_s(report['productive_rank_s'])} of {fmt_s(report['allocated_rank_s'])})")
    lost = report["lost"]
    hangs = [a for a in report["attempts"] if a["hang"]]
    restarted = len(report["attempts"]) > 1
    if not hangs and not restarted and not lost["unfinished_s"]:
        lines.append("  hangs/restarts: none")
    else:
        said = [f"{fmt_s(lost['hangs_s'])} in hangs (the stuck collective's start to the end)"] if hangs else []
        if restarted:
            said.append(f"{fmt_s(lost['restarts_s'])} to restarts (the attempts' time after their last checkpoint, "
                        "the gaps between them)")
        if lost["unfinished_s"]:
            said.append(f"{fmt_s(lost['unfinished_s'])} of the unfinished run after its last checkpoint")
        lines.append("  lost          : " + "; ".join(said))
    cp = report["checkpoints"]
    if cp:
        extra = f" after step {cp['last_step']}" if cp.get("last_step") is not None else ""
        spent = f", {fmt_s(cp['seconds'])} saving" if cp.get("seconds") is not None else ""
        lines.append(f"  checkpoints   : {cp['count']} noted, the last{extra} at {_clock(cp['last_at'])}{spent}")
    else:
        lines.append("  checkpoints   : none noted (hpcring.checkpoint_saved)")
    named = report.get("stragglers") or []
    if not named:
        lines.append("  stragglers    : none named")
    for i, e in enumerate(named):
        head = "  stragglers    : " if i == 0 else " " * 18
        lines += textwrap.wrap(f"{_clock(e['at'])} {e['line']}", 118, initial_indent=head,
                               subsequent_indent=" " * 20)
    if report["requeues"]:
        lines.append(f"  requeued      : {report['requeues']} time(s): the numbers are the latest run's")
    if len(report["attempts"]) > 1:
        lines.append("")
        for a in report["attempts"]:
            gap = f", {fmt_s(a['gap_s'])} after the previous" if a["gap_s"] is not None else ""
            hang = f"; hang: {fmt_s(a['hang']['lost_s'])} lost ({a['hang']['headline']})" if a["hang"] else ""
            lines.append(f"  attempt {a['attempt']}  job {a['job']}  {a['state'] or '?'}  wall {fmt_s(a['wall_s'])}"
                         f"{gap}, lost {fmt_s(a['lost_s'])}{hang}")
    elif hangs:
        h = hangs[0]["hang"]
        lines.append(f"  hang          : {h['headline']}")
    lines.append("")
    hosts = [str(e["host"] or "?") for e in final["ranks"]]
    hw = max([4, *map(len, hosts)])
    lines.append(f"  {'rank':>4}  {'host':<{hw}}  {'wall':>7}  " + "  ".join(f"{p:>13}" for p in PARTS))
    for e, h in zip(final["ranks"], hosts):
        cols = [f"{fmt_s(e[f'{p}_s']):>8} {_pct(e[f'{p}_s'], e['wall_s']):>4}" for p in PARTS]
        lines.append(f"  {e['rank']:>4}  {h:<{hw}}  {fmt_s(e['wall_s']):>7}  " + "  ".join(cols) + f"  |{bar(e)}|")
    lines.append(f"  {'':>4}  {'':<{hw}}  {'':>7}  " + ", ".join(f"{BAR[p]} {p}" for p in PARTS))
    notes = [f"rank {e['rank']}: {n}" for e in final["ranks"] for n in e["notes"]]
    if notes or report["problems"]:
        lines.append("")
        lines += [f"  note: {n}" for n in report["problems"] + notes]
    return "\n".join(lines) + "\n"
