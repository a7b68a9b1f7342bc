"""One rank's life, shared by both rank entries: a submitted job's (``job.RunScript``, the user's
script in this process) and ``hpcring run``'s (``rank_exec``, CMD in a child process).

Each step is written once here, in this order: the record begun; the bootstrap (``hpcring.init()``
after the environment check; a failure is recorded under the launcher's rank and said in one
message, no traceback); the framework env (RANK, WORLD_SIZE, ...); the torch watch (in this
process, or handed to the child); the outcome recorded (``outcome.write_record``: the one status
record format, documented in outcome.py). Running the work, ending a failed job and the secret
stay with each entry: they differ in kind (a script in this process vs a supervised child).
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from hpcring.errors import HpcringError
from hpcring.jobdir import job_id
from hpcring.outcome import write_record
from hpcring.bootstrap.frameworks import apply_framework_env
from hpcring.config import envvars
from hpcring.diagnostics import torch_watch


class RankLife:
    """One rank: its record, begun now, in ``folder`` (see outcome.py for its fields)."""

    def __init__(self, folder: Path, cmd: list[str], *, tag_output: bool = False) -> None:
        self.folder = Path(folder)
        self.job_id = job_id()
        self.tag_output = tag_output     # hpcring run tags the rank's own lines as it tags CMD's
        self.record: dict = {"rank": None, "host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.time(), "cmd": list(cmd), "exit_code": None, "error": None}
        self.failure: HpcringError | None = None   # the bootstrap's error, when it failed

    def bootstrap(self, gpus_per_node: int | None = None, *, watchdog: bool = True):
        """``hpcring.init()`` and the framework env; the session, or None when the bootstrap failed
        (then recorded, said, and kept in ``self.failure``). ``gpus_per_node`` None: the job's
        HPCRING_GPUS_PER_NODE. ``watchdog``: this process runs the collectives (a failure the
        watchdog reports then ends this rank with its headline recorded)."""
        from hpcring.session import init  # deferred: pulls numpy (session -> collectives)
        try:
            envvars.check_environ()
            gpus = envvars.get("HPCRING_GPUS_PER_NODE") if gpus_per_node is None else gpus_per_node
            session = init(watchdog=watchdog)
        except HpcringError as exc:
            self.failure = exc
            self.record.update(bootstrap_failure(exc))
            self.write()
            # what, where and what to do; a traceback of hpcring's frames would only bury it
            self.say(f"rank {self.record['rank']} on {self.record['host']}: {exc}")
            return None
        topo = session.topology
        apply_framework_env(topo, gpus)
        self.record.update(rank=topo.rank, size=topo.size, local_rank=topo.local_rank, host=topo.host,
                           address=topo.address, interface=topo.interface, launcher=topo.launcher)
        if watchdog:
            from hpcring.diagnostics.watchdog import add_exit_hook  # deferred: pulls numpy (watchdog -> collectives)
            add_exit_hook(lambda headline: self.finish(1, headline))
        return session

    def watch_torch(self, *, child: bool = False) -> None:
        """A torch process group in the work gets hpcring's hang report. ``child``: the work is a
        child process started with this environment (its Python starts the watch from
        ``rank_site``, which also registers the backend when the watch is off)."""
        if not child:
            torch_watch.install()
            return
        os.environ.update(child_env())
        path = os.environ.get("PYTHONPATH", "")
        if SITE_DIR not in path.split(os.pathsep):
            os.environ["PYTHONPATH"] = SITE_DIR + (os.pathsep + path if path else "")

    def child_error_file(self) -> None:
        """Name to the child, in the environment, where its Python writes the exception that ends
        it (:func:`record_uncaught`); read by :meth:`child_error`. A folder that cannot be written
        only costs the record its error text."""
        path = self.folder / f"{self.job_id}_{self.record['rank']}_error.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
        except OSError:
            return
        os.environ[ERROR_FILE_VAR] = str(path)

    def child_error(self) -> str | None:
        """The child's exception (:func:`error_text`), or None (it exited, or is no Python of ours)."""
        path = Path(os.environ.get(ERROR_FILE_VAR, ""))
        try:
            text = path.read_text()
            path.unlink()
            return text or None
        except OSError:
            return None

    def finish(self, exit_code: int, error: str | None = None, **extra) -> None:
        """Record the rank's outcome (``extra``: e.g. ``preempted``)."""
        self.record.update(exit_code=exit_code, error=error, ended=time.time(), **extra)
        self.write()

    def write(self) -> None:
        write_record(self.folder, self.job_id, self.record)

    def say(self, text: str) -> None:
        """One message of hpcring's on this rank's stderr."""
        lines = f"hpcring: {text}".splitlines()
        if self.tag_output:
            lines = [f"[{self.record['rank']}]<stderr>:{ln}" for ln in lines]
        print("\n".join(lines), file=sys.stderr, flush=True)


ERROR_FILE_VAR = "HPCRING_RANK_ERROR_FILE"
SITE_DIR = str(Path(__file__).with_name("rank_site"))   # its sitecustomize.py: CMD's Python's rank hooks


def child_env(environ=None) -> dict[str, str]:
    """What ``hpcring run`` adds to CMD's environment for the torch watch: torch's variables
    (:func:`torch_watch.fr_env`) and :data:`SITE_DIR` first on PYTHONPATH; nothing when it is off."""
    env = os.environ if environ is None else environ
    if not torch_watch.enabled(env):
        return {}
    path = env.get("PYTHONPATH", "")
    return {**torch_watch.fr_env(env), "PYTHONPATH": SITE_DIR + (os.pathsep + path if path else "")}


def error_text(exc: BaseException) -> str:
    """A rank's ``error`` when its script raised ``exc``: ``ValueError: x``."""
    return f"{type(exc).__name__}: {exc}"


def bootstrap_failure(exc: BaseException, *, first_line: bool = False) -> dict:
    """The record fields of a rank whose ``hpcring.init()`` failed: the launcher's rank and host
    (the topology never formed), exit code 1, the error (its first line only when asked)."""
    from hpcring.bootstrap.launchers import detect  # deferred: launcher tables (~10 ms) off the CMD's start (rank_site)
    t = detect()
    error = str(exc).splitlines()[0] if first_line and str(exc) else str(exc)
    return {"rank": t.rank, "host": t.hosts[t.rank], "exit_code": 1, "error": error, "ended": time.time()}


def record_uncaught() -> None:
    """In ``hpcring run``'s CMD (its Python, from ``rank_site``): an exception that ends the
    program is written where the rank entry reads it, so both entries record the same error.
    The first writer wins: a Python that CMD starts in turn inherits the variable."""
    path = os.environ.get(ERROR_FILE_VAR)
    if not path:
        return
    previous = sys.excepthook

    def excepthook(kind, exc, tb):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(error_text(exc))
        except OSError:
            pass
        previous(kind, exc, tb)

    sys.excepthook = excepthook
