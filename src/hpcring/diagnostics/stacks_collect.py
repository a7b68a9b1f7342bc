"""Login side of ``hpcring stacks JOB``: collect every rank's Python stack of a running job, group them.

``collect(job_id, method="auto", timeout=60) -> StackReport``
    Slurm: the scheduler module runs ``<python> -m hpcring.diagnostics.stacks_probe JOB`` once
    per node of the running job (``slurm.run_on_nodes``: an ``srun --overlap`` step; a job not
    running is an error) under ``timeout``, and this reads what each node's probe printed (:mod:`hpcring.diagnostics.stacks_probe`). Local backend: the probe runs in this
    process. LSF: refused with a message (Slurm and local only). Raises HpcringError subclasses
    that say what failed, where, and what to do; a rank that could not be dumped is not an error
    but a line in ``StackReport.problems``.
``render(report, groups, full=False) -> str``
    The grouped summary (one line per group), then with ``full`` every distinct stack once.
``write(report, text) -> Path | None``
    ``<job folder>/diag/stacks-<timestamp>.txt`` (the summary, the distinct stacks, then every
    rank's dump as taken) when the job folder is known; None when it is not, or when it cannot be
    written (then a line in ``report.problems`` says why).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcring.diagnostics import stacks_probe
from hpcring.diagnostics.stacks import Group, format_thread, group, group_line
from hpcring.errors import HpcringError, JobNotFoundError, SchedulerError, UsageError
from hpcring.ranks import rank_ranges
from hpcring.schedulers import base



@dataclass
class RankStack:
    """One rank's stack as a probe took it (``text`` None when ``error`` says why not)."""

    rank: int
    host: str
    pid: int
    method: str | None
    text: str | None
    error: str | None
    live_file: str | None = None


@dataclass
class StackReport:
    job_id: str
    scheduler: str
    stacks: dict[int, RankStack] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    folder: Path | None = None
    ntasks: int | None = None

    def groups(self) -> list[Group]:
        """Ranks grouped by identical main-thread stacks (ranks without a stack: one group)."""
        return group({r: s.text for r, s in self.stacks.items()})


def collect(job_id: str, *, method: str = "auto", timeout: float = 60.0) -> StackReport:
    """Every rank's stack of the running job ``job_id`` (module doc)."""
    if method not in stacks_probe.METHODS:
        raise UsageError(f"--method {method!r}: choose one of {', '.join(stacks_probe.METHODS)}")
    rec = _record(job_id)
    if rec is not None:
        job_id = rec.job_id            # a record name (slurm-devcluster-38) names the scheduler's id
    scheduler = rec.scheduler if rec else "slurm"
    report = StackReport(job_id, scheduler, folder=Path(rec.folder) if rec else None,
                         ntasks=rec.ntasks if rec else None)
    if scheduler == "lsf":
        raise HpcringError(f"job {job_id} is an LSF job; `hpcring stacks` supports Slurm and the local "
                           "backend only",
                           hint="on a node of the job: `py-spy dump --pid PID`, or `kill -s RTMIN+6 PID` and read "
                                f"{rec.folder}/diag/stacks-live-rank<r>.txt")
    if scheduler == "local":
        results, problems = _collect_local(rec, method, timeout)
        where = "this machine"
    elif scheduler == "slurm":
        results, problems, where = _collect_slurm(job_id, _python(rec), method, timeout)
    else:
        raise HpcringError(f"job {job_id}: unknown scheduler {scheduler!r} in its record")
    report.problems.extend(problems)
    _merge(report, results)
    if not report.stacks:
        raise HpcringError(f"found no rank processes of job {job_id} on {where} "
                           "(Python processes with the job's id and a rank variable in their environment)",
                           hint="is the job still starting, or are its ranks not Python? "
                                + ("; ".join(report.problems) if report.problems else ""))
    if report.ntasks:
        missing = sorted(set(range(report.ntasks)) - set(report.stacks))
        if missing:
            report.problems.append(f"no process found for rank(s) {rank_ranges(missing)} "
                                   f"(of {report.ntasks}): exited, or not started yet")
    if report.folder is None:
        report.folder = _folder_from_live_files(report)
    return report


def _record(job_id: str):
    """hpcring's record of the job, or None for a Slurm job submitted otherwise."""
    try:
        return base.load_record(job_id)
    except JobNotFoundError:
        from hpcring.schedulers import slurm  # deferred: pulls submitit, jinja2, pydantic
        if not slurm.available():
            raise
        return None


def _python(rec) -> str:
    """The interpreter for the probe on the compute nodes: the site's, else this one."""
    if rec is not None:
        try:
            from hpcring.config.site import load_site  # deferred: pulls pydantic, yaml
            return load_site(rec.site).config.python or sys.executable
        except HpcringError:
            pass
    return sys.executable


def probe_command(job_id: str, python: str, method: str, timeout: float) -> list[str]:
    """What runs on every node of the job: the probe, which gets ``timeout`` seconds."""
    return [python, "-m", "hpcring.diagnostics.stacks_probe", job_id, "--scheduler", "slurm",
            "--method", method, "--timeout", f"{timeout:g}"]


def _collect_slurm(job_id: str, python: str, method: str, timeout: float) -> tuple[list[dict], list[str], str]:
    from hpcring.schedulers import slurm  # deferred: pulls submitit, jinja2, pydantic
    probe_s = max(5.0, timeout - slurm.PROBE_GRACE_S)
    out, err, code, nodelist = slurm.run_on_nodes(
        job_id, lambda own: probe_command(own, python, method, probe_s), timeout)
    results, problems = stacks_probe.read_emitted(out)
    if code == 124:
        problems.append(f"srun did not finish within {timeout:g} s (nodes not answering?)"
                        + (f": {_tail(err)}" if err.strip() else ""))
    elif code != 0:
        problems.append(f"srun exited with {code}: {_tail(err)}")
    if not results:
        raise SchedulerError(f"the stack probe step of job {job_id} produced no result "
                             f"(srun --jobid={job_id} --overlap ...): " + (_tail(err) or f"exit code {code}, no output"),
                             hint="the probe needs `srun --overlap` (Slurm >= 20.11) and hpcring importable "
                                  f"by {python} on the compute nodes")
    return results, problems, nodelist


def _collect_local(rec, method: str, timeout: float) -> tuple[list[dict], list[str]]:
    from hpcring.schedulers import local  # deferred: pulls submitit, jinja2, pydantic
    st = local.states([rec])[rec.job_id]
    if st.state != "RUNNING":
        raise HpcringError(f"local job {rec.job_id} is {st.state}, not RUNNING: there are no rank processes "
                           "to look at", hint=f"`hpcring status {rec.job_id}`")
    return [stacks_probe.probe(rec.job_id, "local", method, timeout)], []


def _merge(report: StackReport, results: list[dict]) -> None:
    """Probe results into ``report.stacks`` (first one wins when two probes saw a rank)."""
    for res in results:
        report.problems.extend(f"{res.get('host', '?')}: {n}" for n in res.get("notes", []))
        for item in res.get("ranks", []):
            rank = item.get("rank")
            if rank is None or rank in report.stacks:
                continue
            rs = RankStack(int(rank), item.get("host", "?"), int(item.get("pid", 0)), item.get("method"),
                           item.get("text"), item.get("error"), item.get("live_file"))
            report.stacks[rs.rank] = rs
            if rs.error:
                report.problems.append(f"rank {rs.rank} (pid {rs.pid} on {rs.host}): {rs.error}")


def _folder_from_live_files(report: StackReport) -> Path | None:
    for rs in report.stacks.values():
        if rs.live_file:
            p = Path(rs.live_file.removesuffix(" (deleted)"))
            if p.parent.name == "diag":
                return p.parent.parent
    return None


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


# ----------------------------------------------------------------------------------- output

def render(report: StackReport, groups: list[Group], full: bool = False) -> str:
    """The grouped summary, one line per group; with ``full``, each distinct stack once (every
    thread of the group's first rank)."""
    lines = [group_line(g) for g in groups]
    if full:
        for g in groups:
            rs = report.stacks[g.ranks[0]]
            lines += ["", f"=== {group_line(g)}  [rank {rs.rank}, pid {rs.pid} on {rs.host}, {rs.method}]"]
            if g.main is None:
                lines.append(rs.error or "(no stack)")
                continue
            lines += [format_thread(t).rstrip("\n") for t in _main_first(g)]
    return "\n".join(lines) + "\n"


def _main_first(g: Group):
    return [g.main] + [t for t in g.threads if t is not g.main]


def write(report: StackReport, text: str) -> Path | None:
    """Save ``text`` and every rank's dump under ``<job folder>/diag/`` (module doc)."""
    if report.folder is None:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = report.folder / "diag" / f"stacks-{stamp}.txt"
    parts = [f"# hpcring stacks {report.job_id} at {time.strftime('%Y-%m-%d %H:%M:%S')}", text]
    if report.problems:
        parts.append("# problems\n" + "\n".join(report.problems) + "\n")
    for rank in sorted(report.stacks):
        rs = report.stacks[rank]
        parts.append(f"# rank {rank}: pid {rs.pid} on {rs.host} via {rs.method or '-'}\n"
                     + (rs.text if rs.text else f"(no stack: {rs.error})\n"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        while path.exists():   # two calls in the same second
            n += 1
            path = path.with_name(f"stacks-{stamp}-{n}.txt")
        path.write_text("\n".join(parts))
    except OSError as exc:
        report.problems.append(f"cannot write the stacks to {path}: {exc}")
        return None
    return path
