"""This process as a worker of an elastic job: join rounds, beat, hear aborts and newcomers.

A worker finds the coordinator's store in ``HPCRING_ELASTIC_STORE`` (``host:port``, set by the
elastic driver for the workers it starts; export it to workers started otherwise) and
authenticates with the job secret (``HPCRING_SECRET_FILE``). ``HPCRING_ELASTIC_ID`` names it
(the driver's ``w<n>``; else ``<host>:<pid>:<random>``).

One heartbeat thread (its own store connection) raises ``elastic/hb/<id>`` every HEARTBEAT_S, and
reads two keys on the way: ``elastic/abort`` (this worker's round is lost: the communicator of
that round is aborted, so a collective blocked on a dead or frozen peer returns at once instead of
at its deadline) and ``elastic/updated`` (newcomers wait: what ``check_host_updates`` reads).
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_wire import StoreTimeoutError
from hpcring.elastic import protocol as P
from hpcring.errors import BootstrapError, HpcringError
from hpcring.bootstrap.auth import load_secret

log = logging.getLogger("hpcring.elastic.member")
STORE_VAR, ID_VAR = "HPCRING_ELASTIC_STORE", "HPCRING_ELASTIC_ID"
WAIT_SLICE_S = 1.0


class ElasticJobError(HpcringError, RuntimeError):
    """The elastic job cannot go on (reset limit reached, fewer than min_np workers, this worker
    was counted dead): not recoverable by another reset, so ``hvd.elastic.run`` lets it through."""


@dataclass(frozen=True)
class Round:
    number: int
    rank: int
    members: tuple[str, ...]
    hosts: tuple[str, ...]
    resets: int
    updated: int             # the newest hosts-updated notification this round already answers
    sync: bool = True        # some member failed or is new: every rank syncs (no skip_sync)

    @property
    def size(self) -> int:
        return len(self.members)


def enabled(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return bool((env.get(STORE_VAR) or "").strip())


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BootstrapError(f"{STORE_VAR}={text!r} is not host:port",
                             hint="the elastic driver sets it; export its `store` line to workers you start")
    return host, int(port)


class Member:
    """This worker's link to the coordinator (one per process: :func:`current`)."""

    def __init__(self, address: str, secret: bytes, *, wid: str | None = None, host: str | None = None,
                 connect_timeout: float = 30.0) -> None:
        self.store_host, self.store_port = parse_address(address)
        self.secret = secret
        # the launcher's name for this node first (the driver names a node's step by it)
        self.host = (host or os.environ.get("HPCRING_HOSTNAME") or os.environ.get("SLURMD_NODENAME")
                     or socket.gethostname())
        self.wid = wid or f"{self.host}:{os.getpid()}:{secrets.token_hex(2)}"
        self.store = StoreClient(self.store_host, self.store_port, secret, timeout=connect_timeout)
        self._beat_store = StoreClient(self.store_host, self.store_port, secret, timeout=connect_timeout)
        self.round: Round | None = None
        self.updated = (0, 0)               # newest (timestamp, result) of elastic/updated
        self.listeners: Callable[[int, int], None] | None = None   # told of each new notification
        self._abort: tuple[int, Callable[[str], None]] | None = None   # (round, abort fn)
        self._aborted_round = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beats = 0
        self._thread = threading.Thread(target=self._beat_loop, name="hpcring-elastic-heartbeat", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """The address this worker's peers reach it at: the one its connection to the
        coordinator leaves from (HPCRING_ELASTIC_ADDR overrides)."""
        given = os.environ.get("HPCRING_ELASTIC_ADDR")
        if given:
            return given
        sock = self.store._sock
        try:
            return sock.getsockname()[0] if sock is not None else "127.0.0.1"
        except OSError:
            return "127.0.0.1"

    # -- rounds --------------------------------------------------------------------------------
    def join(self, reason: str = "start", timeout: float = P.DEFAULT_TIMEOUT_S) -> Round:
        """Ask for the next round and wait until one takes this worker; ElasticJobError when the
        coordinator says the job cannot go on, or no round came within ``timeout`` (+ a margin:
        the coordinator's own timeout answers first)."""
        deadline = time.monotonic() + timeout + 30.0
        n = self.store.add(P.NREQ, 1)
        after = self.round.number if self.round else 0
        self.store.set(P.req(n), P.dumps({"wid": self.wid, "host": self.host, "after": after, "reason": reason}))
        current = int(self.store.check(P.CURRENT) or b"0")
        k = max(after, current) + 1
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ElasticJobError(f"elastic worker {self.wid}: no round took it within {timeout:g} s "
                                      f"(waiting for round {k})",
                                      hint="the job may have as many workers as --max-np, or its coordinator is gone")
            try:
                rec = P.loads(self.store.get(P.round_key(k), timeout=min(WAIT_SLICE_S, left)))
            except StoreTimeoutError:
                why = self.store.check(P.expelled(self.wid))
                if why is not None:
                    raise ElasticJobError(f"elastic worker {self.wid} was counted dead by the coordinator "
                                          f"({why.decode()}) and may not rejoin") from None
                continue
            if "error" in rec:
                raise ElasticJobError(f"elastic job ended by its coordinator: {rec['error']}")
            if self.wid in rec["members"]:
                members = tuple(rec["members"])
                self.round = Round(k, members.index(self.wid), members, tuple(rec["hosts"]), int(rec["resets"]),
                                   int(rec.get("updated", 0)), bool(rec.get("sync", True)))
                return self.round
            k += 1

    def on_abort(self, round_no: int, fn: Callable[[str], None] | None) -> None:
        """Call ``fn(message)`` (once) when round ``round_no`` is declared lost."""
        with self._lock:
            self._abort = (round_no, fn) if fn is not None else None
        self._check_abort(self._aborted_round)

    def leave(self) -> None:
        """This worker ends normally: the coordinator stops waiting for it."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.set(P.left(self.wid), b"0")
        except HpcringError:
            pass
        self._thread.join(timeout=2.0)
        for c in (self.store, self._beat_store):
            c.close()

    # -- heartbeat thread ------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        failures = 0
        while not self._stop.wait(P.HEARTBEAT_S if self._beats else 0.0):
            try:
                self._beats += 1
                self._beat_store.add(P.hb(self.wid), 1)
                abort, updated = self._beat_store.multi_check([P.ABORT, P.UPDATED])
                failures = 0
            except HpcringError as e:
                failures += 1
                if failures in (1, 20):
                    log.warning("elastic worker %s: heartbeat failed: %s", self.wid, e)
                continue
            if updated is not None:
                u = P.loads(updated)
                stamp = (int(u["timestamp"]), int(u["result"]))
                if stamp[0] > self.updated[0]:
                    self.updated = stamp
                    if self.listeners is not None:
                        self.listeners(*stamp)
            if abort is not None:
                self._check_abort(int(abort))

    def _check_abort(self, lost: int) -> None:
        with self._lock:
            self._aborted_round = max(self._aborted_round, lost)
            target = self._abort
            if target is None or target[0] > self._aborted_round:
                return
            self._abort = None
        try:
            target[1](f"elastic round {target[0]} was lost (a member died or a collective failed): "
                      "aborted so that this rank resets now")
        except Exception as e:  # noqa: BLE001 - a closed communicator: nothing left to abort
            log.debug("abort of round %d: %s", target[0], e)


_MEMBER: Member | None = None
_MEMBER_LOCK = threading.Lock()


def current() -> Member:
    """This process's Member, created on first use from the environment."""
    global _MEMBER
    with _MEMBER_LOCK:
        if _MEMBER is None:
            _MEMBER = Member(os.environ[STORE_VAR], load_secret(), wid=os.environ.get(ID_VAR) or None)
            atexit.register(_MEMBER.leave)
        return _MEMBER
