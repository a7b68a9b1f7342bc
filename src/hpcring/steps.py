"""Restarts inside the allocation: the job script's step loop (``submit --spare-nodes K`` /
``--min-nodes M`` with ``--max-restarts R``; README "When a node fails", docs/faults.md).

The job holds N + K nodes and runs its ranks on N of them, one scheduler step at a time::

    step 0 on the first N nodes
    while the step failed and a restart is left:
        verdict = restarts.classify_step(what the step left: rank records, the hang report,
                                         the launcher's casualty lines, nodes the scheduler holds down)
        code error, a hang pinned on the code, a signal to the job (time limit, cancel): stop
        blame the verdict's nodes (node history), archive the step's records under steps/<k>/
        next nodes = the healthy ones in allocation order (survivors first, then spares), N of them,
        or as few as M when --min-nodes allows (the world size shrinks: the ranks read it)
        step k+1 on them with HPCRING_RESTART_COUNT raised, so the script resumes from its checkpoint

Every step's start, end, cause, blamed nodes and the spares it took go to ``<folder>/steps.json``
(``hpcring status`` prints them). The scheduler's part (where the nodes are, how one step is
started on chosen nodes, what the launcher said, how a failed step is ended) is
``schedulers/<name>_steps.py``: slurm_steps (srun steps) or lsf_steps (one blaunch -z a step).

Run as ``python -m hpcring.steps --nodes N --tasks-per-node T --max-restarts R [--min-nodes M]
--folder F -- LAUNCHER...``; rendered by ``schedulers/render.launch_command``. Standard library
plus hpcring's own light modules: it starts before every step.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from hpcring.steps_record import STEPS_FILE
from hpcring import nodehistory
from hpcring.config import envvars
from hpcring.errors import HpcringError
from hpcring.fsutil import write_json
from hpcring.outcome import read_records
from hpcring import preflight
from hpcring.schedulers import lsf_steps, slurm_steps

SCHEDULERS = {"slurm": slurm_steps, "lsf": lsf_steps}   # the scheduler's side of the loop, by name

ARCHIVE = "steps"            # <folder>/steps/<k>/: a failed step's records and diagnosis
READER_JOIN_S = 5.0          # the launcher's stderr reader, after the launcher ended
LAUNCHER_EXIT_S = 0.5        # the launcher, after its step was SIGKILLed
REPORT_POLL_S = 0.2          # the step's hang report, looked for while it runs (one stat)
PREFLIGHT_DEADLINE_S = 30.0  # each node's part of the gang check
PREFLIGHT_LAUNCH_S = 20.0    # the launcher's own start and end around it


def log(msg: str) -> None:
    print(f"hpcring steps: [{time.strftime('%H:%M:%S')}.{int(time.time() % 1 * 1000):03d}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Plan:
    nodes: int                 # N: the step's nodes when enough are healthy
    min_nodes: int             # M <= N: go on with as few as this
    tasks_per_node: int
    max_restarts: int
    folder: Path
    launch: list[str]
    scheduler: str = "slurm"
    steps: list[dict] = field(default_factory=list)
    preflight: bool = False
    gpus: int = 0
    min_gbps: float = 0.0
    checked: dict | None = None        # the preflight's outcome, for steps.json
    cluster: str = ""                  # the job record's cluster where the environment has none (LSF: the site)


def folder_of(pattern: str, environ: Mapping[str, str]) -> Path:
    """The job folder: the rendered pattern with Slurm's ``%j`` (or an array task's ``%A_%a``)."""
    jid = environ.get("SLURM_JOB_ID") or environ.get("LSB_JOBID") or ""
    out = pattern.replace("%A", environ.get("SLURM_ARRAY_JOB_ID", jid)).replace("%a", environ.get("SLURM_ARRAY_TASK_ID", ""))
    return Path(out.replace("%j", jid).replace("%J", jid))


def choose(allocation: Sequence[str], blamed: set[str], gone: Mapping[str, str], current: Sequence[str],
           nodes: int, min_nodes: int) -> list[str] | None:
    """The next step's nodes: the current step's healthy ones first (their local state, page cache
    and containers are warm), then healthy spares in allocation order; ``nodes`` of them, or as
    many as there are down to ``min_nodes``; None when fewer than ``min_nodes`` are healthy."""
    healthy = [h for h in allocation if h not in blamed and h not in gone]
    keep = [h for h in current if h in healthy]
    pick = (keep + [h for h in healthy if h not in keep])[:nodes]
    return pick if len(pick) >= min_nodes else None


def write_steps(plan: Plan, allocation: Sequence[str], final: dict | None = None) -> None:
    data = {"nodes": plan.nodes, "min_nodes": plan.min_nodes, "tasks_per_node": plan.tasks_per_node,
            "max_restarts": plan.max_restarts, "allocation": list(allocation), "steps": plan.steps}
    if plan.checked is not None:
        data["preflight"] = plan.checked
    if final:
        data.update(final)
    try:
        write_json(plan.folder / STEPS_FILE, data, indent=1)
    except OSError as exc:
        log(f"could not write {plan.folder / STEPS_FILE}: {exc}")


class _Launcher:
    """One step: the launcher with its stderr copied through (it goes to the job's error log as
    before) and kept to read its casualty lines; a TERM/INT to the loop goes to the step, and
    means no restart."""

    def __init__(self, sched, job: str, grace: float) -> None:
        self.sched, self.job, self.grace = sched, job, grace
        self.stopping: int | None = None
        self.proc: subprocess.Popen | None = None
        self.hosts: list[str] = []     # the running step's hosts and number (LSF ends a step by them)
        self.step = 0
        self.first_error: float | None = None
        self.lock = threading.Lock()   # no step starts while the last one is being killed
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._signal)

    def _signal(self, signum, _frame) -> None:
        self.stopping = signum
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                p.send_signal(signum)
            except OSError:
                pass

    def run(self, argv: list[str], env: Mapping[str, str], report: Path | None = None) -> tuple[int, str]:
        """Run one step; ``report``: the hang report a diagnosed failure writes, watched too (a
        frozen node's stepd can hold the survivors' exit, and with it srun's word, for the
        scheduler's UnkillableStepTimeout)."""
        lines: list[str] = []
        self.first_error = None
        started = time.time()
        failed = threading.Lock()

        def failure_seen() -> None:
            with failed:
                if self.first_error is None:
                    self.first_error = time.time()
                    threading.Timer(self.grace, self._end_step, args=(proc,)).start()

        def copy(stream) -> None:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", "replace")
                lines.append(text)
                sys.stderr.write(text)
                sys.stderr.flush()
                if self.sched.FAILED_TASK.search(text):
                    failure_seen()

        def watch() -> None:
            while proc.poll() is None and self.first_error is None:
                try:
                    if report.stat().st_mtime >= started:
                        failure_seen()
                        return
                except OSError:
                    pass
                time.sleep(REPORT_POLL_S)
        with self.lock:
            self.proc = proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
        reader = threading.Thread(target=copy, args=(proc.stderr,), daemon=True)
        reader.start()
        if report is not None:
            threading.Thread(target=watch, daemon=True).start()
        rc = self.proc.wait()          # bounded by the job's time limit: the scheduler ends the job
        reader.join(READER_JOIN_S)
        return rc, "".join(lines)

    def _end_step(self, p: subprocess.Popen) -> None:
        """A task failed and the step is lost (``--kill-on-bad-exit``): after ``grace`` seconds (the
        survivors' watchdog writes its report then), SIGKILL the rest and stop waiting for the
        launcher. Its own teardown sends SIGTERM, which submitit's task entry bypasses, and waits
        the scheduler's KillWait (Slurm: 30 s by default) before SIGKILL: seconds lost on every
        restart. The next step starts beside the dying one (``--overlap``); its rendezvous is its own
        (the store port folds the step id in: bootstrap/init.py)."""
        with self.lock:
            if p is not self.proc or p.poll() is not None:
                return                 # that step ended (the next one may run now: not ours to kill)
            steps = self.sched.kill_step(self.job, self.hosts, self.step)
        try:
            p.wait(LAUNCHER_EXIT_S)
        except subprocess.TimeoutExpired:
            log(f"a task failed {self.grace:g} s ago: its step {', '.join(steps) or '?'} is SIGKILLed, and the "
                "launcher, still waiting out the scheduler's teardown, too")
            p.kill()


def _archive(plan: Plan, jid: str, attempt: int) -> str:
    """Move the failed step's records, results and diagnosis to ``steps/<attempt>/``: the next
    step starts with a clean folder and nothing of this one is lost."""
    dest = plan.folder / ARCHIVE / str(attempt)
    dest.mkdir(parents=True, exist_ok=True)
    moved = []
    for pattern in (f"{jid}_*_status.json", f"{jid}_*_result.pkl"):
        for p in plan.folder.glob(pattern):
            moved.append(p)
    if (plan.folder / "diag").is_dir():
        moved.append(plan.folder / "diag")
    for p in moved:
        try:
            shutil.move(str(p), str(dest / p.name))
        except OSError as exc:
            log(f"could not archive {p}: {exc}")
    return str(dest)


def _report(folder: Path, since: float) -> dict | None:
    path = folder / "diag" / "hang-report.json"
    try:
        if path.stat().st_mtime < since - 1:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _record_blames(plan: Plan, jid: str, environ: Mapping[str, str], blamed: dict[str, str], cause: str,
                   when: float) -> None:
    """Each blamed node into the site's node history (the job folder's parent's ``.hpcring``), as
    the follower records a finished job's: a node lost inside the allocation counts the same."""
    cluster = environ.get("SLURM_CLUSTER_NAME", "") or plan.cluster    # the record's key: follower's blames dedup
    key = "-".join(p for p in (plan.scheduler, cluster, jid) if p)
    user = environ.get("USER") or environ.get("SLURM_JOB_USER") or str(os.getuid())
    blames = [nodehistory.Blame(n, when, jid, key, why, " ".join(cause.split())[:1000], user, cluster)
              for n, why in blamed.items()]
    try:
        nodehistory.append(plan.folder.parent, blames)
    except nodehistory.HistoryError as exc:
        log(f"warning: the blamed node(s) were not recorded in the node history: {exc.message}")


def _preflight(plan: Plan, sched, allocation: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The gang check (hpcring.preflight) on every node of the allocation, before the script;
    returns {bad node: why}. Bounded: the check's deadline plus the launcher's start."""
    out = plan.folder / "preflight"
    if out.exists():                   # a requeued job's earlier check: kept beside, not mixed in
        shutil.move(str(out), str(plan.folder / f"preflight.{int(time.time())}"))
    out.mkdir(parents=True)
    cmd = [sys.executable, "-u", "-m", "hpcring.preflight", "--out", str(out), "--expect-nodes", ",".join(allocation),
           "--deadline", f"{PREFLIGHT_DEADLINE_S:g}", "--min-gbps", f"{plan.min_gbps:g}", "--gpus", str(plan.gpus),
           "--quiet"]
    for item in filter(None, (env.get("HPCRING_PREFLIGHT_IFNAME_FOR") or "").split(";")):
        cmd += ["--ifname-for", item.strip()]
    t0 = time.time()
    log(f"preflight on {len(allocation)} node(s)")
    try:
        subprocess.run(sched.gang_argv(allocation, cmd, folder=out), env=dict(env), stdin=subprocess.DEVNULL,
                       timeout=PREFLIGHT_DEADLINE_S + PREFLIGHT_LAUNCH_S)
    except subprocess.TimeoutExpired:
        log(f"preflight: the check did not end within {PREFLIGHT_DEADLINE_S + PREFLIGHT_LAUNCH_S:g} s; "
            "judging what it wrote")
    except OSError as exc:
        log(f"preflight: could not start the check ({exc}); no node left out")
        return {}
    try:
        v = preflight.read_verdict(out, list(allocation))
    except (HpcringError, ValueError) as exc:        # no secret, a host name no file may have
        log(f"preflight: no verdict ({getattr(exc, 'message', exc)}); no node left out")
        plan.checked = {"ok": False, "bad": {}, "seconds": round(time.time() - t0, 2), "error": str(exc)}
        return {}
    for line in v.lines:               # the verdict's lines name the check themselves
        log(line if line.startswith("preflight") else f"preflight: {line}")
    took = round(time.time() - t0, 2)
    if len(v.bad) * 2 > len(allocation):
        # most of the allocation failing is the environment's doing (a setting, the file system, a
        # deadline too short for the imports), not most of the nodes: leave nobody out for it
        log(f"preflight: {len(v.bad)} of {len(allocation)} nodes failed: suspecting the environment, no node "
            "left out")
        plan.checked = {"ok": False, "bad": {}, "seconds": took, "suspect_environment": dict(v.bad)}
        return {}
    log(f"preflight: {'ok' if v.ok else 'leaving out ' + ', '.join(v.bad)} in {took:.1f} s")
    plan.checked = {"ok": v.ok, "bad": dict(v.bad), "seconds": took, "folder": str(out),
                    "unsure": sorted(v.unsure)}
    return {h: f"preflight: {why}" for h, why in v.bad.items()}


def _grace(env: Mapping[str, str]) -> float:
    """Seconds between a task's failure and the end of its step (HPCRING_STEP_GRACE)."""
    return envvars.get("HPCRING_STEP_GRACE", env)


def _launcher_reasons(nodes, killed: list[tuple[str, str, str]], gone: Mapping[str, str],
                      launcher: str = "srun") -> dict[str, str]:
    """Why each node was blamed when no report says: the scheduler's node state, or the launcher's line."""
    out = {}
    for n in nodes:
        mine = [f"task{'s' if not t.isdigit() else ''} {t} {how.lower()}" for node, t, how in killed if node == n]
        parts = ([f"scheduler: {gone[n]}"] if n in gone else []) + ([f"lost ({', '.join(mine)}; {launcher})"] if mine else [])
        out[n] = ", ".join(parts) or "blamed by the launcher"
    return out


def run(plan: Plan, environ: Mapping[str, str] | None = None) -> int:
    """The loop (see the module doc); returns the exit code for the job script."""
    from hpcring import restarts  # deferred: pulls pydantic, yaml
    sched = SCHEDULERS[plan.scheduler]
    env = dict(os.environ if environ is None else environ)
    jid = sched.job_id(env)
    allocation = sched.allocation_hosts(env)
    if len(allocation) < plan.min_nodes:
        log(f"the allocation has {len(allocation)} node(s) ({','.join(allocation) or 'none'}), fewer than "
            f"--min-nodes {plan.min_nodes}: no step started")
        return 1
    base = int(env.get("HPCRING_RESTART_COUNT") or 0)   # a resubmission's count, under ours
    launcher = _Launcher(sched, jid, _grace(env))
    blamed: dict[str, str] = {}
    hosts = allocation[:plan.nodes]
    if plan.preflight:
        bad = _preflight(plan, sched, allocation, env)
        if bad:
            sure = {h: why for h, why in bad.items() if h not in set((plan.checked or {}).get("unsure") or ())}
            if sure:                   # a node blamed with no clear culprit is left out, not recorded
                _record_blames(plan, jid, env, sure, "preflight", time.time())
            blamed.update(bad)
            hosts = choose(allocation, set(blamed), {}, [], plan.nodes, plan.min_nodes)
            if hosts is None:
                left = [h for h in allocation if h not in blamed]
                write_steps(plan, allocation, {"preflight_failed": bad})
                log(f"preflight: {len(left)} healthy node(s) of {len(allocation)} ({','.join(left) or 'none'}), fewer "
                    f"than the {plan.min_nodes} the job needs: the script is not started")
                return 1
            write_steps(plan, allocation)
    attempt, last_end = 0, None
    while True:
        size = len(hosts) * plan.tasks_per_node
        env["HPCRING_RESTART_COUNT"] = str(base + attempt)
        spares = [h for h in hosts if h not in allocation[:plan.nodes]]
        started = time.time()
        step = {"attempt": attempt, "hosts": hosts, "size": size, "spares": spares, "started": started}
        if last_end is not None:      # from the fault's first sign (report, launcher) to this start
            plan.steps[-1]["lost_s"] = round(started - plan.steps[-1].get("fault_at", last_end), 3)
        plan.steps.append(step)
        write_steps(plan, allocation)
        log(f"step {attempt} on {','.join(hosts)}: {size} ranks" + (f" (spare {','.join(spares)})" if spares else "")
            + (f", restart count {base + attempt}" if attempt else ""))
        launcher.hosts, launcher.step = list(hosts), attempt
        rc, err = launcher.run(sched.step_argv(plan.launch, hosts, plan.tasks_per_node, step=attempt, folder=plan.folder), env,
                               plan.folder / "diag" / "hang-report.json")
        rc = 128 - rc if rc < 0 else rc        # the launcher killed by a signal: the shell's convention
        last_end = time.time()
        step.update(ended=last_end, rc=rc)
        if rc == 0:
            step["end"] = "COMPLETED"
            write_steps(plan, allocation)
            return 0
        if launcher.stopping is not None:
            step.update(end=f"stopped by signal {launcher.stopping}", decision="not restarted (the job was told to stop)")
            write_steps(plan, allocation)
            return rc
        records = {r: s for r, s in read_records(plan.folder, jid, size).items()
                   if not isinstance(s.get("ended"), (int, float)) or s["ended"] >= started - 1}
        report = _report(plan.folder, started)
        gone = sched.gone_nodes(allocation)
        v = restarts.classify_step(records, size, report, sched.casualties(err), gone, hosts)
        step["end"] = f"FAILED (exit {rc}): {v.cause}"
        if not v.restart:
            step["decision"] = "not restarted (no node-level fault)"
            write_steps(plan, allocation)
            log(f"step {attempt} failed: {v.cause}; not restarted (no node-level fault)")
            return rc
        reasons = restarts.node_reasons(report, v.nodes, "NODE_FAIL" if gone else "FAILED") if report else \
            _launcher_reasons(v.nodes, sched.casualties(err), gone, sched.LAUNCHER)
        step["blamed"] = reasons
        seen = [t for t in (((report or {}).get("trigger") or {}).get("time"), launcher.first_error)
                if isinstance(t, (int, float)) and started <= t <= last_end]
        step["fault_at"] = min(seen, default=last_end)
        _record_blames(plan, jid, env, reasons, v.cause, step["fault_at"])
        blamed.update(reasons)
        if attempt >= plan.max_restarts:
            step["decision"] = f"not restarted: --max-restarts {plan.max_restarts} used up"
            write_steps(plan, allocation)
            log(f"step {attempt} failed: {v.cause}; {plan.max_restarts} restart(s) made already")
            return rc
        nxt = choose(allocation, set(blamed), gone, hosts, plan.nodes, plan.min_nodes)
        if nxt is None:
            left = [h for h in allocation if h not in blamed and h not in gone]
            step["decision"] = (f"not restarted: {len(left)} healthy node(s) left, fewer than "
                                f"{'--min-nodes ' + str(plan.min_nodes) if plan.min_nodes < plan.nodes else str(plan.nodes) + ' (no spare left)'}")
            write_steps(plan, allocation)
            log(f"step {attempt} failed: {v.cause}; {step['decision']}")
            return rc
        step["archived"] = _archive(plan, jid, attempt)
        attempt += 1
        step["decision"] = f"restart {attempt} of at most {plan.max_restarts} on {','.join(nxt)}"
        log(f"step {attempt - 1} failed: {v.cause}; blamed {', '.join(f'{n} ({why})' for n, why in reasons.items())}; "
            f"{step['decision']}" + (f" ({len(nxt)} of {plan.nodes} nodes: the world shrinks to "
                                      f"{len(nxt) * plan.tasks_per_node} ranks)" if len(nxt) < plan.nodes else ""))
        hosts = nxt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcring.steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--min-nodes", type=int, default=None)
    p.add_argument("--tasks-per-node", type=int, required=True)
    p.add_argument("--max-restarts", type=int, required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--scheduler", default="slurm", choices=tuple(SCHEDULERS))
    p.add_argument("--cluster", default="")
    p.add_argument("--preflight", action="store_true")
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--preflight-min-gbps", type=float, default=0.0)
    p.add_argument("launch", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    launch = a.launch[1:] if a.launch[:1] == ["--"] else a.launch
    min_nodes = a.nodes if a.min_nodes is None else a.min_nodes
    if not launch or not 1 <= min_nodes <= a.nodes or a.tasks_per_node < 1 or a.max_restarts < 0:
        p.error("need --nodes >= --min-nodes >= 1, --tasks-per-node >= 1, --max-restarts >= 0 and a launcher after --")
    plan = Plan(a.nodes, min_nodes, a.tasks_per_node, a.max_restarts, folder_of(a.folder, os.environ), launch,
                a.scheduler, preflight=a.preflight, gpus=a.gpus, min_gbps=a.preflight_min_gbps, cluster=a.cluster)
    return run(plan)


if __name__ == "__main__":
    sys.exit(main())
