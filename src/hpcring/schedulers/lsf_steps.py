"""LSF's side of the step loop (hpcring.steps): the job's hosts, one step on some of them, how a
failed step's tasks are ended, and which hosts LSF itself calls unavailable.

A step is one ``blaunch -z "HOST HOST ..."`` (each host once per task) with
LSB_DJOB_COMMFAIL_ACTION=KILL_TASKS and LSB_DJOB_RTASK_GONE_ACTION=IGNORE_TASKCRASH (schedulers/lsf.py
KEEP_JOB_ENV): a lost host or a crashed task ends the step's tasks there, not the job. The step's
ranks find their world in a host file the loop writes (HPCRING_LSF_HOSTFILE: the step's slots, not
the job's) and carry the step's number (HPCRING_LSF_STEP), which their store port folds in and by
which :func:`kill_step` finds them. LSF has no per-step kill (``bkill`` ends the whole job, the loop
with it), so the loop ends a failed step by running ``python -m hpcring.schedulers.lsf_steps kill``
on its hosts through ``blaunch``: it SIGKILLs this user's processes of that job and step there.
Standard library and hpcring's light modules: this runs in the batch script, before every step.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcring.bootstrap import lsf_slots
from hpcring.schedulers.launch_words import remote_shell

QUERY_TIMEOUT_S = 10.0
STEP_VAR = "HPCRING_LSF_STEP"          # the step's number, in each of its tasks' environment
HOSTFILE_VAR = "HPCRING_LSF_HOSTFILE"
# The asks of LSF that keep the job alive when one host's tasks are lost (same as schedulers/lsf.py's
# KEEP_JOB_ENV, repeated here: lsf.py pulls submitit, which the batch script must not import)
KEEP_JOB_ENV = (("LSB_DJOB_COMMFAIL_ACTION", "KILL_TASKS"), ("LSB_DJOB_RTASK_GONE_ACTION", "IGNORE_TASKCRASH"))
# IBM documents no blaunch line per failed task (blaunch exits with a task's status once all have
# ended); the one it prints that names a host is a refusal to start tasks there (the emulation's
# wording: "blaunch: host node4 is not part of job <12>'s allocation")
LAUNCH_FAILED = re.compile(r"blaunch: host (\S+) is not part of job")
FAILED_TASK = LAUNCH_FAILED    # the loop's early word that the step is lost
LAUNCHER = "blaunch"
# bhosts' states in which a host takes no task: unavail (its daemons down), unreach (sbatchd down)
_GONE = re.compile(r"^(unavail|unreach)", re.I)


def allocation_hosts(environ: Mapping[str, str]) -> list[str]:
    """The job's hosts in LSF's slot order, once each (a launch node left out as the site says)."""
    found = lsf_slots.read(environ, lsf_slots.drop_launch_node(environ),
                           ("LSB_DJOB_RANKFILE", "LSB_DJOB_HOSTFILE", "LSB_MCPU_HOSTS", "LSB_HOSTS"))
    return list(dict.fromkeys(found[0])) if found else []


def job_id(environ: Mapping[str, str]) -> str:
    return environ.get("LSB_JOBID") or ""


def host_file(folder: Path, step: int, hosts: Sequence[str], tasks_per_node: int) -> Path:
    """The step's slot list (each host ``tasks_per_node`` times, in order) in the job folder, which
    every host sees: rank r is task r + 1 of the step's blaunch, on line r + 1."""
    path = Path(folder) / "steps" / f"hosts.{step}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{h}\n" for h in hosts for _ in range(tasks_per_node)))
    return path


def step_argv(launch: Sequence[str], hosts: Sequence[str], tasks_per_node: int, step: int = 0,
              folder: Path | None = None) -> list[str]:
    """``launch`` (the job script's ``blaunch -u HOSTFILE ...`` line) as a step on exactly ``hosts``:
    ``blaunch -z`` with each host ``tasks_per_node`` times, under :data:`KEEP_JOB_ENV`, the step's
    number and its host file (written under ``folder``) in the tasks' environment."""
    if not launch or launch[0].rsplit("/", 1)[-1] != "blaunch":
        raise ValueError(f"the step loop on LSF drives blaunch, not {list(launch[:1])} (site launcher.kind "
                         "must be blaunch)")
    if tasks_per_node < 1 or not hosts or any(not h or any(c.isspace() for c in h) for h in hosts):
        raise ValueError(f"a step needs host names and tasks_per_node >= 1, not {list(hosts)!r} x {tasks_per_node}")
    rest = list(launch[1:])
    if rest[:1] == ["-u"]:             # the job's host file: replaced by the step's hosts
        rest = rest[2:]
    elif rest[:1] == ["-z"]:
        rest = rest[2:]
    env = [f"{k}={v}" for k, v in KEEP_JOB_ENV] + [f"{STEP_VAR}={step}"]
    if folder is not None:
        env.append(f"{HOSTFILE_VAR}={host_file(folder, step, hosts, tasks_per_node)}")
    return ["env", *env, launch[0], "-z", " ".join(h for h in hosts for _ in range(tasks_per_node)), *rest]


def gang_argv(hosts: Sequence[str], command: Sequence[str], folder: Path | None = None) -> list[str]:
    """One task of ``command`` on each of ``hosts`` (the preflight); a task's failure ends nothing.
    ``folder`` (shared) gets the gang's host file, one line a host: task i names its host by it
    (the job's own slot list has a line per slot, not per host)."""
    env = [f"{k}={v}" for k, v in KEEP_JOB_ENV]
    if folder is not None:
        path = Path(folder) / "hosts"
        path.write_text("".join(f"{h}\n" for h in hosts))
        env.append(f"{HOSTFILE_VAR}={path}")
    return ["env", *env, "blaunch", "-z", " ".join(hosts), *remote_shell(list(command))]


def casualties(text: str) -> list[tuple[str, str, str]]:
    """(host, "?", "Launch failed") for each host blaunch said it could not start tasks on, in its
    order. blaunch names no task that ended by a signal: the rank records and the hang report
    carry those."""
    return [(m.group(1), "?", "Launch failed") for m in LAUNCH_FAILED.finditer(text)]


def gone_nodes(hosts: Sequence[str], timeout: float = QUERY_TIMEOUT_S) -> dict[str, str]:
    """{host: state} for those of ``hosts`` that ``bhosts`` calls unavail or unreach. Empty when
    bhosts cannot say (not on PATH or slow): no fault is invented."""
    if not hosts:
        return {}
    return parse_bhosts(bhosts_text(hosts, timeout) or "", hosts)


def bhosts_text(hosts: Sequence[str] = (), timeout: float = QUERY_TIMEOUT_S) -> str | None:
    """What ``bhosts -w [HOST...]`` printed, or None when it cannot say (absent, slow, refused)."""
    try:
        p = subprocess.run(["bhosts", "-w", *hosts], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def host_table(text: str) -> dict[str, tuple[str, int | None]]:
    """``bhosts -w`` lines (HOST_NAME STATUS JL/U MAX ...) -> {host: (status, MAX slots or None
    for '-')}; the header and short lines are passed over."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] != "HOST_NAME":
            out[parts[0]] = (parts[1], int(parts[3]) if parts[3].isdigit() else None)
    return out


def parse_bhosts(text: str, hosts: Sequence[str]) -> dict[str, str]:
    """``bhosts -w`` lines -> {host: status} for those of ``hosts`` that are unavailable."""
    return {h: st for h, (st, _) in host_table(text).items() if h in hosts and _GONE.match(st)}


def kill_step(job: str, hosts: Sequence[str] = (), step: int | None = None) -> list[str]:
    """SIGKILL to every task of step ``step`` of ``job`` on ``hosts``: one blaunch of this module's
    ``kill`` on them, started and not waited for (a frozen host's part may never answer). Returns
    what was signalled, for the log."""
    if not job or step is None or not hosts:
        return []
    argv = ["blaunch", "-z", " ".join(hosts), *remote_shell([sys.executable, "-m", "hpcring.schedulers.lsf_steps",
                                                             "kill", job, str(step)])]
    try:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError:
        return []
    return [f"{job} step {step} on {','.join(hosts)}"]


def step_pids(job: str, step: str, proc: Path = Path("/proc")) -> list[int]:
    """This user's processes (not this one) whose environment has LSB_JOBID=``job`` and
    HPCRING_LSF_STEP=``step``."""
    want = {f"LSB_JOBID={job}".encode(), f"{STEP_VAR}={step}".encode()}
    me, uid, out = os.getpid(), os.getuid(), []
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if d.stat().st_uid != uid:
                continue
            env = set((d / "environ").read_bytes().split(b"\0"))
        except OSError:                # gone meanwhile, or not ours to read
            continue
        if want <= env:
            out.append(int(d.name))
    return out


def main(argv: list[str]) -> int:
    """``kill JOB STEP``: SIGKILL this host's tasks of that step (run through blaunch by kill_step)."""
    if len(argv) != 3 or argv[0] != "kill" or not argv[2].isdigit():
        print("usage: python -m hpcring.schedulers.lsf_steps kill JOB STEP", file=sys.stderr)
        return 2
    for pid in step_pids(argv[1], argv[2]):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
