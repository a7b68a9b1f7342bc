"""Per-rank entry of ``hpcring run``: ``rank_life`` (bootstrap, framework env, torch watch, the
status record), then CMD as a supervised child whose output is tagged with the rank.

    python -m hpcring.rank_exec [--status-dir DIR] -- CMD...

DIR: the folder of the status records (``outcome.py``); without it, the job folder.

Rank 0's rendezvous store stays up while CMD runs (it lives in this process), so a CMD that calls
``hpcring.init()`` itself finds its peers through the variables exported here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from hpcring.jobdir import job_folder
from hpcring.bootstrap.auth import delete_secret_file
from hpcring.diagnostics.stacks import STACK_SIGNAL
from hpcring.rank_life import RankLife
from hpcring.schedulers.supervisor import start
from hpcring.diagnostics.watchdog import DUMP_SIGNAL
from hpcring.session import handoff_env


def _pump(src, dst, prefix: bytes) -> None:
    for line in iter(src.readline, b""):
        dst.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        dst.flush()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    status_dir = None
    if argv[:1] == ["--status-dir"]:
        status_dir, argv = Path(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m hpcring.rank_exec [--status-dir DIR] -- CMD...", file=sys.stderr)
        return 2
    # the records go where the starter reads them (hpcring run: the run's folder), else the job's
    life = RankLife(status_dir or job_folder(), argv, tag_output=True)
    session = life.bootstrap(watchdog=False)   # the child CMD runs the collectives and the watchdog
    if session is None:
        return 1
    topo = session.topology
    os.environ.update(handoff_env(session))
    life.watch_torch(child=True)       # a torch process group in CMD gets hpcring's hang report
    parent = os.getppid()
    life.child_error_file()
    try:
        child = start(argv, dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:   # no such command, not executable: say so once, like a shell would
        what = f"cannot run {argv[0]!r} on {topo.host}: {exc.strerror}"
        life.say(f"{what}\n  hint: check the command after `--` (is it on PATH on every node? a typo?)")
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        life.finish(code, what)
        return code

    def forward(signum, _frame):
        if signum == signal.SIGTERM and os.getppid() != parent:
            _orphaned(child, status_dir)          # `hpcring run` is gone (PR_SET_PDEATHSIG)
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, STACK_SIGNAL, DUMP_SIGNAL):
        signal.signal(sig, forward)
    pumps = [threading.Thread(target=_pump, args=(child.stdout, sys.stdout.buffer, f"[{topo.rank}]<stdout>:".encode()),
                              daemon=True),
             threading.Thread(target=_pump, args=(child.stderr, sys.stderr.buffer, f"[{topo.rank}]<stderr>:".encode()),
                              daemon=True)]
    for p in pumps:
        p.start()
    code = child.wait()
    for p in pumps:
        p.join(timeout=5)
    code = code if code >= 0 else 128 - code  # killed by a signal: shell convention
    error = life.child_error()         # read either way: the file goes with it
    life.finish(code, error if code else None)
    return code


def _orphaned(child, status_dir: Path | None) -> None:
    """The supervisor died (even by SIGKILL): end CMD, remove the job's secret and run folder, exit."""
    child.kill()
    delete_secret_file(os.environ.get("HPCRING_SECRET_FILE"))
    if status_dir is not None and status_dir.parent.name.startswith("hpcring-run-"):
        import shutil
        shutil.rmtree(status_dir.parent, ignore_errors=True)
    os._exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
