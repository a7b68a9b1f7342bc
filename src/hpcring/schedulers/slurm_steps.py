"""Slurm's side of the step loop (hpcring.steps): the allocation's nodes, one step on some of them,
what srun said about the tasks it lost, and which nodes Slurm itself holds down.

A job submitted with spares runs with ``--no-kill`` (templates/slurm.sh.j2): a node that fails does
not end the allocation, and each restart is a new ``srun`` step on a chosen ``--nodelist``.
Standard library only: this runs in the batch script, before every step.
"""
from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence

from hpcring.hostlist import compress, expand

QUERY_TIMEOUT_S = 10.0
LAUNCHER = "srun"
# srun's line for the tasks of a node that ended by a signal: "srun: error: node2: task 1: Killed"
CASUALTY = re.compile(r"srun: error: (\S+): tasks? ([\d,-]+): (Killed|Terminated|Segmentation fault|Aborted"
                      r"|Bus error|Stopped)")
# srun's first word on a failed task (a signal or a non-zero exit): the step is lost from here
FAILED_TASK = re.compile(r"srun: error: \S+: tasks? [\d,-]+: ")
# node states (sinfo %T) in which a node cannot take a step: Slurm says it is gone. Not "drain":
# Slurm drains a node whose step would not end ("Kill task failed"), which a frozen peer node's
# stepd causes, and an allocation's steps still run on a draining node
_GONE = re.compile(r"down|fail|not_responding|unknown|power", re.I)


def allocation_hosts(environ: Mapping[str, str]) -> list[str]:
    """The job's nodes in Slurm's order (SLURM_JOB_NODELIST expanded as Slurm does)."""
    text = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    return expand(text) if text else []


def job_id(environ: Mapping[str, str]) -> str:
    return environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or ""


def step_argv(launch: Sequence[str], hosts: Sequence[str], tasks_per_node: int, step: int = 0,
              folder=None) -> list[str]:
    """``launch`` (the job script's srun line, without a size) as a step on exactly ``hosts``.

    ``--nodelist`` with ``--nodes`` equal to its length pins the step; Slurm orders the tasks by
    the allocation's node order, so rank r runs on the (r // tasks_per_node)-th host of
    :func:`ordered` ``hosts``. ``step`` and ``folder`` are not needed here (srun numbers its steps
    and gives each task its world)."""
    if not launch or launch[0].rsplit("/", 1)[-1] != "srun":
        raise ValueError(f"the step loop drives srun, not {launch[:1]}")
    n = len(hosts)
    size = [f"--nodes={n}", f"--ntasks={n * tasks_per_node}", f"--ntasks-per-node={tasks_per_node}", "--open-mode=append",
            "--overlap",
            f"--nodelist={compress(list(hosts))}"]
    return [launch[0], *size, *launch[1:]]


def node_step_argv(host: str, tasks_per_node: int, command: Sequence[str]) -> list[str]:
    """``tasks_per_node`` tasks of ``command`` as a step on ``host`` alone (hpcring run --elastic:
    a node's workers); a task's failure ends none of the others (the elastic driver decides)."""
    return step_argv(["srun", "--unbuffered", "--kill-on-bad-exit=0", *command], [host], tasks_per_node)


def gang_argv(hosts: Sequence[str], command: Sequence[str], folder=None) -> list[str]:
    """One task of ``command`` on each of ``hosts`` (the preflight), whatever the job's layout; a
    task's failure ends nothing (each node's own verdict is what counts). ``folder``: not needed
    (srun gives each task its node)."""
    n = len(hosts)
    return ["srun", "--unbuffered", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(hosts))}", "--overlap", "--kill-on-bad-exit=0", *command]


# srun could not start the step's tasks on a node (its slurmd gone, the node unfit): a spare that
# never starts, in srun 22.05-24.11's words
LAUNCH_FAILED = re.compile(r"srun: error: Task launch for \S+ failed on node (\S+):")


def casualties(text: str) -> list[tuple[str, str, str]]:
    """(node, tasks, how) for each task srun reported ended by a signal, and ``(node, "?",
    "Launch failed")`` for a node where srun could not start them, in srun's order."""
    found = [(m.start(), m.groups()) for m in CASUALTY.finditer(text)]
    found += [(m.start(), (m.group(1), "?", "Launch failed")) for m in LAUNCH_FAILED.finditer(text)]
    return [g for _, g in sorted(found)]


def gone_nodes(hosts: Sequence[str], timeout: float = QUERY_TIMEOUT_S) -> dict[str, str]:
    """{node: state} for those of ``hosts`` that Slurm holds down, drained, failing or not
    responding (one ``sinfo`` for all of them). Empty when sinfo cannot say (it is not the
    step loop's place to fail the job over a query)."""
    if not hosts:
        return {}
    try:
        p = subprocess.run(["sinfo", "-h", "-N", "-n", compress(list(hosts)), "-o", "%N %T"],
                           capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in hosts and _GONE.search(parts[1]):
            out[parts[0]] = parts[1]
    return out


def kill_step(job: str, hosts: Sequence[str] = (), step: int | None = None,
              timeout: float = QUERY_TIMEOUT_S) -> list[str]:
    """SIGKILL to every task of the job's running steps (not the batch step: the loop runs there),
    sent and not waited for: slurmd answers once the step's own teardown is done. Returns the
    steps signalled (``hosts``, ``step``: the loop's; squeue knows Slurm's own step ids)."""
    try:
        p = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    steps = [w for w in p.stdout.split() if re.fullmatch(rf"{re.escape(job)}\.\d+", w)]
    for step in steps:
        try:
            subprocess.Popen(["scancel", "--signal=KILL", step], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            pass
    return steps
