"""StoreServerProcess: the store in a child process of its own, and that child's side."""
from __future__ import annotations

import atexit
import logging
import threading

from hpcring.bootstrap.store_server.server import StoreServer
from hpcring.errors import BootstrapError


class StoreServerProcess:
    """A :class:`StoreServer` in a child process of its own, so that rank 0's threads (the
    training loop holding the GIL) do not slow the store that every rank waits on: with one busy
    Python thread beside it, an in-process store took 4x as long to serve 4096 ranks
    (docs/scale.md). The same surface as StoreServer for its users (``port``, ``host``,
    ``address``, ``close()``, a context manager); ``stats`` and ``keys()`` stay with the child.

    Contract: raises ``OSError`` when the port is taken (as StoreServer does, so callers try the
    next) and BootstrapError when the descriptor limit is too low or the child does not start;
    the child serves until this object is closed or this process ends (its stdin reaches EOF, or
    it sees itself re-parented), so the store lives exactly as long as rank 0, as before. The
    secret travels over the child's stdin, never on a command line.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, secret: bytes, clients: int | None = None,
                 ranks: int | None = None, start_timeout: float = 30.0,
                 initial: dict[str, bytes] | None = None) -> None:
        import json
        import os
        import subprocess
        import sys
        from pathlib import Path

        if not secret:
            raise BootstrapError("StoreServer needs a non-empty per-job secret")
        root = str(Path(__file__).resolve().parents[3])   # the hpcring this process runs
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self._proc = subprocess.Popen([sys.executable, "-m", "hpcring.bootstrap.store_server"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        request = {"host": host, "port": port, "secret": bytes(secret).hex(), "clients": clients, "ranks": ranks,
                   "initial": {k: bytes(v).hex() for k, v in (initial or {}).items()}}
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            answer = self._read_answer(start_timeout)
        except BaseException:
            self._stop(0.0)
            raise
        if "port" not in answer:
            self._stop(2.0)
            if "errno" in answer:
                raise OSError(answer["errno"], answer["strerror"])
            raise BootstrapError(answer.get("error", f"the store process said {answer!r}"), hint=answer.get("hint"))
        self.host, self.port = host, int(answer["port"])
        self.stats: dict[str, int] = {}
        self._closed = False
        atexit.register(self.close)

    def _read_answer(self, timeout: float) -> dict:
        import json
        import select

        out = self._proc.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else b""
        if not line:
            raise BootstrapError(f"rank 0's store process did not start within {timeout:.0f}s "
                                 f"(exit code {self._proc.poll()})",
                                 hint="its stderr (in rank 0's log) says why; the store can also run in "
                                      "rank 0's own process: StoreServer")
        return json.loads(line)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (it closes every connection) and wait at most ``timeout`` for it."""
        atexit.unregister(self.close)
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        import subprocess
        try:
            self._proc.stdin.close()   # EOF: the child closes its server and exits
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()

    def __enter__(self) -> "StoreServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve_child() -> None:
    """``python -m hpcring.bootstrap.store_server``: the child of :class:`StoreServerProcess`."""
    import json
    import os
    import sys

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="hpcring store (rank 0's store process): %(message)s")
    parent = os.getppid()
    request = json.loads(sys.stdin.readline())

    def answer(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    try:
        srv = StoreServer(request["host"], request["port"], secret=bytes.fromhex(request["secret"]),
                          clients=request["clients"], ranks=request["ranks"],
                          initial={k: bytes.fromhex(v) for k, v in request.get("initial", {}).items()})
    except OSError as e:
        answer({"errno": e.errno, "strerror": e.strerror})
        return
    except BootstrapError as e:
        answer({"error": e.message, "hint": e.hint})
        return
    answer({"port": srv.port})
    eof = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), eof.set()), daemon=True).start()
    while not eof.wait(1.0) and os.getppid() == parent:
        pass
    srv.close()

