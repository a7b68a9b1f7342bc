"""The elastic driver: the store and the coordinator of an elastic job, and (locally) its workers.

    python -m hpcring.elastic.driver --np 3 --min-np 2 --max-np 4 [--reset-limit R] -- CMD...
    python -m hpcring.elastic.driver --serve --np 3 --min-np 2 --max-np 4 --info FILE

Horovod's ``horovodrun --min-np/--max-np`` on hpcring. The driver serves the rendezvous store
(authenticated with the job secret: ``HPCRING_SECRET_FILE`` if set, else a fresh one in a private
folder) and runs the coordinator (:mod:`hpcring.elastic.coordinator`). Without ``--serve`` it starts
``--np`` workers on this machine, each CMD with ``HPCRING_ELASTIC_STORE``, ``HPCRING_ELASTIC_ID``
(``w0``, ``w1``, ...) and the secret in its environment, tags their output ``[w0]<stdout>:``, and
tells the coordinator at once when one exits. More workers may join at any time: any process with
the variables of ``--info FILE`` (``env``) that calls ``hvd.init()`` asks to join; the running
workers reset at their next commit and the newcomer receives the committed state.

``--serve`` starts no worker: the job script starts them (``srun``), e.g. on the nodes of
``submit --spare-nodes``; see docs/from-horovod.md. ``hpcring run --elastic`` inside an allocation
gives the driver :class:`Nodes`: one launcher step per node (its workers), and when a node's step
fails, a step on the next spare node of the allocation, whose workers join the running job.
The driver ends once a round has run and no worker is left, or the coordinator gave up. Exit
code: 0 when every member of the last round ended with 0 (workers lost on the way do not fail the
job, as with Horovod), else the first
failing member's code; 1 when the coordinator gave up (the reason is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.elastic.coordinator import Coordinator, same_host
from hpcring.elastic.membership import ALIVE, DEAD, LEFT
from hpcring.elastic.member import ID_VAR, STORE_VAR
from hpcring.config import envvars
from hpcring.schedulers.supervisor import start

POLL_S = 0.05
KILL_AFTER_S = 3.0


def _pump(src, dst, prefix: bytes) -> None:
    for line in iter(src.readline, b""):
        dst.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
        dst.flush()


def _say(text: str) -> None:
    print(f"hpcring: {text}", file=sys.stderr, flush=True)


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


@dataclass
class Nodes:
    """Workers as launcher steps, one per node: ``hosts`` in the allocation's order, the first
    ``use`` started at once, the others spares taken in order when a node's step fails;
    ``argv(host)`` the launcher's words for one node's step (its workers)."""
    hosts: list[str]
    use: int
    argv: Callable[[str], list[str]]
    started: list[str] = field(default_factory=list)

    def next_spare(self) -> str | None:
        return next((h for h in self.hosts if h not in self.started), None)


class Driver:
    def __init__(self, args, nodes: Nodes | None = None, environ: dict | None = None) -> None:
        self.args = args
        self.nodes = nodes
        self.run_dir: Path | None = None
        environ = dict(os.environ if environ is None else environ)
        secret_file = environ.get("HPCRING_SECRET_FILE")
        if not secret_file and not environ.get("HPCRING_SECRET"):
            self.run_dir = Path(tempfile.mkdtemp(prefix="hpcring-elastic-"))
            secret_file = str(auth.write_secret_file(self.run_dir / "secret.key", exclusive=True))
        env = environ
        if secret_file:
            env["HPCRING_SECRET_FILE"] = secret_file
        secret = auth.load_secret(env)
        self.server = StoreServer(args.bind, args.port, secret=secret, clients=4 * args.max_np + 16)
        self.address = args.address or ("127.0.0.1" if not args.serve else _host_address())
        store = f"{self.address}:{self.server.port}"
        self.worker_env = {STORE_VAR: store, "HPCRING_JOB_ID": env.get("HPCRING_JOB_ID") or
                           f"elastic{os.getpid()}"}
        if secret_file:
            self.worker_env["HPCRING_SECRET_FILE"] = secret_file
        self.env = {**env, **self.worker_env}
        self.client = StoreClient("127.0.0.1", self.server.port, secret, timeout=30.0)
        self.coord = Coordinator(self.client, start_np=args.np, min_np=args.min_np, max_np=args.max_np,
                                 reset_limit=args.reset_limit, timeout_s=args.timeout, dead_after_s=args.dead_after,
                                 say=_say)
        self.children: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self._ending: dict[str, float] = {}        # children being ended (counted dead), since when
        self._stop: str | None = None

    def write_info(self) -> None:
        if self.args.info:
            info = {"store": self.worker_env[STORE_VAR], "env": self.worker_env, "pid": os.getpid()}
            tmp = Path(self.args.info + ".tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, self.args.info)

    def _start(self, label: str, argv: list[str], env: dict) -> None:
        """A child named ``label``, its output tagged with it."""
        p = start(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.children[label] = p
        for src, dst, kind in ((p.stdout, sys.stdout.buffer, "stdout"), (p.stderr, sys.stderr.buffer, "stderr")):
            threading.Thread(target=_pump, args=(src, dst, f"[{label}]<{kind}>:".encode()), daemon=True).start()

    def spawn(self, i: int) -> None:
        """Local worker ``w<i>``."""
        self._start(f"w{i}", list(self.args.command), {**self.env, ID_VAR: f"w{i}"})

    def spawn_step(self, host: str) -> None:
        """The workers of ``host``: one launcher step."""
        self.nodes.started.append(host)
        self._start(host, self.nodes.argv(host), self.env)

    def run(self) -> int:
        self.coord.start()
        self.write_info()
        if self.args.serve:
            print(f"{STORE_VAR}={self.worker_env[STORE_VAR]}", flush=True)
        elif self.nodes is not None:
            for host in self.nodes.hosts[:self.nodes.use]:
                self.spawn_step(host)
        else:
            for i in range(self.args.np):
                self.spawn(i)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: setattr(self, "_stop", signal.Signals(s).name))
        try:
            return self._wait()
        finally:
            self._end_children()
            self.coord.stop()
            self.server.close()
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)

    def _ended(self, label: str, code: int) -> None:
        """A child ended: a worker (``w3``) or a node's step (its host)."""
        self.codes[label] = code
        if self.nodes is None:
            self.coord.report(label, LEFT if code == 0 else DEAD, "" if code == 0 else _exit_text(code))
            return
        self.coord.report_host(label, LEFT if code == 0 else DEAD, "" if code == 0 else f"its node's step {_exit_text(code)}")
        snap = self.coord.snapshot()
        if code == 0 or snap["error"]:
            return
        spare = self.nodes.next_spare()
        if spare is None:
            _say(f"elastic: {label}'s step {_exit_text(code)}; no spare node left: going on with the others "
                 f"(at least --min-np {self.args.min_np} workers)")
            return
        _say(f"elastic: {label}'s step {_exit_text(code)}: starting its workers on spare node {spare}")
        self.spawn_step(spare)

    def _end_the_dead(self, snap: dict) -> None:
        """A child whose workers the coordinator counts dead (a frozen process: no heartbeat) but
        that still runs is ended (SIGKILL; a node's step: SIGTERM, then SIGKILL after
        KILL_AFTER_S): its slot then goes to a spare, and the job can end."""
        now = time.monotonic()
        for label, p in self.children.items():
            if label in self.codes or p.poll() is not None:
                continue
            if self.nodes is None:
                dead = snap["status"].get(label) == DEAD
            else:
                mine = [w for w, h in snap["hosts"].items() if same_host(h, label)]
                dead = bool(mine) and all(snap["status"][w] == DEAD for w in mine)
            if not dead:
                continue
            since = self._ending.setdefault(label, now)
            if since == now:
                _say(f"elastic: ending {label}: counted dead by the coordinator but still running (frozen?)")
                p.send_signal(signal.SIGCONT)
                p.kill() if self.nodes is None else p.terminate()
            elif now - since > KILL_AFTER_S:
                p.kill()

    def _wait(self) -> int:
        while True:
            for label, p in list(self.children.items()):
                if label not in self.codes and p.poll() is not None:
                    self._ended(label, p.returncode)
            snap = self.coord.snapshot()
            self._end_the_dead(snap)
            if self._stop:
                _say(f"elastic: {self._stop}: stopping every worker")
                return 128 + getattr(signal, self._stop)
            running = [w for w, p in self.children.items() if w not in self.codes]
            alive = [w for w, s in snap["status"].items() if s == ALIVE and w not in self.codes]
            if not running and not alive and (snap["round"] > 0 or snap["error"] or not self.args.serve):
                time.sleep(2 * POLL_S)          # the coordinator's last reports
                return self._verdict(self.coord.snapshot())
            time.sleep(POLL_S)

    def _verdict(self, snap: dict) -> int:
        if snap["error"]:
            return 1
        last = snap["members"]
        if self.nodes is not None:      # children are steps: the last round's by their hosts
            last = [h for h in self.children if any(same_host(snap["hosts"].get(m, ""), h) for m in snap["members"])]
        failed = [(w, self.codes[w]) for w in last if self.codes.get(w, 0) != 0]
        lost = [w for w, c in self.codes.items() if c != 0 and w not in last]
        if lost:
            _say(f"elastic: training went on without {', '.join(lost)} "
                 f"({'; '.join(f'{w} {_exit_text(self.codes[w])}' for w in lost)})")
        if failed:
            w, code = failed[0]
            what = f"the step of node {w}" if self.nodes is not None else f"worker {w}"
            _say(f"elastic: {what} of the last round {_exit_text(code)}")
            return code if code > 0 else 128 - code
        return 0

    def _end_children(self) -> None:
        live = [p for p in self.children.values() if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        t0 = time.monotonic()
        while any(p.poll() is None for p in live) and time.monotonic() - t0 < KILL_AFTER_S:
            time.sleep(POLL_S)
        for p in live:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hpcring.elastic.driver",
                                 description="Serve an elastic job's rendezvous and (locally) start its workers.")
    ap.add_argument("--np", type=int, required=True, help="workers the first round waits for (and starts locally)")
    ap.add_argument("--min-np", type=int, default=None, help="fewest workers to go on with (default: --np)")
    ap.add_argument("--max-np", type=int, default=None, help="most workers in a round (default: --np)")
    ap.add_argument("--reset-limit", type=int, default=None, help="resets allowed before the job fails")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a round may wait for enough workers (default HPCRING_ELASTIC_TIMEOUT, 600)")
    ap.add_argument("--dead-after", type=float, default=None,
                    help="seconds without a heartbeat before a worker counts as dead "
                         "(default HPCRING_ELASTIC_DEAD_AFTER, 6)")
    ap.add_argument("--serve", action="store_true", help="start no workers: serve the rendezvous only")
    ap.add_argument("--bind", default="0.0.0.0", help="where the store listens (default all interfaces)")
    ap.add_argument("--port", type=int, default=0, help="the store's port (default: any free one)")
    ap.add_argument("--address", default=None, help="the store's address as workers reach it")
    ap.add_argument("--info", default=None, help="write the workers' variables here (JSON) once serving")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    a.command = a.command[1:] if a.command[:1] == ["--"] else a.command
    a.min_np = a.np if a.min_np is None else a.min_np
    a.max_np = a.np if a.max_np is None else a.max_np
    if a.timeout is None:
        a.timeout = envvars.get("HPCRING_ELASTIC_TIMEOUT")
    if a.dead_after is None:
        a.dead_after = envvars.get("HPCRING_ELASTIC_DEAD_AFTER")
    if not 1 <= a.min_np <= a.np <= a.max_np:
        ap.error(f"need 1 <= --min-np ({a.min_np}) <= --np ({a.np}) <= --max-np ({a.max_np})")
    if a.reset_limit is not None and a.reset_limit < 0:
        ap.error("--reset-limit must be >= 0")
    if not a.serve and not a.command:
        ap.error("give the command after --, or --serve")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    return Driver(args).run()


if __name__ == "__main__":
    sys.exit(main())
