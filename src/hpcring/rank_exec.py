"""Per-rank entry of ``hpcring run``: bootstrap, export framework env, run CMD, tag its output.

    python -m hpcring.rank_exec --status-dir DIR -- CMD...

Rank 0's rendezvous store stays up while CMD runs (it lives in this process), so a CMD that calls
``hpcring.init()`` itself finds its peers through the variables exported here.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcring.config import envvars
from hpcring.errors import HpcringError


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
        from hpcring.bootstrap.launchers import detect
        t = detect()
        print(f"[{t.rank}]<stderr>:hpcring: {exc}", file=sys.stderr, flush=True)
        _status(status_dir, t.rank, {"rank": t.rank, "host": t.hosts[t.rank], "exit_code": 1,
                                     "error": str(exc).splitlines()[0], "ended": time.time()})
        return 1
    topo = session.topology
    apply_framework_env(topo, gpus)
    from hpcring.session import handoff_env
    os.environ.update(handoff_env(session))
    from hpcring.diagnostics.torch_watch import child_env
    os.environ.update(child_env())     # a torch process group in CMD gets hpcring's hang report
    try:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    except OSError as exc:   # no such command, not executable: say so once, like a shell would
        what = f"cannot run {argv[0]!r} on {topo.host}: {exc.strerror}"
        print(f"[{topo.rank}]<stderr>:hpcring: {what}\n  hint: check the command after `--` "
              "(is it on PATH on every node? a typo?)", file=sys.stderr, flush=True)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        _status(status_dir, topo.rank, {"rank": topo.rank, "host": topo.host, "exit_code": code,
                                        "error": what, "cmd": argv, "ended": time.time()})
        return code

    def forward(signum, _frame):
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


def _status(folder: Path | None, rank: int, data: dict) -> None:
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{rank}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, folder / f"{rank}.json")
    except OSError as exc:
        print(f"hpcring: could not record rank {rank}'s status in {folder}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
