"""The local backend's queue: an array's tasks (at most ``--parallel`` at once) and jobs that wait
for other local jobs (``--after KIND:JOB:STATE_FILE``), started detached by ``local.spawn``.

Each task is the whole job: the rendered script with ``HPCRING_LOCAL_JOB_ID=<id>_<task>`` and
``HPCRING_ARRAY_TASK=<task>``, in its own session (``cancel JOB_TASK`` stops one task), writing its
own ``<root>/<id>_<task>/<id>_<task>_local.json``. Until a task starts, its state file says PENDING
with this queue's pid (a dead queue makes it FAILED, as a vanished supervisor does) and no
process group (``cancel`` then only marks it CANCELLED; the queue skips it).

A dependency is waited for at most HPCRING_LOCAL_AFTER_TIMEOUT_S (then the waiting job FAILS
with that reason); one that can no longer be met (``afterok`` on a job that failed) ends the
waiting job CANCELLED with the reason, where Slurm would leave it pending forever.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcring.fsutil import write_json
from hpcring.bootstrap.auth import delete_secret_file
from hpcring.config import envvars

POLL_S = 0.5
ALIVE = ("PENDING", "RUNNING")


def _folder(folder: str, job_id: str) -> Path:
    return Path(folder.replace("%j", job_id))


def _state_path(folder: str, job_id: str) -> Path:
    return _folder(folder, job_id) / f"{job_id}_local.json"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hpcring.schedulers.local_queue")
    ap.add_argument("job_id")
    ap.add_argument("script")
    ap.add_argument("folder")
    ap.add_argument("time_limit_s")
    ap.add_argument("--tasks", default=None, help="array task indices, comma-separated")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--after", action="append", default=[], help="KIND:JOB:STATE_FILE")
    return ap


def _jobs(a) -> list[tuple[str, int | None]]:
    if a.tasks is None:
        return [(a.job_id, None)]
    return [(f"{a.job_id}_{i}", int(i)) for i in a.tasks.split(",")]


def start(job_id: str, script: str, folder: str, time_limit_s: str, queue: list[str]) -> str:
    """Write every task's PENDING state, then start the queue detached; returns ``job_id``."""
    a = _parser().parse_args([job_id, script, folder, time_limit_s, *queue])
    for jid, _ in _jobs(a):
        _folder(folder, jid).mkdir(parents=True, exist_ok=True)
        write_json(_state_path(folder, jid), {"state": "PENDING", "pid": None, "pgid": None, "submitted": time.time()})
    root = _folder(folder, job_id)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{job_id}_queue.log", "ab") as log:
        subprocess.Popen([sys.executable, "-m", "hpcring.schedulers.local_queue", job_id, script, folder,
                          time_limit_s, *queue], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True, close_fds=True)
    return job_id


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not); the local backend's job liveness."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive for our purposes
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def _alive(pid) -> bool:
    return bool(pid) and pid_alive(int(pid))


def _end_pending(a, state: str, reason: str) -> None:
    """Every task not started yet ends ``state`` with ``reason``."""
    for jid, _ in _jobs(a):
        path = _state_path(a.folder, jid)
        data = _read(path) or {}
        if data.get("state") == "PENDING" and not data.get("pgid"):
            data.update(state=state, reason=reason, ended=time.time(), exit_code=data.get("exit_code") or 1)
            write_json(path, data)


def _dependency(kind: str, dep: str, path: Path) -> str | None:
    """None while undecided; "ok", or why it can never be met."""
    data = _read(path) or {}
    st = data.get("state", "UNKNOWN")
    if st in ALIVE and data.get("pid") and not _alive(data["pid"]):
        st = "FAILED"
    if kind == "after":
        return None if st == "PENDING" else "ok"
    if st in ALIVE or st == "UNKNOWN":
        return None
    met = {"afterok": st == "COMPLETED", "afternotok": st != "COMPLETED", "afterany": True}[kind]
    return "ok" if met else f"dependency {kind}:{dep} can never be met: job {dep} ended {st}"


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    jobs = _jobs(a)
    for jid, _ in jobs:                # the queue is these tasks' keeper until each one starts
        path = _state_path(a.folder, jid)
        data = _read(path) or {}
        if data.get("state") == "PENDING" and not data.get("pgid"):
            data["pid"] = os.getpid()
            write_json(path, data)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(1))

    deadline = time.monotonic() + envvars.get("HPCRING_LOCAL_AFTER_TIMEOUT_S")
    for item in a.after:
        kind, dep, path = item.split(":", 2)
        while (verdict := _dependency(kind, dep, Path(path))) is None:
            if stopping:
                _end_pending(a, "CANCELLED", "cancelled before it started")
                return 1
            if time.monotonic() > deadline:
                _end_pending(a, "FAILED", f"dependency {kind}:{dep} not resolved within "
                                          f"HPCRING_LOCAL_AFTER_TIMEOUT_S ({envvars.get('HPCRING_LOCAL_AFTER_TIMEOUT_S'):g} s)")
                return 1
            time.sleep(POLL_S)
        if verdict != "ok":
            _end_pending(a, "CANCELLED", verdict)
            return 1

    running: list[subprocess.Popen] = []
    for jid, index in jobs:            # a queued task waits at most the tasks before it (each bounded)
        while len(running) >= max(1, a.parallel) and not stopping:
            running = [p for p in running if p.poll() is None]
            time.sleep(POLL_S if len(running) >= a.parallel else 0)
        if stopping:
            break
        path = _state_path(a.folder, jid)
        data = _read(path) or {}
        if data.get("state") != "PENDING" or data.get("pgid"):
            continue                   # cancelled while queued
        env = dict(os.environ, HPCRING_LOCAL_JOB_ID=jid, HPCRING_TIME_LIMIT_S=a.time_limit_s)
        if index is not None:
            env["HPCRING_ARRAY_TASK"] = str(index)
        with open(_folder(a.folder, jid) / f"{jid}_supervisor.log", "ab") as log:
            proc = subprocess.Popen(["bash", a.script], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env=env, start_new_session=True, close_fds=True)
        data = _read(path) or data     # local_run may have written RUNNING already: keep its record
        if data.get("state") == "PENDING" and not data.get("pgid"):
            data.update(pid=proc.pid, pgid=proc.pid)
            write_json(path, data)
        running.append(proc)
    if stopping:
        _end_pending(a, "CANCELLED", "cancelled before it started")
    limit = float(a.time_limit_s or 0)
    for p in running:                  # each task's supervisor enforces its time limit; this bounds the wait
        try:                           # on a supervisor that did not (its limit, its stop, a margin)
            p.wait(timeout=limit + 60 if limit > 0 else None)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
    if a.tasks is not None:            # the last task has ended: the tasks' shared secret goes
        delete_secret_file(os.environ.get("HPCRING_SECRET_FILE"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
