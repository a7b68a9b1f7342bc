"""Restarts that avoid a bad node (``hpcring submit --wait --max-restarts N``).

When a followed job ends, :func:`classify` reads what the job already left behind (the scheduler's
state, every rank's status record, the watchdog's ``diag/hang-report.json``) and decides whether
the cause was a node (restart it elsewhere) or the code (restarting would fail the same way):

* node-level: the hang report names ranks ``dead`` (gone without a record of their own: killed,
  node lost) or ``unreachable`` (frozen, host down, link cut), or a ``stalled`` link; or the
  scheduler says ``NODE_FAIL``. The nodes to exclude are those ranks' hosts (a stalled link: the
  host at the most stalled links, ties the sending side).
* not restarted: COMPLETED; any rank that recorded an error of its own (an exception, a non-zero
  exit: the code); a hang the report pins on the code (missing, mismatch, another collective,
  exited early); TIMEOUT/PREEMPTED/CANCELLED/OUT_OF_MEMORY (the scheduler's or the user's doing:
  preemption has its own requeue, docs/preemption.md); a report that blames every node of the
  job (that is no single bad node); a failure no diagnosis names.

The restarted job is the same submission with the nodes of every earlier attempt excluded
(``JobSpec.exclude``: Slurm ``--exclude``, LSF ``select[hname!=...]``, rendered by the scheduler's
template) and ``HPCRING_RESTART_COUNT`` set, which ``hpcring.requeue_count()`` counts, so a script
that resumes after a requeue resumes after a restart too. The chain (attempt, job, nodes excluded,
cause) is written to ``restarts.json`` in every attempt's folder; ``hpcring status`` prints it.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from hpcring.config.jobspec import max_restarts  # the precedence's owner
from hpcring.config.text import shown
from hpcring.errors import HpcringError, UsageError
from hpcring.fsutil import write_json
from hpcring.ranks import rank_ranges
from hpcring.steps_record import read_steps, step_lines
from hpcring import jobstatus

CHAIN_FILE = "restarts.json"
NODE_CATEGORIES = ("dead", "unreachable")
# ended by the scheduler or the user, not by a fault of the job's nodes
NOT_A_FAULT = ("COMPLETED", "TIMEOUT", "PREEMPTED", "DEADLINE", "CANCELLED", "OUT_OF_MEMORY")
# host names as schedulers write them; anything else never reaches a job script
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", re.ASCII)


@dataclass(frozen=True)
class Verdict:
    restart: bool              # a node-level fault: worth a restart elsewhere
    cause: str                 # one line: why the job ended
    nodes: tuple[str, ...] = ()   # the nodes to exclude (may be empty: NODE_FAIL with no host named)


def _own_errors(statuses: Mapping[int, dict], headline: str | None, since: float | None = None) -> list[dict]:
    """Failing ranks whose record holds their own error, not the watchdog's headline (a rank the
    report took down writes the headline as its error) nor what the teardown after the diagnosis
    did to it (``since``: when the failure was seen; LSF's bkill, for one, interrupts every rank
    with SIGINT, and their records then say KeyboardInterrupt)."""
    out = []
    for s in sorted(statuses.values(), key=lambda s: s.get("ended") or 0):
        if not s.get("exit_code"):
            continue
        if since is not None and isinstance(s.get("ended"), (int, float)) and s["ended"] > since:
            continue
        err = s.get("error") or ""
        if headline and err.strip() == headline.strip():
            continue
        if "COLLECTIVE FAILURE" in err:
            continue
        out.append(s)
    return out


def _link_node(links: list[dict]) -> str | None:
    """The host to blame for stalled links: the one at the most of them, ties the sender's."""
    count: dict[str, int] = {}
    for ln in links:
        for h in (ln.get("from_host"), ln.get("to_host")):
            if h:
                count[h] = count.get(h, 0) + 1
    if not count:
        return None
    top = max(count.values())
    senders = [ln.get("from_host") for ln in links if count.get(ln.get("from_host")) == top]
    return senders[0] if senders else max(count, key=count.get)


def classify(state: str, statuses: Mapping[int, dict], size: int, report: dict | None) -> Verdict:
    """Whether a job that ended in ``state`` (normalized) with these rank records and hang report
    (``hang-report.json`` as a dict, or None) failed for a node-level cause; see the module doc."""
    if state == "COMPLETED" and len(statuses) == size and not any(s.get("exit_code") for s in statuses.values()):
        return Verdict(False, "completed")
    if state in NOT_A_FAULT:
        return Verdict(False, f"the job ended {state}, which is no node fault")
    headline = (report or {}).get("headline")
    seen = ((report or {}).get("trigger") or {}).get("time")
    own = _own_errors(statuses, headline, seen if isinstance(seen, (int, float)) else None)
    if own:
        s = own[0]
        what = s.get("error") or f"exited with code {s.get('exit_code')}"
        first = str(what).strip().splitlines()[-1] if str(what).strip() else what
        return Verdict(False, f"code error: rank {s.get('rank')} on {s.get('host', '?')}: {first}")
    if report:
        cats = report.get("categories") or {}
        hosts = list(report.get("hosts") or [])
        ranks = sorted({r for c in NODE_CATEGORIES for r in cats.get(c) or []})
        nodes = [hosts[r] for r in ranks if 0 <= r < len(hosts)]
        if not nodes and report.get("links"):
            one = _link_node(report["links"])
            nodes = [one] if one else []
        nodes = list(dict.fromkeys(nodes))
        if not nodes:
            return Verdict(False, f"code-level hang: {headline}")
        if hosts and set(nodes) >= set(hosts):
            return Verdict(False, f"{headline}: every node of the job is blamed, which is no single bad node")
        return Verdict(True, headline or "a node-level fault", tuple(nodes))
    if state == "NODE_FAIL":
        return Verdict(True, "the scheduler marked a node of the job failed (NODE_FAIL)")
    return Verdict(False, f"the job ended {state} with no diagnosis naming a node")


def classify_step(statuses: Mapping[int, dict], size: int, report: dict | None,
                  killed: list[tuple[str, str, str]], gone: Mapping[str, str], hosts) -> Verdict:
    """:func:`classify` for one step inside the allocation (hpcring.steps). A step has no
    scheduler state of its own: nodes the scheduler now holds down stand for NODE_FAIL, and where
    no report and no rank's own error says more, the launcher's word decides: a node whose tasks
    were ``Killed`` first (every process there SIGKILLed, the node lost) while others ran on is
    a node fault; any other signal (a segfault, an abort) is the code's."""
    v = classify("NODE_FAIL" if gone else "FAILED", statuses, size, report)
    down = [h for h in gone if h in hosts]
    if v.restart:
        return Verdict(True, v.cause, tuple(dict.fromkeys([*v.nodes, *down])))
    if v.cause.startswith("code error") or report:
        return v
    if down:
        return Verdict(True, "the scheduler holds " + ", ".join(f"{h} {gone[h]}" for h in down), tuple(down))
    if killed:
        node, tasks, how = killed[0]
        if how == "Launch failed" and node in hosts:
            return Verdict(True, f"srun could not start the tasks on {node}", (node,))
        if how == "Killed" and node in hosts and set(hosts) != {node}:
            return Verdict(True, f"task{'s' if not tasks.isdigit() else ''} {tasks} on {node} killed (srun: {how}) "
                                 "with no record of their own", (node,))
    return v


def node_reasons(report: dict | None, nodes, state: str) -> dict[str, str]:
    """Why :func:`classify` blamed each of ``nodes``, in the report's words: ``unreachable (rank 2)``,
    ``dead (ranks 2-3)``, ``stalled link (rank 1 -> rank 2)``, with ``NODE_FAIL`` when the
    scheduler said so too (hpcring.nodehistory records it)."""
    cats = (report or {}).get("categories") or {}
    hosts = list((report or {}).get("hosts") or [])
    links = list((report or {}).get("links") or [])
    out = {}
    for n in nodes:
        parts = []
        for c in NODE_CATEGORIES:
            ranks = [r for r in cats.get(c) or [] if isinstance(r, int) and 0 <= r < len(hosts) and hosts[r] == n]
            if ranks:
                parts.append(f"{c} (rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)})")
        mine = [ln for ln in links if n in (ln.get("from_host"), ln.get("to_host"))]
        if not parts and mine:
            more = f" and {len(mine) - 1} more" if len(mine) > 1 else ""
            parts.append(f"stalled link (rank {mine[0].get('from')} -> rank {mine[0].get('to')}){more}")
        if state == "NODE_FAIL":
            parts.append("NODE_FAIL")
        out[n] = ", ".join(parts) or "blamed by the hang report"
    return out


def is_host_name(h) -> bool:
    """A host name as schedulers write them (nothing else reaches a job script)."""
    return isinstance(h, str) and _HOST.fullmatch(h) is not None


def check_hosts(nodes, where: str) -> list[str]:
    """Host names fit to write into a job script (``--exclude``, ``select[hname!=...]``)."""
    out = []
    for h in nodes:
        if not is_host_name(h):
            raise UsageError(f"{where}: {shown(h)} is not a host name a scheduler accepts",
                             hint="host names are letters, digits, '.', '_' and '-'")
        out.append(h)
    return out


# ---- the chain --------------------------------------------------------------------------------

def read_chain(folder: str | Path) -> list[dict]:
    """The chain recorded in a job folder (empty when the job was never part of one)."""
    try:
        data = json.loads((Path(folder) / CHAIN_FILE).read_text())
        return list(data["attempts"]) if isinstance(data, dict) else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_chain(chain: list[dict]) -> None:
    """The whole chain into every attempt's folder: ``status`` of any attempt shows all of it."""
    for a in chain:
        try:
            write_json(Path(a["folder"]) / CHAIN_FILE, {"attempts": chain}, indent=1)
        except OSError:
            pass                   # a folder gone (cleaned up): the others still say it


def chain_lines(chain: list[dict]) -> list[str]:
    """``attempt 0  job 101  FAILED: <cause>  -> restarted`` lines for ``hpcring status``."""
    out = []
    for a in chain:
        excl = f"  excluding {','.join(a['excluded'])}" if a.get("excluded") else ""
        end = f"  ended: {a['cause']}" if a.get("cause") else ""
        then = f"  -> {a['decision']}" if a.get("decision") else ""
        out.append(f"attempt {a['attempt']}  job {a['job']}{excl}{end}{then}")
    return out


# ---- the policy --------------------------------------------------------------------------------

def restarts_to_make(cli: int | None, site, job, wait: bool) -> tuple[int, list[str]]:
    """``submit --max-restarts``: (how many resubmissions after a node-level fault ``--wait`` may
    make, the warnings to print). The count's precedence is :func:`max_restarts`'s; one from the
    environment or the site on a job nobody follows (no ``--wait``, or an array) is dropped with a
    warning, one given on the command line is refused (UsageError) before anything is submitted."""
    restarts, restarts_from = max_restarts(cli, site)
    notes = []
    if job.step_restarts:              # restarts inside the allocation (hpcring.steps); --wait resubmits
        restarts = restarts if wait else 0     # only once the allocation itself is gone
    elif restarts and (not wait or job.array is not None) and restarts_from != "cli":
        notes.append(f"warning: max_restarts {restarts} ({restarts_from}) applies to `submit --wait` on a single "
                     "job only: this job is not restarted")
        restarts = 0
    if restarts and (not wait or job.array is not None) and not job.step_restarts:   # refused before submitting
        raise UsageError(f"--max-restarts {restarts} ({restarts_from}) needs --wait on a single job: the "
                         "follower sees the end and the diagnosis and resubmits",
                         hint="add --wait (keep it running, e.g. under tmux on the login node), or "
                              "--max-restarts 0" + (" (arrays are not restarted)" if job.array is not None else ""))
    return restarts, notes


# ---- the follow loop --------------------------------------------------------------------------

def follow_restarting(site, job, rec, limit: int, *, submit: Callable, follow: Callable,
                      info: Callable[[str], None], template: str | None = None):
    """Follow ``rec`` (``follow(rec) -> Outcome``); while it ends with a node-level fault and
    fewer than ``limit`` restarts were made, resubmit it (``submit(site, job, template) ->
    JobRecord``) with the blamed nodes excluded and follow that. Returns (last record, its outcome)."""
    chain = [{"attempt": 0, "job": rec.job_id, "key": rec.key, "folder": rec.folder, "excluded": list(job.exclude)}]
    write_chain(chain) if limit else None
    attempt, made = 0, 0
    while True:
        oc = follow(rec)
        if oc.ok or not limit:
            if limit:
                chain[-1].update(cause="COMPLETED" if oc.ok else None)
                write_chain(chain)
            return rec, oc
        v = verdict(rec, oc)
        chain[-1]["cause"] = f"{oc.state.state}: {v.cause}"
        if not v.restart:
            chain[-1]["decision"] = "not restarted (no node-level fault)"
            write_chain(chain)
            info(f"job {rec.job_id}: not restarted: {v.cause}")
            return rec, oc
        inside = _inside(rec)          # restarts the job's step loop made inside its allocation
        made += len(inside["restarts"])
        if inside["blamed"]:
            v = Verdict(v.restart, v.cause, tuple(dict.fromkeys([*inside["blamed"], *v.nodes])))
        if attempt + made >= limit:
            chain[-1]["decision"] = f"not restarted: --max-restarts {limit} used up"
            write_chain(chain)
            info(f"job {rec.job_id}: node-level fault ({v.cause}), but {limit} restart(s) were already made "
                 f"(--max-restarts {limit})")
            return rec, oc
        attempt += 1
        job = _next_job(site, job, v, attempt, limit, made)
        if site.config.scheduler == "local":
            note = "the local backend has one machine, no node to exclude: restarting as is"
        else:
            note = "excluding " + ",".join(job.exclude) if job.exclude else "no node named to exclude"
        info(f"job {rec.job_id}: node-level fault: {v.cause}; restart {attempt} of at most {limit} ({note})")
        try:
            nxt = submit(site, job, template)
        except HpcringError as exc:    # e.g. too few nodes left once the bad ones are excluded
            chain[-1]["decision"] = f"restart {attempt} refused: {exc.message}"
            write_chain(chain)
            raise
        chain[-1]["decision"] = f"restarted as attempt {attempt}"
        rec = nxt
        chain.append({"attempt": attempt, "job": rec.job_id, "key": rec.key, "folder": rec.folder,
                      "excluded": list(job.exclude), "restart_of": chain[-1]["job"]})
        write_chain(chain)
        info(f"Submitted job {rec.job_id} [{rec.key}] (attempt {attempt}); logs in {rec.folder}")


def _inside(rec) -> dict:
    """What the job's step loop did inside its allocation (hpcring.steps): its restarts and every
    node it blamed (a resubmission leaves them out too)."""
    steps = (read_steps(rec.folder) or {}).get("steps") or []
    blamed = [n for s in steps if isinstance(s, dict) for n in (s.get("blamed") or {}) if is_host_name(n)]
    return {"restarts": [s for s in steps[1:] if isinstance(s, dict)], "blamed": list(dict.fromkeys(blamed))}


def verdict(rec, oc) -> Verdict:
    """:func:`classify` of a finished job, from its folder and ``oc`` (outcome.Outcome)."""
    return blamed(rec, oc)[0]


def blamed(rec, oc) -> tuple[Verdict, dict | None]:
    """(:func:`verdict`, the hang report it read: None when there is none)."""
    report = _report(rec)
    return classify(oc.state.state, jobstatus.rank_statuses(rec), rec.ntasks, report), report


def status_lines(rec, oc) -> list[str]:
    """What ``hpcring status`` says about restarts: the chain, or for a failed job that was not
    part of one, whether a restart would have avoided a node (and which)."""
    chain = read_chain(rec.folder)
    inside = step_lines(read_steps(rec.folder))
    if chain or inside or oc is None or oc.ok:
        return inside + chain_lines(chain)
    v = verdict(rec, oc)
    if not v.restart:
        return []
    where = f" avoiding {','.join(v.nodes)}" if v.nodes else ""
    return [f"node-level fault ({v.cause}): not restarted (not followed with --max-restarts 1 or more); "
            f"`hpcring submit ... --wait --max-restarts N` resubmits such a job{where} by itself"]


def _report(rec) -> dict | None:
    """The latest run's hang report (jobstatus.hang_headline's freshness rule), as a dict."""
    hang = jobstatus.hang_headline(rec)
    if hang is None:
        return None
    try:
        return json.loads((Path(rec.folder) / "diag" / "hang-report.json").read_text())
    except (OSError, ValueError):
        return None


def _next_job(site, job, v: Verdict, attempt: int, limit: int = 0, made: int = 0):
    """The same submission, the blamed nodes added to the excluded ones (not on the local
    backend: one machine), a fresh secret (the last one went with the ended job), and the
    restart count the ranks read."""
    nxt = copy.deepcopy(job)
    if site.config.scheduler != "local":
        nxt.exclude = list(dict.fromkeys([*job.exclude, *check_hosts(v.nodes, "restart: blamed node")]))
    nxt.env = {k: val for k, val in job.env.items() if k != "HPCRING_SECRET_FILE"}
    nxt.env["HPCRING_RESTART_COUNT"] = str(attempt + made)
    if nxt.step_restarts:              # the new allocation's step loop gets what is left
        nxt.step_restarts = max(0, limit - attempt - made)
    return nxt
