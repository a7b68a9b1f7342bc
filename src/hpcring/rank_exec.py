"""Per-rank entry of ``hpcring run``: bootstrap, export framework env, run CMD, tag its output.

    python -m hpcring.rank_exec --status-dir DIR -- CMD...

Rank 0's rendezvous store stays up while CMD runs (it lives in this process), so a CMD that calls
``hpcring.init()`` itself finds its peers through the variables exported here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcring.config import envvars
from hpcring.errors import HpcringError
from hpcring.fsutil import write_json
from hpcring.outcome import bootstrap_failure


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
    from hpcring.bootstrap.init import apply_framework_env
    from hpcring.session import init
    try:
        envvars.check_environ()
        gpus = envvars.get("HPCRING_GPUS_PER_NODE")
        session = init(watchdog=False)   # the child CMD runs the collectives and the watchdog
    except HpcringError as exc:
        st = bootstrap_failure(exc, first_line=True)
        print(f"[{st['rank']}]<stderr>:hpcring: {exc}", file=sys.stderr, flush=True)
        _status(status_dir, st["rank"], st)
        return 1
    topo = session.topology
    apply_framework_env(topo, gpus)
    from hpcring.session import handoff_env
    os.environ.update(handoff_env(session))
    from hpcring.diagnostics.torch_watch import SITE_DIR, child_env
    os.environ.update(child_env())     # a torch process group in CMD gets hpcring's hang report
    path = os.environ.get("PYTHONPATH", "")
    if SITE_DIR not in path.split(os.pathsep):   # the watch is off: the site still registers the backend
        os.environ["PYTHONPATH"] = SITE_DIR + (os.pathsep + path if path else "")
    from hpcring.schedulers.supervisor import start
    parent = os.getppid()
    try:
        child = start(argv, dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:   # no such command, not executable: say so once, like a shell would
        what = f"cannot run {argv[0]!r} on {topo.host}: {exc.strerror}"
        print(f"[{topo.rank}]<stderr>:hpcring: {what}\n  hint: check the command after `--` "
              "(is it on PATH on every node? a typo?)", file=sys.stderr, flush=True)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        _status(status_dir, topo.rank, {"rank": topo.rank, "host": topo.host, "exit_code": code,
                                        "error": what, "cmd": argv, "ended": time.time()})
        return code

    def forward(signum, _frame):
        if signum == signal.SIGTERM and os.getppid() != parent:
            _orphaned(child, status_dir)          # `hpcring run` is gone (PR_SET_PDEATHSIG)
        if child.poll() is None:
            child.send_signal(signum)

    from hpcring.diagnostics.stacks import STACK_SIGNAL
    from hpcring.diagnostics.watchdog import DUMP_SIGNAL
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
    _status(status_dir, topo.rank, {"rank": topo.rank, "host": topo.host, "exit_code": code,
                                    "cmd": argv, "ended": time.time()})
    return code


def _orphaned(child, status_dir: Path | None) -> None:
    """The supervisor died (even by SIGKILL): end CMD, remove the job's secret and run folder, exit."""
    from hpcring.bootstrap.auth import delete_secret_file
    child.kill()
    delete_secret_file(os.environ.get("HPCRING_SECRET_FILE"))
    if status_dir is not None and status_dir.parent.name.startswith("hpcring-run-"):
        import shutil
        shutil.rmtree(status_dir.parent, ignore_errors=True)
    os._exit(128 + signal.SIGTERM)


def _status(folder: Path | None, rank: int, data: dict) -> None:
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / f"{rank}.json", data)
    except OSError as exc:
        print(f"hpcring: could not record rank {rank}'s status in {folder}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
