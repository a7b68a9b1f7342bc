"""Hang watchdog: a failed or overdue collective becomes one report, then every rank exits.

Every backend already enforces the per-collective deadline (the ring in C, MPI and NCCL by
polling) and raises :class:`~hpcring.errors.CollectiveError` on expiry or on a peer error. What
the backends cannot do alone is say *why*: the rank that timed out only knows which peer was
silent. The watchdog adds the job-wide view, over a side channel that does not share the stuck
data path: the rendezvous store (rank 0's authenticated TCP store, separate connections).

Protocol (keys under ``diag/``):

1. At start every rank listens on a port of its own (:mod:`hpcring.diagnostics.fanout`) and
   publishes it once as ``diag/addr/<rank>``; it keeps no connection to the store open for that.
2. The failing rank (its collective raised) first waits a moment (jittered, only in jobs above
   :data:`JITTER_RANKS`) for a trigger that may already be on its way: when thousands of ranks
   time out in the same collective, one store connection is needed, not thousands. Then it
   claims the trigger on the store connection init left open (one bounded request); the first
   such rank (``diag/ntrigger``) opens a connection of its own, claims ``diag/reporter``,
   sets ``diag/trigger``, reads every rank's address in one batched read and sends the trigger
   down a radix-8 tree rooted at itself: every rank hears it within about log8 n hops, from a
   thread that runs while the main thread is stuck in C, in a collective or in user code; a
   parent that cannot reach a child (dead, frozen) serves the child's subtree itself. Other
   failing ranks wait to hear it like the rest (:func:`fanout.step` per level), and
   fall back on the store (step 3's older path) when they do not.
3. On the trigger each rank forwards it to its children, writes its stacks and flight records
   to ``<job folder>/diag/`` and sends its snapshot (newest records, records in flight, backend
   error, main thread's place) **up the same tree**, merged with its children's subtrees
   (:mod:`hpcring.diagnostics.tree_rounds`: each level waits a share of the grace); a leaf
   answers the trigger's delivery with its snapshot. A rank whose own collective failed does
   this in its failing thread (it waits in :meth:`Watchdog.trigger` anyway); another rank starts
   a thread for it. A rank
   whose parent cannot be reached, or that the tree did not reach, publishes ``diag/snap/<rank>``
   through the store instead. Ranks that already exited normally left ``diag/exit/<rank>``.
4. The root (the reporter) waits up to the grace period (``HPCRING_DIAG_GRACE``, default 5 s;
   up to 3x while snapshots still arrive) for all snapshots, reads the ones still missing from
   the store in two batched reads, runs :func:`hpcring.diagnostics.report.diagnose`, prints the
   report, saves ``diag/hang-report.{json,txt}``, publishes ``diag/report`` (rank lists as
   ranges, no host list: ~1 KiB at 4096 ranks; for the store's readers) and sends it down the
   tree.
5. Every rank prints one line naming the cause, writes its status and acknowledges: up the
   tree (the root then sends ``exit`` down it), or through the store (``diag/nack``; the last
   sets ``diag/acked``) on the fallback path; it waits (bounded) for the others and exits
   with :data:`EXIT_CODE` (``os._exit``: the
   collective may still own the buffers, and a hung main thread cannot be unwound). The
   reporting rank (and a rank cut off from the side channel) then asks the scheduler to end the
   job (:mod:`hpcring.diagnostics.teardown`), so that frozen ranks die too and the allocation is
   released; the report and stacks are on disk before that.
   ``HPCRING_ON_FAILURE=raise`` keeps processes alive and raises the CollectiveError (with the
   report) in the failing thread instead.

When the store cannot be reached (rank 0 died, or this host is cut off) a rank prints its own
view (``side_channel: false``) and exits: the report is then partial, never missing.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Callable

from hpcring.diagnostics import fanout, fr_trace, jobdir, rank_summary, teardown
from hpcring.diagnostics.tree_rounds import TreeRounds, gather_budget
from hpcring.collectives.recorder import main_thread_location
from hpcring.diagnostics.report import Report, diagnose, from_wire as _from_wire, parse_link, to_wire as _to_wire
from hpcring.bootstrap.store_client import ClientBusy
from hpcring.errors import CollectiveError, HpcringError
from hpcring.ranks import rank_ranges

EXIT_CODE = 1
GRACE_ENV, ON_FAILURE_ENV = "HPCRING_DIAG_GRACE", "HPCRING_ON_FAILURE"
TRIGGER, REPORT, ADDR = "diag/trigger", "diag/report", "diag/addr/"
GRACE_STRETCH = 3            # the reporter waits at most this many graces while snapshots still arrive
PUBLISH_TIMEOUT = 5.0        # how long start() may wait for the store to publish our address
JITTER_RANKS = 256           # above this many ranks a failing rank waits up to JITTER_MAX_S for a trigger ...
JITTER_MAX_S = 1.0           # ... (scaled by n / 4096) before it opens a store connection of its own
CLAIM_TIMEOUT = 5.0          # a claim of the trigger on the session's connection (as a new one's connect)
ACK_TIMEOUT = 5.0            # abort mode: how long a rank waits for its subtree's acknowledgements
GROUP_SPAN = 64              # a rank heading a subtree of this many publishes it to the store itself

EXIT_DUMP_S = 5.0            # a rank ending on an exception waits at most this long for its dumps
log = logging.getLogger("hpcring.diagnostics.watchdog")
_EXIT_HOOKS: list[Callable[[str], None]] = []


def add_exit_hook(fn: Callable[[str], None]) -> None:
    """Call ``fn(headline)`` just before the watchdog ends this process (e.g. to write the
    rank's status file); hooks must be quick and must not raise."""
    _EXIT_HOOKS.append(fn)


def grace_default() -> float:
    try:
        return max(0.5, float(os.environ.get(GRACE_ENV, "5")))
    except ValueError:
        return 5.0


def abort_default() -> bool:
    return os.environ.get(ON_FAILURE_ENV, "abort").strip().lower() != "raise"


class Watchdog:
    """One per process: watches every communicator of the session (see the module doc)."""

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
        self._forwarded = False
        self._forwarder: threading.Thread | None = None
        self._fwd_done = threading.Event()             # the trigger's forwarding is over (children known)
        self._done = threading.Event()
        self.report: Report | None = None
        self._client = None            # opened on a failure (trigger, snapshot, report), never idle before
        self._init_store = store       # the session's client: publishes our address once, at start
        self._listener: fanout.Listener | None = None
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
        self._work = threading.Condition()               # the tree's trigger handed to a waiting thread:
        self._hosts = 0                                  # ... threads waiting in trigger() for it
        self._pending: tuple | None = None               # ... and _handle_tree's arguments, not yet taken
        self._replied: dict | None = None                # a leaf's snapshot, sent back with the trigger's answer
        self._raised: dict | None = None                 # this rank's work raised: {error, where} (note_raised)
        self._via_tree = False                           # ... and handling it there (not the store's way)

    # -- wiring ---------------------------------------------------------------------------
    def register(self, comm) -> None:
        """Watch ``comm`` (a Communicator: its ``recorder`` and ``error``)."""
        self._comms.append(comm)

    def start(self) -> "Watchdog":
        """Listen for triggers, publish where (before returning: a trigger right after start
        must find us), register the exit record; idempotent."""
        if self._listener is None:
            bind = getattr(self.topology, "address", None) or "0.0.0.0"
            self._listener = fanout.Listener(bind, self._secret, self._on_message, self._on_unsent).start()
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
        from hpcring.bootstrap.store_client import StoreClient
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

    def dump(self, reason: str) -> str | None:
        """Flight records (hpcring's JSON and, unless HPCRING_FR_TRACE=0, torch's Flight Recorder
        format in ``fr-trace/``: :mod:`hpcring.diagnostics.fr_trace`) and all threads' stacks to
        ``<job folder>/diag``; returns the folder (None when it cannot be written: diagnostics
        never fail the job twice)."""
        try:
            folder = jobdir.diag_dir()
            for i, comm in enumerate(self._comms):
                suffix = "" if i == 0 else f"-comm{i}"
                comm.recorder.dump(folder / f"flight-rank{self.rank}{suffix}.json", {"reason": reason})
            self._dump_fr_trace(folder, reason)
            self.write_summary(folder, f"dump: {reason}")
            with open(folder / f"stacks-rank{self.rank}.txt", "w") as f:
                f.write(f"# rank {self.rank} ({self.host}) pid {os.getpid()}: {reason}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            return str(folder)
        except OSError as e:
            print(f"hpcring: rank {self.rank}: could not write diagnostics: {e}", file=sys.stderr)
            return None

    def write_summary(self, folder, why: str) -> None:
        """This rank's time summary (:mod:`hpcring.diagnostics.rank_summary`: fixed size, for
        ``hpcring report``) into ``folder``; a failure is one line, never the rank's end."""
        try:
            rank_summary.write(folder, self.rank, self.size, self.host, self._comms, why)
        except Exception as e:  # noqa: BLE001 - a summary must not fail a rank that is ending anyway
            print(f"hpcring: rank {self.rank}: could not write its time summary: {e}", file=sys.stderr)

    def _exit_summary(self) -> None:
        """At exit: the summary into the job folder's ``diag/``, for a submitted job only (submitit
        set SUBMITIT_FOLDER: its folder is the job's and stays); ``hpcring run``, ``hpcring bench``
        and ranks started by hand keep a folder only for a report, so a clean run leaves nothing."""
        if os.environ.get("SUBMITIT_FOLDER"):
            raised = self._raised
            why = "exit" if raised is None else f"exit: raised {raised['error']}"
            self.write_summary(jobdir.job_folder() / "diag", why)

    def _dump_fr_trace(self, folder, reason: str) -> None:
        if not self._comms or not fr_trace.enabled():
            return
        try:
            fr_trace.write(folder / fr_trace.FOLDER, self.rank, self._comms, host=self.host, reason=reason)
        except Exception as e:  # noqa: BLE001 - the JSON records are written; this copy must not stop the rest
            print(f"hpcring: rank {self.rank}: could not write the Flight Recorder dump: {e}", file=sys.stderr)

    # -- a rank whose work raised -------------------------------------------------------------
    def note_raised(self, exc: BaseException | None = None, error: str | None = None, where: str | None = None) -> None:
        """This rank's work raised ``exc`` (or failed with ``error``, raised ``where``) and the
        rank is about to end: write its flight records and stacks now (bounded: at most
        :data:`EXIT_DUMP_S`), before anything tears the job down, and keep the error for the exit
        record (:meth:`_on_exit`), so a hang report of the ranks left behind names this rank and
        what it raised. Once per process; nothing when this rank's own failure is being handled."""
        with self._lock:
            if self._handled or self._raised is not None:
                return
            if exc is not None:
                error, where = _raised_text(exc)
            self._raised = {"error": error or "?", "where": where}
        self._bounded(lambda: self.dump(f"rank {self.rank} raised {self._raised['error']}"), EXIT_DUMP_S)

    @staticmethod
    def _bounded(fn, seconds: float) -> None:
        """``fn()`` in a daemon thread, waited for at most ``seconds`` (a hung file system must not
        keep an ending rank alive); inline where no thread can start (interpreter shutdown)."""
        try:
            t = threading.Thread(target=fn, name="hpcring-exit-dump", daemon=True)
            t.start()
        except RuntimeError:
            fn()
            return
        t.join(seconds)

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
        with self._work:
            self._hosts += 1           # this thread takes the tree's work when it comes (_run_tree)
        hosting = True
        try:
            if self.size > JITTER_RANKS and not self._heard.is_set():
                # Thousands of ranks time out in the same collective within milliseconds: the first
                # one's trigger reaches the rest down the tree in log8 n hops, so most need no store.
                self._heard.wait(random.uniform(0.0, JITTER_MAX_S * min(1.0, self.size / 4096)))
            if not self._heard.is_set() and self._trigger_with_store(trig):
                hosting = self._unhost()
                self._handle_with_store(trig)    # in this (the failing) thread: no thread to start
            work = self._next_work(end)
            if work is not None:
                hosting = self._unhost()
                self._handle_tree(*work)
        except Exception:  # noqa: BLE001 - the caller's own error is raised, with or without a report
            log.exception("rank %d: watchdog failed while handling a failure", self.rank)
        finally:
            if hosting:
                self._unhost()
        self._done.wait(max(0.0, end - time.monotonic()))
        if self.abort and self.report is not None:
            time.sleep(30.0)           # another thread is ending the process (os._exit)
        return self.report

    def _run_tree(self, trig: dict, fwd: tuple | None = None, replied: bool = False) -> None:
        """Handle the tree's trigger: in a thread already waiting in :meth:`trigger` (a rank whose
        own collective failed, most of them) when there is one, else in a thread of its own (a
        rank in user code, or in C). On a node running many ranks a thread start per rank and
        failure is what costs (docs/scale.md). ``replied``: our snapshot went back with the
        trigger's acknowledgement (a leaf)."""
        with self._work:
            if self._hosts:
                self._pending = (trig, fwd, replied)
                self._work.notify_all()
                return
        threading.Thread(target=self._handle_tree, args=(trig, fwd, replied), name=f"hpcring-watchdog-tree:{self.rank}",
                         daemon=True).start()

    def _next_work(self, end: float) -> tuple | None:
        """Wait (until ``end``) for the tree's trigger handed to this thread, or the report."""
        with self._work:
            while self._pending is None and not self._done.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._work.wait(left)
            work, self._pending = self._pending, None
            return work

    def _unhost(self) -> bool:
        """This thread stops taking the tree's work; work handed to it meanwhile gets a thread."""
        with self._work:
            self._hosts -= 1
            work = None if self._hosts else self._pending
            if work is not None:
                self._pending = None
        if work is not None:
            threading.Thread(target=self._handle_tree, args=work, name=f"hpcring-watchdog-tree:{self.rank}",
                             daemon=True).start()
        return False

    def _trigger_with_store(self, trig: dict) -> bool:
        """Claim the trigger at the store (a connection of our own): the first rank becomes the
        root and sends it down the tree. True when this rank is to handle the failure the
        store's way (the root, a rank the tree did not reach, one cut off from the store)."""
        addrs = None
        self.timings.setdefault("claimed", time.monotonic())
        try:
            if self._claim_trigger():
                client = self._action_client()     # the root's own connection, for its rounds
                client.add("diag/reporter", 1)     # the root reports: no fallback rank may claim it
                client.set("diag/reporter-rank", str(self.rank).encode())
                from hpcring.schedulers import run_ending
                ending = run_ending(os.environ)    # one query, from the rank that saw the failure first
                if ending:
                    trig["ending"] = ending
                client.set(TRIGGER, json.dumps(trig).encode())
                addrs = self._addresses(client)
            else:
                # Another rank was first: its trigger reaches us down its tree; if not (our
                # address unknown to it, a lost branch), the store's path, with its trigger.
                if self._heard.wait(min(self.grace, fanout.step() * (fanout.depth(self.size) + 2))):
                    return False
                client = self._action_client()
                try:
                    trig = json.loads(client.get(TRIGGER, timeout=5.0))
                except (HpcringError, ValueError):
                    pass                   # our own trigger, then: the report says what it can
        except HpcringError as e:
            self._lost = f"rank 0's store at {self._address[0]}:{self._address[1]}: {e}"
        if self._lost is not None and self._client is None:
            return True                  # our own view (the store's path, without a client)
        if addrs is not None and self._tree.place(self.rank, 0, None, addrs):
            self._heard.set()
            self._forward(self.rank, 0, addrs, trig)
        return True

    def _claim_trigger(self) -> bool:
        """Whether this rank is the first to claim the trigger (``diag/ntrigger``). Through the
        session's store connection when another thread does not hold it for :data:`CLAIM_TIMEOUT`
        (thousands of ranks claim within a second: a connection and handshake each at the store
        was most of that), else through a connection of our own; either fails within
        :data:`CLAIM_TIMEOUT` when the store cannot be reached."""
        if self._init_store is not None:
            try:
                return self._init_store.add("diag/ntrigger", 1, timeout=CLAIM_TIMEOUT) == 1
            except ClientBusy:
                pass
        return self._action_client().add("diag/ntrigger", 1) == 1

    def _addresses(self, client) -> list:
        """Every rank's listener (one batched read), rotated so index 0 is this rank (the root)."""
        values = client.multi_check([f"{ADDR}{r}" for r in range(self.size)])
        return [None if values[(self.rank + i) % self.size] is None
                else values[(self.rank + i) % self.size].decode() for i in range(self.size)]

    # -- every rank -----------------------------------------------------------------------
    def _on_message(self, msg: dict) -> bytes | None:
        """A message of the failure's tree (listener thread): the trigger from our parent (pass it
        on, handle it), a subtree's snapshots, the report, an acknowledgement, the exit. Returns
        the reply that goes back with the acknowledgement: a leaf's snapshot, for the trigger."""
        if self._closing:
            return None
        kind = msg.get("kind", "trigger")
        if kind == "gather":
            self._on_gather(msg)
        elif kind == "report":
            if self._tree.on_report(msg):    # else the thread waiting for it passes it on (_finish)
                self._down(fanout.pack(msg))
        elif kind == "ack":
            self._tree.on_ack(msg)
        elif kind == "exit":
            if msg.get("root") == self._tree.root and not self._tree.exit.is_set():
                self._tree.exit.set()
        elif kind == "trigger":
            try:
                root, n, v, addrs, trig = (int(msg["root"]), int(msg["n"]), int(msg["v"]), list(msg["addrs"]),
                                           dict(msg["trig"]))
                up = msg.get("up")
            except (KeyError, TypeError, ValueError):
                return None
            if n != self.size or (root + v) % n != self.rank or not (up is None or isinstance(up, str)):
                return None                # not meant for this rank (another job's size, a stale tree)
            self.timings.setdefault("heard", time.monotonic())
            if not self._tree.place(root, v, up, addrs):
                return None                # a second tree (a rank that lost the store raced): ours stands
            self._heard.set()
            reply = None
            if not fanout.children(v, n) and not trig.get("ending") and self._claim():
                # A leaf (7 ranks in 8) has nothing to wait for: its snapshot goes back with the
                # acknowledgement, not on a connection of its own (a third of a failure's
                # connections, and a wake-up of this rank's thread, at any size).
                self._via_tree = True
                self._replied = self.snapshot()    # kept: our own view, should the report not come
                snaps, stored, lost = self._tree.take_up(self._replied)
                reply = fanout.pack(self._tree.envelope("gather", snaps=snaps, stored=rank_ranges(stored),
                                                        lost=rank_ranges(lost)))
                self.timings.setdefault("published", time.monotonic())
            self._run_tree(trig, (root, v, addrs, trig), replied=reply is not None)
            return reply
        return None

    def _on_gather(self, msg: dict) -> None:
        """A subtree's snapshots (a child's message, or a leaf's reply to our trigger)."""
        late = self._tree.on_gather(msg)
        if late is not None:          # we already sent ours up: pass this subtree on alone
            threading.Thread(target=self._send_up, args=late, daemon=True,
                             name=f"hpcring-watchdog-up:{self.rank}").start()

    def _on_unsent(self, msg: dict) -> None:
        """Our reply to the trigger (our snapshot) did not reach the parent: the store's way."""
        if msg.get("kind", "trigger") != "trigger" or not self._via_tree:
            return
        snaps = {self.rank: self.snapshot()}
        threading.Thread(target=self._send_up, args=(snaps, set(), set()), kwargs={"store": True}, daemon=True,
                         name=f"hpcring-watchdog-up:{self.rank}").start()

    def _on_reply(self, c: int, reply: bytes) -> None:
        try:
            self._on_gather(fanout.unpack(reply))
        except ValueError as e:
            log.info("rank %d: watchdog: a reply from relative rank %d dropped: %s", self.rank, c, e)

    def _forward(self, root: int, v: int, addrs: list, trig: dict, background: bool = True) -> None:
        """Pass the trigger on (once), in the background or (``background`` False: the thread
        handling the tree's rounds) before returning. Its children are known after."""
        with self._lock:
            if self._forwarded:
                return
            self._forwarded = True
        if not fanout.children(v, self.size):
            self._tree.set_kids([])      # a leaf (7 ranks in 8): nobody to send to
            self._fwd_done.set()
            return

        def run() -> None:
            delivered: list = []
            lost: list = []
            try:
                lost = fanout.forward(root, self.size, v, addrs, trig, self._secret, delivered=delivered,
                                      on_reply=self._on_reply)
            finally:
                late = self._tree.set_kids(delivered, [(root + c) % self.size for c in lost])
                self._fwd_done.set()
            if late:                     # our subtree went up before the forwarding ended
                self._send_up({}, set(), late)
        if not background:
            run()
            return
        self._forwarder = threading.Thread(target=run, name=f"hpcring-watchdog-forward:{self.rank}", daemon=True)
        self._forwarder.start()

    def _down(self, body: bytes, wait: float = 0.0, inline: bool = False) -> None:
        """Send a later round (report, exit) to our children in the tree, in the background (or,
        ``inline``, in this thread), covering the subtree of one that stopped since; the
        forwarding of the trigger must be over (bounded wait) to know them. ``wait``: how long
        to wait for the background sends (0: not)."""
        def run() -> None:
            self._fwd_done.wait(fanout.step() * (fanout.depth(self.size) + 2))
            t = self._tree
            # every child, not only those the trigger's delivery confirmed: a child whose
            # acknowledgement timed out under load did get the trigger and waits for this
            fanout.relay(self.size, t.v, t.addrs, fanout.children(t.v, self.size), body, self._secret)
        if not (self._tree.placed and fanout.children(self._tree.v, self.size)):
            return                       # a leaf has nobody to send to: no thread
        if inline:
            run()
            return
        t = threading.Thread(target=run, name=f"hpcring-watchdog-down:{self.rank}", daemon=True)
        t.start()
        if wait > 0:
            t.join(wait)

    def _send_up(self, snaps: dict, stored: set, lost: set, store: bool = False) -> None:
        """Our subtree's snapshots to our parent, with the ranks below whose snapshots went to the
        store and those the trigger could not reach; to the store when we head a group (a
        subtree of :data:`GROUP_SPAN` ranks: the parent then gets the rank lists alone) or the
        parent cannot be reached (``store``: the store at once)."""
        t = self._tree
        if t.up and not self._group_top() and not store:
            try:
                fanout.send(t.up, fanout.pack(t.envelope("gather", snaps=snaps, stored=rank_ranges(stored),
                                                         lost=rank_ranges(lost))), self._secret)
                return
            except (OSError, ConnectionError, ValueError) as e:
                log.info("rank %d: watchdog parent %s unreachable (%s): snapshots through the store", self.rank, t.up, e)
        try:
            if snaps:
                client = self._action_client()
                client.multi_set({f"diag/snap/{r}": json.dumps(s).encode() for r, s in snaps.items()})
                client.add("diag/nsnap", len(snaps))
        except HpcringError as e:
            self._lost = str(e)
            return
        if t.up and self._group_top() and not store:
            try:
                fanout.send(t.up, fanout.pack(t.envelope("gather", snaps={}, stored=rank_ranges(stored | set(snaps)),
                                                         lost=rank_ranges(lost))), self._secret)
            except (OSError, ConnectionError, ValueError) as e:
                log.info("rank %d: watchdog parent %s unreachable (%s)", self.rank, t.up, e)

    def _group_top(self) -> bool:
        """Whether this rank heads a group: its subtree's snapshots go to the store in one batch
        and it reads the report from there. Two tree levels below each group top (8 x 8 ranks),
        the store above: a hop costs a connection and a handshake on both sides, the store one per
        group (n / 64 connections instead of n); the root's own group comes up to it."""
        t = self._tree
        return t.placed and not t.is_root and fanout.span(t.v, self.size) >= GROUP_SPAN

    def _report_from_store(self) -> None:
        """A group top: the report, from a parked read of the store (its own connection), handed
        to the tree as if it came down it (then relayed to the group)."""
        try:
            with self._store(timeout=5.0) as client:
                wire = json.loads(client.get(REPORT, timeout=GRACE_STRETCH * self.grace + 15.0))
        except (HpcringError, ValueError):
            return                       # the wait below falls back on its own
        self._on_message(self._tree.envelope("report", report=wire))

    def _claim(self) -> bool:
        with self._lock:
            if self._handled:
                return False
            self._handled = True
            return True

    def _handle_with_store(self, trig: dict) -> None:
        if self._lost is not None and self._client is None:
            self._handle(trig, None)
            return
        try:
            client = self._action_client()
            self.timings.setdefault("connected", time.monotonic())
        except HpcringError as e:
            self._lost, client = str(e), None
        self._handle(trig, client)

    def _end_for_scheduler(self, trig: dict) -> None:
        # The scheduler stopped the peers (a requeue, a cancel, the time limit): no report, no
        # scancel (that would cancel the requeued job), no failure record; it ends this rank too,
        # once the ranks below it in the tree have heard (bounded: 2 s per unreachable child).
        self._fwd_done.wait(fanout.step() * (fanout.depth(self.size) + 2))
        print(f"hpcring: rank {self.rank} ({self.host}): {trig['ending']}: a peer left "
              f"{_op_name(trig.get('op'))}because of it, not a collective failure; exiting",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + 15)

    def _handle_tree(self, trig: dict, fwd: tuple | None = None, replied: bool = False) -> None:
        """A rank the trigger reached down the tree: the trigger on to its children (``fwd``:
        :meth:`_forward`'s arguments), snapshot up (``replied``: it went up already, with the
        trigger's acknowledgement), report down (fallbacks: the store)."""
        t = self._tree
        if fwd is not None:
            self._forward(*fwd, background=False)
        mine = replied or self._claim()  # False: this rank already went the store's way
        self._via_tree = mine
        if mine and trig.get("ending"):
            self._end_for_scheduler(trig)
        snap = folder = None
        if mine:
            snap = self._replied if replied else self.snapshot()
            folder = self.dump(f"collective failure first seen on rank {trig.get('rank')}: {trig.get('error')}")
        if not replied:
            t.wait_gather(time.monotonic() + gather_budget(t.v, self.size, self.grace))
            self._send_up(*t.take_up(snap))
            self.timings.setdefault("published", time.monotonic())
        if self._group_top():
            threading.Thread(target=self._report_from_store, name=f"hpcring-watchdog-read:{self.rank}",
                             daemon=True).start()
        if not mine:
            return
        report = None
        wire = t.wait_report(time.monotonic() + GRACE_STRETCH * self.grace + 5.0)
        relay = fanout.pack(t.envelope("report", report=wire)) if t.take_relay() else None
        client = None
        if wire is None:                 # the tree did not bring it: read it where the root left it
            self.timings.setdefault("report_from_store", time.monotonic())
            try:
                client = self._action_client()
                wire = json.loads(client.get(REPORT, timeout=10.0))
            except (HpcringError, ValueError) as e:
                self._lost = str(e)
        if wire is not None:
            report = _from_wire(wire, list(self.topology.hosts))
        else:
            report = self.diagnose(self.size, list(self.topology.hosts), {self.rank: snap}, trigger=trig,
                                   interface=self.topology.interface, side_channel=False)
            report.files = folder
            print(report.text() + f"\n  side channel: {self._lost}", file=sys.stderr, flush=True)
        self._finish(report, client, relay)

    def _handle(self, trig: dict, client) -> None:
        """The root (``client``: its store connection), or a rank the tree did not reach (the
        store's path: snapshot through the store, the report read from it), or one cut off."""
        if not self._claim():
            return
        if trig.get("ending"):
            self._end_for_scheduler(trig)
        snap = self.snapshot()
        folder = self.dump(f"collective failure first seen on rank {trig.get('rank')}: {trig.get('error')}")
        report = None
        if client is not None:
            try:
                if self._tree.is_root:
                    report = self._collect(client, trig, folder, snap)
                    self.timings.setdefault("published", time.monotonic())
                    _publish(report, folder)
                    wire = _to_wire(report)
                    client.set(REPORT, json.dumps(wire).encode())
                    self._down(fanout.pack(self._tree.envelope("report", report=wire)))
                    print(report.text(), file=sys.stderr, flush=True)
                else:
                    client.set(f"diag/snap/{self.rank}", json.dumps(snap).encode())
                    client.add("diag/nsnap", 1)
                    self.timings.setdefault("published", time.monotonic())
                    report = _from_wire(json.loads(client.get(REPORT, timeout=GRACE_STRETCH * self.grace + 15.0)),
                                        list(self.topology.hosts))
            except HpcringError as e:
                self._lost = str(e)
        if report is None:
            report = self.diagnose(self.size, list(self.topology.hosts), {self.rank: snap}, trigger=trig,
                              interface=self.topology.interface, side_channel=False)
            report.files = folder
            print(report.text() + f"\n  side channel: {self._lost}", file=sys.stderr, flush=True)
        self._finish(report, client)

    def _collect(self, client, trig: dict, folder: str | None, own: dict) -> Report:
        # Until every rank is accounted for (its snapshot came, or the tree could not reach it: a
        # dead or frozen rank is known at once); else up to the grace, and past it only while
        # snapshots still arrive (two tree steps apart at most: ranks alive but slow, a large job,
        # a loaded node), up to GRACE_STRETCH x grace. Snapshots come up the tree (whole subtrees
        # at a time) or through the store (group heads, ranks off the tree; counted there).
        start = time.monotonic()
        soft, hard, seen = start + self.grace, start + GRACE_STRETCH * self.grace, -1
        # peers whose connection the backend saw closed or reset: gone, not starved; an unreachable
        # rank among them gets no grace (a lost node would cost every restart that much)
        gone = {ln["peer"] for ln in (parse_link(own.get("error"), self.rank),
                                      parse_link(trig.get("error"), trig.get("rank", -1)))
                if ln and ln.get("gone")}
        next_poll = start
        stored = 0
        while True:
            now = time.monotonic()
            if now >= next_poll:         # the store's counters: 10 reads a second, one rank
                stored = client.add("diag/nsnap", 0) + client.add("diag/nexit", 0)
                next_poll = now + 0.1
            got = 1 + self._tree.count() + stored
            accounted, some_lost = self._tree.accounted()
            if got >= self.size or now >= hard:
                break
            if accounted >= self.size and (not some_lost or now >= start + self.grace
                                           or self._tree.lost_ranks() <= gone):
                break                    # every rank's snapshot is in, or it was unreachable (those
                # get the grace: starved, not stopped, they publish through the store instead)
            if got > seen:
                seen, soft = got, max(soft, min(hard, now + 2 * fanout.step()))
            elif now >= soft:
                break
            with self._tree.cond:
                self._tree.cond.wait(0.05)
        snaps = {**self._tree.take_up(None)[0], self.rank: own}
        # The rest from the store, in two batched reads of the missing ranks' keys.
        missing = [r for r in range(self.size) if r not in snaps]
        snap_values = client.multi_check([f"diag/snap/{r}" for r in missing]) if missing else []
        exit_values = client.multi_check([f"diag/exit/{r}" for r in missing]) if missing else []
        snaps.update({r: json.loads(v) for r, v in zip(missing, snap_values) if v is not None})
        exits = {r: json.loads(v) for r, v in zip(missing, exit_values) if v is not None and r not in snaps}
        report = self.diagnose(self.size, list(self.topology.hosts), snaps, exits, trig,
                          interface=self.topology.interface)
        report.files = folder
        return report

    def _finish(self, report: Report, client, relay: bytes | None = None) -> None:
        """Hold, print and act on the report; ``relay``: the report's message, to pass on to our
        children in this thread once our own line is out (the listener left it to us)."""
        self.timings.setdefault("report", time.monotonic())
        self.report = report
        action = f"exiting with code {EXIT_CODE}" if self.abort else "raising CollectiveError"
        print(f"hpcring: rank {self.rank} ({self.host}): {report.headline}; {action}", file=sys.stderr, flush=True)
        for hook in list(_EXIT_HOOKS):
            try:
                hook(report.headline)
            except Exception:  # noqa: BLE001 - a hook must not stop the exit
                pass
        self._done.set()
        with self._work:
            self._work.notify_all()      # a thread waiting in trigger() for the tree's work
        if relay is not None:
            self._down(relay, inline=True)
        if not self.abort:
            return
        reporter = self._tree.is_root
        t = self._tree
        if t.placed and self._lost is None and (t.is_root or self._via_tree):
            # Every rank leaves together, once all that answered have their report and status
            # written: the first exit ends the job (srun --kill-on-bad-exit, the local supervisor),
            # and rank 0 serves the store the fallback ranks read from. Up the tree: our subtree's
            # acknowledgements (bounded: a frozen rank never acknowledges), then down: the root's exit.
            below = t.wait_acks(time.monotonic() + ACK_TIMEOUT)
            if t.is_root:
                if client is not None:
                    try:          # the store's fallback ranks, acknowledged through the store
                        client.get("diag/acked", timeout=1.0) if client.add("diag/nsnap", 0) else None
                    except HpcringError:
                        pass
                self._down(fanout.pack(t.envelope("exit")), wait=fanout.step() + 2.0)
            else:
                try:
                    fanout.send(t.up, fanout.pack(t.envelope("ack", count=below + 1)), self._secret)
                except (OSError, ConnectionError, ValueError, TypeError):
                    pass
                t.exit.wait(ACK_TIMEOUT + fanout.step() * (fanout.depth(self.size) + 1))
                self._down(fanout.pack(t.envelope("exit")), wait=fanout.step() + 2.0)
        elif client is not None and self._lost is None:
            # The store's path: the last to acknowledge sets diag/acked; the others wait for it
            # parked (no polling: thousands of ranks polling counters would flood the store).
            try:
                reporter = client.check("diag/reporter-rank") == str(self.rank).encode()
                if client.add("diag/nack", 1) >= client.add("diag/nsnap", 0):
                    client.set("diag/acked", b"1")
                else:
                    client.get("diag/acked", timeout=5.0)
            except HpcringError:
                pass
        else:
            # No side channel: a rank that still has one may be writing the full report; leaving
            # now would end the job (and that report) under it.
            time.sleep(self.grace + 5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        if reporter or client is None and not t.placed or self._lost is not None:
            teardown.end_job(self.rank, report.headline)   # frozen ranks included; the report is on disk
        os._exit(EXIT_CODE)

    def _on_exit(self) -> None:
        """Interpreter exit: leave an exit record so a later hang names this rank as exited; a
        rank ending on an exception (noted by :meth:`note_raised`, or uncaught: ``sys.last_value``)
        first writes its dumps, and its record says what it raised and where."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        if self._handled:
            return
        if self._raised is None:
            exc = getattr(sys, "last_value", None)   # set by the interpreter for an uncaught exception
            if isinstance(exc, BaseException):
                self.note_raised(exc)
        self._bounded(self._exit_summary, EXIT_DUMP_S)     # hpcring report's numbers (a hung FS: bounded)
        try:
            rec = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "time": time.time(),
                   "last_done": max((c.recorder.last_done() for c in self._comms), default=0),
                   **(self._raised or {})}
            client = self._client or self._store(timeout=2.0)
            try:
                client.set(f"diag/exit/{self.rank}", json.dumps(rec).encode())
                client.add("diag/nexit", 1)
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - exiting anyway; the store may be gone
            pass


def note_raised(exc: BaseException) -> None:
    """The session's watchdog's :meth:`Watchdog.note_raised` (nothing without a session or a
    watchdog): for a rank entry that catches the work's exception itself (``hpcring submit``'s
    script or function). The session is looked up, not imported: it sits above this layer."""
    session = sys.modules.get("hpcring.session")
    current = session.current() if session is not None else None
    wd = getattr(current, "watchdog", None)
    if wd is not None and not isinstance(exc, (SystemExit, GeneratorExit)):
        try:
            wd.note_raised(exc)
        except Exception:  # noqa: BLE001 - the rank is failing already: never fail it twice
            log.exception("rank %d: could not record the exception", wd.rank)


def _raised_text(exc: BaseException) -> tuple[str, str | None]:
    """(``ValueError: x`` (first line), where it was raised: ``in load at train.py:12 (main)``)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] if str(exc) else type(exc).__name__
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    where = None
    if last is not None:
        from hpcring.collectives.recorder import locate
        found = locate(last.tb_frame)
        where = None if found == "?" else found
    return text, where


def _op_name(op: dict | None) -> str:
    if not op:
        return ""
    return f"{op.get('op', 'a collective')}#{op.get('seq', '?')} "


def _publish(report: Report, folder: str | None) -> None:
    if folder is None:
        return
    try:
        base = os.path.join(folder, "hang-report")
        with open(base + ".json", "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        with open(base + ".txt", "w") as f:
            f.write(report.text() + "\n")
    except OSError as e:
        print(f"hpcring: could not save the hang report in {folder}: {e}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# DUMP_SIGNAL: dump the flight records and keep running
# ---------------------------------------------------------------------------------------------
# A real-time signal nothing else in the stack uses. Not SIGUSR1: Lightning's SLURM requeue
# handler lives there and is installed only when no handler exists yet. Not SIGUSR2: submitit
# and Slurm's --signal=USR2@N time-limit warning. (SIGRTMIN+6 takes stack dumps.)
DUMP_SIGNAL = signal.SIGRTMIN + 7


def install_dump_signal(watchdog: Watchdog, signum: int = DUMP_SIGNAL) -> bool:
    """Make ``signum`` dump ``watchdog``'s flight records and stacks and keep running.
    Never replaces a handler somebody else installed (returns False then).

    A Python signal handler only runs when the main thread returns to the interpreter -- never
    while it is stuck in a collective. So the handler is a no-op and the work is done by a
    thread woken through ``signal.set_wakeup_fd`` (the C-level handler writes the signal number
    there from whatever thread the kernel picked). Must be called from the main thread; returns
    False (and installs nothing) elsewhere or when somebody else (asyncio) owns the wakeup fd.
    """
    from hpcring.diagnostics.stacks import signal_name
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r), os.close(w)
        return False
    if old != -1:                      # an event loop owns it: give it back
        signal.set_wakeup_fd(old)
        os.close(r), os.close(w)
        return False
    signal.signal(signum, lambda *_: None)

    def pump() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            if signum in data:
                folder = watchdog.dump(f"signal {signal_name(signum)}")
                print(f"hpcring: rank {watchdog.rank}: flight records and stacks written to {folder}",
                      file=sys.stderr, flush=True)

    threading.Thread(target=pump, name="hpcring-sigdump", daemon=True).start()
    return True
