"""Node side of ``hpcring stacks JOB``: find this node's rank processes of a job, dump their stacks.

    python -m hpcring.diagnostics.stacks_probe JOB [--scheduler slurm|local] [--method auto|py-spy|signal]
                                                   [--timeout SECONDS]

Run as one task per node of a job step (``srun --jobid=JOB --overlap``) or, for the local
backend, on this machine. Prints one JSON object (see :func:`probe`) as chunked lines
``@@hpcring-stacks <tag> <i>/<n> <chunk>``, short enough that srun never splits or interleaves
them; :func:`read_emitted` puts them back together. Exit code 0 whenever it could look.

Which processes are ranks: Python processes (``/proc/P/exe`` named python*/pypy*) whose initial
environment has the job's id (``SLURM_JOB_ID``; local backend: ``HPCRING_JOB_ID`` or
``SUBMITIT_LOCAL_JOB_ID``) and a rank variable (:data:`RANK_VARS`), on this node
(``SLURMD_NODENAME`` equal to the probe's: on the dev cluster every node sees every process),
not in the probe's own job step. Per rank the outermost such process is taken (forked data
loader workers are its descendants), except an ``hpcring run`` wrapper (``hpcring.rank_exec``),
whose command child is taken instead.

How a stack is taken: ``py-spy dump --full-filenames`` when py-spy is found (PATH, or next to
this interpreter); else, or when py-spy fails, the rank's own hook
(:func:`hpcring.diagnostics.stacks.install_signal_dump`): the probe finds the hook's file among
the process's open files, checks that the process catches the stack signal (SIGRTMIN+6) (never sends a signal that
would kill it), sends it, and reads what is appended, with a deadline.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcring.diagnostics.stacks import LIVE_FILE_RE, STACK_SIGNAL, signal_name

MARKER = "@@hpcring-stacks"
CHUNK = 900
METHODS = ("auto", "py-spy", "signal")
RANK_VARS = ("HPCRING_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK", "SLURM_PROCID",
             "SUBMITIT_LOCAL_GLOBALID", "LSF_PM_TASKID")
JOB_VARS = {"slurm": ("SLURM_JOB_ID",), "local": ("HPCRING_JOB_ID", "SUBMITIT_LOCAL_JOB_ID")}
PYSPY_TIMEOUT = 30.0
_QUIET_S = 0.25   # a dump is complete when its file has not grown for this long


class ProbeError(Exception):
    """One rank's stack could not be taken; the message says why and what to do."""


@dataclass
class Proc:
    """A process as /proc shows it (initial environment: later os.environ changes are not seen)."""

    pid: int
    ppid: int
    exe: str
    cmdline: list[str]
    env: dict[str, str]


# ------------------------------------------------------------------------------------- /proc

def read_proc(pid: int) -> Proc | None:
    """The process ``pid``, or None when it is gone or not ours to read."""
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/environ", "rb") as fh:
            raw_env = fh.read()
        with open(f"{base}/cmdline", "rb") as fh:
            cmdline = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        with open(f"{base}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
        try:
            exe = os.readlink(f"{base}/exe")
        except OSError:
            exe = cmdline[0] if cmdline else ""
    except OSError:
        return None
    env = {}
    for item in raw_env.split(b"\0"):
        key, sep, val = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = val.decode(errors="replace")
    try:
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        ppid = 0
    return Proc(pid, ppid, exe, cmdline, env)


def proc_state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z, ...) or "gone"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def ancestors(pid: int, limit: int = 64) -> list[int]:
    """Parent, grandparent, ... of ``pid`` (up to ``limit``), from /proc/P/stat."""
    out: list[int] = []
    while pid > 1 and len(out) < limit:
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                pid = int(fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        out.append(pid)
    return out


def is_python(p: Proc) -> bool:
    name = os.path.basename(p.exe).split(" ")[0]
    return name.startswith(("python", "pypy"))


def rank_of(env: dict[str, str]) -> int | None:
    """The process's global rank from the first rank variable set (:data:`RANK_VARS`)."""
    for var in RANK_VARS:
        val = env.get(var, "").strip()
        if val.isdigit():
            return int(val)
    return None


def belongs(env: dict[str, str], job_id: str, scheduler: str) -> bool:
    return any(env.get(var) == job_id for var in JOB_VARS[scheduler])


# ------------------------------------------------------------------------- finding the ranks

def find_ranks(job_id: str, scheduler: str = "slurm", *, me: dict[str, str] | None = None,
               my_pid: int | None = None) -> tuple[dict[int, Proc], list[str]]:
    """This node's rank processes of ``job_id``: {rank: process}, plus notes on what was skipped.

    ``me`` is the probe's own environment (its step and node decide what is skipped)."""
    me = dict(os.environ) if me is None else me
    my_pid = os.getpid() if my_pid is None else my_pid
    skip = {my_pid, *ancestors(my_pid)}
    node = me.get("SLURMD_NODENAME") if scheduler == "slurm" else None
    step = me.get("SLURM_STEP_ID") if me.get("SLURM_JOB_ID") == job_id else None
    found: dict[int, list[Proc]] = {}
    others: list[str] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        p = read_proc(int(entry))
        if p is None or not belongs(p.env, job_id, scheduler):
            continue
        if node is not None and p.env.get("SLURMD_NODENAME", node) != node:
            continue
        if step is not None and p.env.get("SLURM_STEP_ID") == step:
            continue
        rank = rank_of(p.env)
        if rank is None or not is_python(p):
            others.append(f"{p.pid} ({os.path.basename(p.exe) or '?'})")
            continue
        found.setdefault(rank, []).append(p)
    notes = []
    chosen = {rank: _choose(procs, notes) for rank, procs in sorted(found.items())}
    if not chosen and others:
        notes.append(f"processes of job {job_id} here that are not Python ranks: {', '.join(others[:10])}")
    return chosen, notes


def _choose(procs: list[Proc], notes: list[str]) -> Proc:
    """The rank's process among several with its rank (module doc)."""
    pids = {p.pid for p in procs}
    outer = [p for p in procs if not pids.intersection(ancestors(p.pid))]
    best = min(outer or procs, key=lambda p: p.pid)
    if any("hpcring.rank_exec" in a for a in best.cmdline):
        kids = [p for p in procs if best.pid in ancestors(p.pid)]
        if kids:
            best = min(kids, key=lambda p: len(ancestors(p.pid)))
    if len(outer) > 1:
        notes.append(f"rank {rank_of(best.env)}: several processes ({', '.join(str(p.pid) for p in outer)}); "
                     f"took {best.pid}")
    return best


# --------------------------------------------------------------------------------- dumping

def find_pyspy() -> str | None:
    """py-spy on PATH, else next to this interpreter (a venv that is not activated)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


def dump_pyspy(pid: int, pyspy: str, deadline: float) -> str:
    """``py-spy dump`` of ``pid`` within the deadline; raises ProbeError with py-spy's message."""
    budget = max(1.0, min(PYSPY_TIMEOUT, deadline - time.monotonic()))
    try:
        r = subprocess.run([pyspy, "dump", "--pid", str(pid), "--full-filenames"], capture_output=True,
                           text=True, timeout=budget, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"py-spy dump --pid {pid} did not finish within {budget:.0f} s") from None
    except OSError as exc:
        raise ProbeError(f"cannot run {pyspy}: {exc}") from None
    if r.returncode != 0 or "Thread " not in r.stdout:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise ProbeError(f"py-spy dump --pid {pid} failed (exit {r.returncode}): "
                         f"{msg[-1] if msg else 'no output'}"
                         + ("; ptrace may be restricted (kernel.yama.ptrace_scope)" if "ermission" in r.stderr else ""))
    return r.stdout


def hook_file(pid: int) -> tuple[str, str] | None:
    """(``/proc/P/fd/N``, the file's path) of the rank's live stack file, if it has one open."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if LIVE_FILE_RE.search(target.removesuffix(" (deleted)")):
            return f"{fd_dir}/{fd}", target
    return None


def catches(pid: int, signum: int) -> bool:
    """True when ``pid`` has a handler for ``signum`` (SigCgt in /proc/P/status)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def dump_signal(pid: int, deadline: float, signum: int = STACK_SIGNAL) -> tuple[str, str]:
    """Send ``signum`` to a rank with the hook and return (what it appended, the live file)."""
    sig = signal_name(signum)
    hook = hook_file(pid)
    if hook is None:
        raise ProbeError(f"process {pid} has no stack dump hook (no stacks-live-rank*.txt open: "
                         "hpcring.diagnostics.stacks.install_signal_dump was not called in it) and py-spy "
                         "is not available; install py-spy next to the job's Python")
    fd_link, path = hook
    if not catches(pid, signum):
        raise ProbeError(f"process {pid} has {path} open but does not catch {sig}; not sending it "
                         "(the default action would kill the rank)")
    try:
        fh = open(fd_link, "rb")
    except OSError as exc:
        raise ProbeError(f"cannot open process {pid}'s stack file {path}: {exc}") from None
    with fh:
        start = os.fstat(fh.fileno()).st_size
        try:
            os.kill(pid, signum)
        except OSError as exc:
            raise ProbeError(f"cannot send {sig} to process {pid}: {exc}") from None
        end = _wait_growth(fh, start, deadline)
        if end <= start:
            raise ProbeError(f"process {pid} wrote no stacks to {path} within the deadline after {sig} "
                             f"(state {proc_state(pid)}: T = stopped, D = stuck in the kernel); "
                             "try py-spy, which reads a stopped process")
        fh.seek(start)
        return fh.read(end - start).decode(errors="replace"), path


def _wait_growth(fh, start: int, deadline: float) -> int:
    """The file's size once it has grown past ``start`` and stayed still for a moment, or at the
    deadline (then possibly still ``start``)."""
    size, changed = start, time.monotonic()
    while True:
        now = time.monotonic()
        cur = os.fstat(fh.fileno()).st_size
        if cur != size:
            size, changed = cur, now
        if (size > start and now - changed >= _QUIET_S) or now >= deadline:
            return size
        time.sleep(0.02)


def dump(p: Proc, method: str, deadline: float, pyspy: str | None) -> dict:
    """One rank's record: rank, pid, host, method, text (None on failure), error, live_file."""
    rec = {"rank": rank_of(p.env), "pid": p.pid, "host": socket.gethostname(), "method": None,
           "text": None, "error": None, "live_file": None}
    errors = []
    if method in ("auto", "py-spy"):
        if pyspy is None:
            errors.append("py-spy is not installed (pip install py-spy)")
        else:
            try:
                rec.update(method="py-spy", text=dump_pyspy(p.pid, pyspy, deadline))
                return rec
            except ProbeError as exc:
                errors.append(str(exc))
    if method in ("auto", "signal") and any("hpcring.rank_exec" in a for a in p.cmdline):
        errors.append(f"process {p.pid} is an `hpcring run` wrapper, which forwards the stack signal to its command; "
                      "not sending it")
    elif method in ("auto", "signal"):
        try:
            text, path = dump_signal(p.pid, deadline)
            rec.update(method="signal", text=text, live_file=path)
            return rec
        except ProbeError as exc:
            errors.append(str(exc))
    rec["error"] = "; ".join(errors)
    return rec


def probe(job_id: str, scheduler: str = "slurm", method: str = "auto", timeout: float = 30.0) -> dict:
    """Stacks of this node's ranks of ``job_id``: ``{"host", "ranks": [dump(...) records],
    "notes": [...]}``. Every rank shares one deadline of ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    procs, notes = find_ranks(job_id, scheduler)
    pyspy = find_pyspy() if method in ("auto", "py-spy") else None
    ranks = []
    for rank, p in procs.items():
        if time.monotonic() >= deadline:
            ranks.append({"rank": rank, "pid": p.pid, "host": socket.gethostname(), "method": None,
                          "text": None, "error": f"probe deadline ({timeout:.0f} s) passed before this rank",
                          "live_file": None})
            continue
        ranks.append(dump(p, method, deadline, pyspy))
    return {"host": socket.gethostname(), "ranks": ranks, "notes": notes}


# ------------------------------------------------------------------------------ the wire format

def emit(result: dict, tag: str, out=None) -> None:
    """Print ``result`` as chunked marker lines (module doc)."""
    out = sys.stdout if out is None else out
    text = json.dumps(result)
    chunks = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    for i, chunk in enumerate(chunks):
        out.write(f"{MARKER} {tag} {i + 1}/{len(chunks)} {chunk}\n")
    out.flush()


def read_emitted(text: str) -> tuple[list[dict], list[str]]:
    """The results in srun's output (any order, other lines ignored) and problems (truncated ones)."""
    parts: dict[str, dict[int, str]] = {}
    totals: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith(MARKER + " "):
            continue
        try:
            _, tag, pos, chunk = line.split(" ", 3)
        except ValueError:
            _, tag, pos = line.split(" ", 2)
            chunk = ""
        i, _, n = pos.partition("/")
        if not (i.isdigit() and n.isdigit()):
            continue
        parts.setdefault(tag, {})[int(i)] = chunk
        totals[tag] = int(n)
    results, problems = [], []
    for tag, got in parts.items():
        if len(got) != totals[tag]:
            problems.append(f"probe output of {tag} is incomplete ({len(got)} of {totals[tag]} parts)")
            continue
        try:
            results.append(json.loads("".join(got[i] for i in sorted(got))))
        except ValueError as exc:
            problems.append(f"probe output of {tag} is not valid JSON: {exc}")
    return results, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcring.diagnostics.stacks_probe",
                                 description="Dump the Python stacks of this node's ranks of a job.")
    ap.add_argument("job_id")
    ap.add_argument("--scheduler", choices=sorted(JOB_VARS), default="slurm")
    ap.add_argument("--method", choices=METHODS, default="auto")
    ap.add_argument("--timeout", type=float, default=30.0, help="deadline for all ranks here (s)")
    a = ap.parse_args(argv)
    result = probe(a.job_id, a.scheduler, a.method, a.timeout)
    tag = f"{socket.gethostname()}:{os.environ.get('SLURM_PROCID', '0')}"
    emit(result, tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
