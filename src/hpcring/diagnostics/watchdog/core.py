"""The Watchdog: one per process, the state a failure's paths share, and what composes them: the
tree's path (:mod:`.tree_path`), the store's (:mod:`.store_fallback`), the ending
(:mod:`.ending`) and the dumps (:mod:`.dumps`); the protocol is the package's doc."""
from __future__ import annotations

import atexit
import os
import random
import threading
import time
from typing import Callable

from hpcring.collectives.recorder import main_thread_location
from hpcring.diagnostics.report import Report, diagnose
from hpcring.diagnostics.watchdog.dumps import DumpWriter
from hpcring.diagnostics.watchdog.ending import Ending
from hpcring.diagnostics.watchdog.listener import Listener
from hpcring.diagnostics.watchdog.settings import (ADDR, GRACE_STRETCH, JITTER_MAX_S, JITTER_RANKS, PUBLISH_TIMEOUT,
                                                   abort_default, grace_default, log)
from hpcring.diagnostics.watchdog.store_fallback import StoreFallback
from hpcring.diagnostics.watchdog.tree_path import TreePath
from hpcring.diagnostics.watchdog.tree_rounds import TreeRounds
from hpcring.errors import CollectiveError, HpcringError
from hpcring.bootstrap.store_client import StoreClient


class Watchdog(DumpWriter):
    """One per process: watches every communicator of the session (see the package doc)."""

    def __init__(self, topology, store_address: tuple[str, int], secret: bytes, *,
                 grace: float | None = None, abort: bool | None = None, store=None) -> None:
        self.topology = topology
        self.rank, self.size = topology.rank, topology.size
        self.host = topology.host
        self._address, self._secret = store_address, secret
        self.grace = grace_default() if grace is None else float(grace)
        self.abort = abort_default() if abort is None else bool(abort)
        self._comms: list = []
        self._lock = threading.Lock()
        self._handled = False
        self._done = threading.Event()
        self.report: Report | None = None
        self._client = None            # opened on a failure (trigger, snapshot, report), never idle before
        self._init_store = store       # the session's client: publishes our address once, at start
        self._listener: Listener | None = None
        self._lost: str | None = None
        self._closing = False
        # snapshots -> Report; torch_watch swaps in a diagnosis that also reads torch's errors
        self.diagnose: Callable[..., Report] = diagnose
        self.where: Callable[[], str] = main_thread_location     # the snapshot's "where"
        # when (time.monotonic()) this rank reached each step of a failure: triggered (by its own
        # collective), claimed (opened a store connection to claim the trigger), heard (the tree's
        # message), connected (store), published (its snapshot), report; read by
        # benchmarks/scale_sim.py to say which step a large job waits on
        self.timings: dict[str, float] = {}
        self._tree = TreeRounds(self.rank, self.size)    # this failure's tree (tree_rounds)
        self._heard = threading.Event()                  # placed in a failure's tree
        self._raised: dict | None = None                 # this rank's work raised: {error, where} (note_raised)
        self._tree_path = TreePath(self)                 # the tree's rounds, and the hand-over to a failing thread
        self._fallback = StoreFallback(self)             # the store's path (and the root's report)
        self._ending = Ending(self)                      # acting on the report

    # -- wiring ---------------------------------------------------------------------------
    def register(self, comm) -> None:
        """Watch ``comm`` (a Communicator: its ``recorder`` and ``error``)."""
        self._comms.append(comm)

    def start(self) -> "Watchdog":
        """Listen for triggers, publish where (before returning: a trigger right after start
        must find us), register the exit record; idempotent."""
        if self._listener is None:
            bind = getattr(self.topology, "address", None) or "0.0.0.0"
            self._listener = Listener(bind, self._secret, self._tree_path.on_message,
                                      self._tree_path.on_unsent).start()
            self._publish_address()
            atexit.register(self._on_exit)
        return self

    def wait_report(self, timeout: float) -> Report | None:
        """The failure's report once this rank holds it, or None after ``timeout`` s (parked on an
        event: thousands of rank threads polling would each want the GIL)."""
        self._done.wait(max(0.0, timeout))
        return self.report

    def close(self) -> None:
        """Stop listening and drop the store connection (the process keeps running: embedding
        callers, benchmarks); no exit record is written."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        if self._client is not None:
            self._client.close()
        try:
            atexit.unregister(self._on_exit)
        except Exception:  # noqa: BLE001
            pass

    def _advertised(self) -> str:
        addr = getattr(self.topology, "address", None)
        if addr and addr != "0.0.0.0":
            return addr
        hosts = set(getattr(self.topology, "hosts", ()) or ())
        if len(hosts) <= 1:
            return "127.0.0.1"
        import socket
        try:
            return socket.gethostbyname(self.host)
        except OSError:
            return "127.0.0.1"

    def _publish_address(self) -> None:
        key, value = f"{ADDR}{self.rank}", f"{self._advertised()}:{self._listener.port}".encode()
        try:
            if self._init_store is not None:
                self._init_store.set(key, value)
            else:
                with self._store(timeout=PUBLISH_TIMEOUT) as client:
                    client.set(key, value)
        except HpcringError as e:
            # Not fatal: a rank the tree cannot reach still triggers on its own deadline.
            log.warning("rank %d: watchdog could not publish its trigger listener: %s", self.rank, e)

    def _store(self, timeout: float):
        return StoreClient(self._address[0], int(self._address[1]), self._secret, timeout=timeout)

    def _action_client(self):
        with self._lock:
            if self._client is None:
                self._client = self._store(timeout=5.0)
            return self._client

    # -- state ----------------------------------------------------------------------------
    def snapshot(self, error: str | None = None) -> dict:
        """This rank's view: records of every communicator, the first backend error, the main
        thread's location (safe to call from any thread)."""
        records, last_done, err, by_group = [], 0, error, {}
        for comm in self._comms:
            rec = comm.recorder
            records += [r.to_dict() for r in rec.records(16)]
            done = rec.last_done()
            if rec.group is None:
                last_done = max(last_done, done)
            else:                     # a group's sequence numbers are its own (report.diagnose)
                by_group[rec.group[0]] = max(by_group.get(rec.group[0], 0), done)
            p2p = comm.__dict__.get("_p2p_log")    # point-to-point channels: numbered per channel
            if p2p is not None:
                records += [r.to_dict() for r in p2p.records(16)]
                for name, n in p2p.last_done().items():
                    by_group[name] = max(by_group.get(name, 0), n)
            err = err or getattr(comm, "error", None)
        snap = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "time": time.time(),
                "records": records, "last_done": last_done, "error": err,
                "where": self.where()}
        if by_group:
            snap["last_done_groups"] = by_group
        return snap

    def _claim(self) -> bool:
        with self._lock:
            if self._handled:
                return False
            self._handled = True
            return True

    # -- the failing thread -----------------------------------------------------------------
    def on_failure(self, comm, rec, error: BaseException) -> BaseException:
        """Called by the Communicator when a collective raised ``error``: trigger the job-wide
        diagnosis, wait for the report (bounded), and return the error to raise (with the
        report) -- or end the process when ``abort`` is on."""
        self.trigger(str(getattr(error, "message", error)), rec.to_dict())
        if self.report is None:
            return error
        text = self.report.text()
        return CollectiveError(f"{getattr(error, 'message', error)}\n{text}", hint=getattr(error, "hint", None))

    def trigger(self, error: str, op: dict | None = None) -> Report | None:
        """Start the job-wide diagnosis from this rank (any thread): ``error`` is what this rank
        saw, ``op`` the record of the collective it concerns (a Record's ``to_dict()``, or None).
        Waits (bounded) for the report; with ``abort`` on the process ends meanwhile. Returns
        the report, or None when none came. Used by collectives that do not go through a
        Communicator (torch's own process groups: :mod:`hpcring.diagnostics.torch_watch`)."""
        self.timings.setdefault("triggered", time.monotonic())
        trig = {"rank": self.rank, "host": self.host, "error": error, "op": op, "time": time.time()}
        end = time.monotonic() + GRACE_STRETCH * self.grace + 20.0
        tree = self._tree_path
        tree.host()                    # this thread takes the tree's work when it comes (TreePath.run)
        hosting = True
        try:
            if self.size > JITTER_RANKS and not self._heard.is_set():
                # Thousands of ranks time out in the same collective within milliseconds: the first
                # one's trigger reaches the rest down the tree in log8 n hops, so most need no store.
                self._heard.wait(random.uniform(0.0, JITTER_MAX_S * min(1.0, self.size / 4096)))
            if not self._heard.is_set() and self._fallback.trigger(trig):
                hosting = tree.unhost()
                self._fallback.handle_with_store(trig)    # in this (the failing) thread: no thread to start
            work = tree.next_work(end)
            if work is not None:
                hosting = tree.unhost()
                tree.handle(*work)
        except Exception:  # noqa: BLE001 - the caller's own error is raised, with or without a report
            log.exception("rank %d: watchdog failed while handling a failure", self.rank)
        finally:
            if hosting:
                tree.unhost()
        self._done.wait(max(0.0, end - time.monotonic()))
        if self.abort and self.report is not None:
            time.sleep(30.0)           # another thread is ending the process (os._exit)
        return self.report
