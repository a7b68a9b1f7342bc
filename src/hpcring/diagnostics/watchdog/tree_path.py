"""The tree's path of a failure, on this rank: the trigger heard and passed on, the snapshots sent
up, the report and the exit passed down (:mod:`hpcring.diagnostics.watchdog.fanout`,
:mod:`hpcring.diagnostics.watchdog.tree_rounds`), and the hand-over of that work to a thread
already waiting in :meth:`Watchdog.trigger`."""
from __future__ import annotations

import json
import sys
import threading
import time

from hpcring.diagnostics.report import from_wire as _from_wire
from hpcring.diagnostics.watchdog import fanout, wire
from hpcring.diagnostics.watchdog.settings import GRACE_STRETCH, GROUP_SPAN, REPORT, log
from hpcring.diagnostics.watchdog.tree_rounds import gather_budget
from hpcring.errors import HpcringError
from hpcring.ranks import rank_ranges


class TreePath:
    """Held by the Watchdog (``wd``: the failure's shared state: its :class:`TreeRounds`
    ``_tree``, ``_heard``, ``_lost``, ``timings``); owns the forwarding and the hand-over."""

    def __init__(self, wd) -> None:
        self.wd = wd
        self._forwarded = False
        self._forwarder: threading.Thread | None = None
        self.fwd_done = threading.Event()               # the trigger's forwarding is over (children known)
        self._work = threading.Condition()               # the tree's trigger handed to a waiting thread:
        self._hosts = 0                                  # ... threads waiting in trigger() for it
        self._pending: tuple | None = None               # ... and handle's arguments, not yet taken
        self._replied: dict | None = None                # a leaf's snapshot, sent back with the trigger's answer
        self.via_tree = False                            # this rank handles the failure here (not the store's way)

    # -- the hand-over to a failing thread ----------------------------------------------------
    def host(self) -> None:
        """The calling thread takes the tree's work when it comes (:meth:`run`)."""
        with self._work:
            self._hosts += 1

    def wake(self) -> None:
        """The report is in: a thread waiting in :meth:`next_work` stops waiting."""
        with self._work:
            self._work.notify_all()      # a thread waiting in trigger() for the tree's work

    def run(self, trig: dict, fwd: tuple | None = None, replied: bool = False) -> None:
        """Handle the tree's trigger: in a thread already waiting in :meth:`Watchdog.trigger` (a
        rank whose own collective failed, most of them) when there is one, else in a thread of its
        own (a rank in user code, or in C). On a node running many ranks a thread start per rank
        and failure is what costs (docs/scale.md). ``replied``: our snapshot went back with the
        trigger's acknowledgement (a leaf)."""
        with self._work:
            if self._hosts:
                self._pending = (trig, fwd, replied)
                self._work.notify_all()
                return
        threading.Thread(target=self.handle, args=(trig, fwd, replied), name=f"hpcring-watchdog-tree:{self.wd.rank}",
                         daemon=True).start()

    def next_work(self, end: float) -> tuple | None:
        """Wait (until ``end``) for the tree's trigger handed to this thread, or the report."""
        with self._work:
            while self._pending is None and not self.wd._done.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._work.wait(left)
            work, self._pending = self._pending, None
            return work

    def unhost(self) -> bool:
        """This thread stops taking the tree's work; work handed to it meanwhile gets a thread."""
        with self._work:
            self._hosts -= 1
            work = None if self._hosts else self._pending
            if work is not None:
                self._pending = None
        if work is not None:
            threading.Thread(target=self.handle, args=work, name=f"hpcring-watchdog-tree:{self.wd.rank}",
                             daemon=True).start()
        return False

    # -- the listener's messages --------------------------------------------------------------
    def on_message(self, msg: dict) -> bytes | None:
        """A message of the failure's tree (listener thread): the trigger from our parent (pass it
        on, handle it), a subtree's snapshots, the report, an acknowledgement, the exit. Returns
        the reply that goes back with the acknowledgement: a leaf's snapshot, for the trigger."""
        wd = self.wd
        if wd._closing:
            return None
        kind = msg.get("kind", "trigger")
        if kind == "gather":
            self.on_gather(msg)
        elif kind == "report":
            if wd._tree.on_report(msg):      # else the thread waiting for it passes it on (Ending.finish)
                self.down(wire.pack(msg))
        elif kind == "ack":
            wd._tree.on_ack(msg)
        elif kind == "exit":
            if msg.get("root") == wd._tree.root and not wd._tree.exit.is_set():
                wd._tree.exit.set()
        elif kind == "trigger":
            try:
                root, n, v, addrs, trig = (int(msg["root"]), int(msg["n"]), int(msg["v"]), list(msg["addrs"]),
                                           dict(msg["trig"]))
                up = msg.get("up")
            except (KeyError, TypeError, ValueError):
                return None
            if n != wd.size or (root + v) % n != wd.rank or not (up is None or isinstance(up, str)):
                return None                # not meant for this rank (another job's size, a stale tree)
            wd.timings.setdefault("heard", time.monotonic())
            if not wd._tree.place(root, v, up, addrs):
                return None                # a second tree (a rank that lost the store raced): ours stands
            wd._heard.set()
            reply = None
            if not fanout.children(v, n) and not trig.get("ending") and wd._claim():
                # A leaf (7 ranks in 8) has nothing to wait for: its snapshot goes back with the
                # acknowledgement, not on a connection of its own (a third of a failure's
                # connections, and a wake-up of this rank's thread, at any size).
                self.via_tree = True
                self._replied = wd.snapshot()    # kept: our own view, should the report not come
                snaps, stored, lost = wd._tree.take_up(self._replied)
                reply = wire.pack(wd._tree.envelope("gather", snaps=snaps, stored=rank_ranges(stored),
                                                    lost=rank_ranges(lost)))
                wd.timings.setdefault("published", time.monotonic())
            self.run(trig, (root, v, addrs, trig), replied=reply is not None)
            return reply
        return None

    def on_gather(self, msg: dict) -> None:
        """A subtree's snapshots (a child's message, or a leaf's reply to our trigger)."""
        late = self.wd._tree.on_gather(msg)
        if late is not None:          # we already sent ours up: pass this subtree on alone
            threading.Thread(target=self.send_up, args=late, daemon=True,
                             name=f"hpcring-watchdog-up:{self.wd.rank}").start()

    def on_unsent(self, msg: dict) -> None:
        """Our reply to the trigger (our snapshot) did not reach the parent: the store's way."""
        if msg.get("kind", "trigger") != "trigger" or not self.via_tree:
            return
        snaps = {self.wd.rank: self.wd.snapshot()}
        threading.Thread(target=self.send_up, args=(snaps, set(), set()), kwargs={"store": True}, daemon=True,
                         name=f"hpcring-watchdog-up:{self.wd.rank}").start()

    def on_reply(self, c: int, reply: bytes) -> None:
        try:
            self.on_gather(wire.unpack(reply))
        except ValueError as e:
            log.info("rank %d: watchdog: a reply from relative rank %d dropped: %s", self.wd.rank, c, e)

    # -- down and up the tree -----------------------------------------------------------------
    def forward(self, root: int, v: int, addrs: list, trig: dict, background: bool = True) -> None:
        """Pass the trigger on (once), in the background or (``background`` False: the thread
        handling the tree's rounds) before returning. Its children are known after."""
        wd = self.wd
        with wd._lock:
            if self._forwarded:
                return
            self._forwarded = True
        if not fanout.children(v, wd.size):
            wd._tree.set_kids([])      # a leaf (7 ranks in 8): nobody to send to
            self.fwd_done.set()
            return

        def run() -> None:
            delivered: list = []
            lost: list = []
            try:
                lost = fanout.forward(root, wd.size, v, addrs, trig, wd._secret, delivered=delivered,
                                      on_reply=self.on_reply)
            finally:
                late = wd._tree.set_kids(delivered, [(root + c) % wd.size for c in lost])
                self.fwd_done.set()
            if late:                     # our subtree went up before the forwarding ended
                self.send_up({}, set(), late)
        if not background:
            run()
            return
        self._forwarder = threading.Thread(target=run, name=f"hpcring-watchdog-forward:{wd.rank}", daemon=True)
        self._forwarder.start()

    def down(self, body: bytes, wait: float = 0.0, inline: bool = False) -> None:
        """Send a later round (report, exit) to our children in the tree, in the background (or,
        ``inline``, in this thread), covering the subtree of one that stopped since; the
        forwarding of the trigger must be over (bounded wait) to know them. ``wait``: how long
        to wait for the background sends (0: not)."""
        wd = self.wd

        def run() -> None:
            self.fwd_done.wait(wire.step() * (fanout.depth(wd.size) + 2))
            t = wd._tree
            # every child, not only those the trigger's delivery confirmed: a child whose
            # acknowledgement timed out under load did get the trigger and waits for this
            fanout.relay(wd.size, t.v, t.addrs, fanout.children(t.v, wd.size), body, wd._secret)
        if not (wd._tree.placed and fanout.children(wd._tree.v, wd.size)):
            return                       # a leaf has nobody to send to: no thread
        if inline:
            run()
            return
        t = threading.Thread(target=run, name=f"hpcring-watchdog-down:{wd.rank}", daemon=True)
        t.start()
        if wait > 0:
            t.join(wait)

    def send_up(self, snaps: dict, stored: set, lost: set, store: bool = False) -> None:
        """Our subtree's snapshots to our parent, with the ranks below whose snapshots went to the
        store and those the trigger could not reach; to the store when we head a group (a
        subtree of :data:`GROUP_SPAN` ranks: the parent then gets the rank lists alone) or the
        parent cannot be reached (``store``: the store at once)."""
        wd = self.wd
        t = wd._tree
        if t.up and not self.group_top() and not store:
            try:
                wire.send(t.up, wire.pack(t.envelope("gather", snaps=snaps, stored=rank_ranges(stored),
                                                     lost=rank_ranges(lost))), wd._secret)
                return
            except (OSError, ConnectionError, ValueError) as e:
                log.info("rank %d: watchdog parent %s unreachable (%s): snapshots through the store", wd.rank, t.up, e)
        try:
            if snaps:
                client = wd._action_client()
                client.multi_set({f"diag/snap/{r}": json.dumps(s).encode() for r, s in snaps.items()})
                client.add("diag/nsnap", len(snaps))
        except HpcringError as e:
            wd._lost = str(e)
            return
        if t.up and self.group_top() and not store:
            try:
                wire.send(t.up, wire.pack(t.envelope("gather", snaps={}, stored=rank_ranges(stored | set(snaps)),
                                                     lost=rank_ranges(lost))), wd._secret)
            except (OSError, ConnectionError, ValueError) as e:
                log.info("rank %d: watchdog parent %s unreachable (%s)", wd.rank, t.up, e)

    def group_top(self) -> bool:
        """Whether this rank heads a group: its subtree's snapshots go to the store in one batch
        and it reads the report from there. Two tree levels below each group top (8 x 8 ranks),
        the store above: a hop costs a connection and a handshake on both sides, the store one per
        group (n / 64 connections instead of n); the root's own group comes up to it."""
        t = self.wd._tree
        return t.placed and not t.is_root and fanout.span(t.v, self.wd.size) >= GROUP_SPAN

    def report_from_store(self) -> None:
        """A group top: the report, from a parked read of the store (its own connection), handed
        to the tree as if it came down it (then relayed to the group)."""
        wd = self.wd
        try:
            with wd._store(timeout=5.0) as client:
                report_wire = json.loads(client.get(REPORT, timeout=GRACE_STRETCH * wd.grace + 15.0))
        except (HpcringError, ValueError):
            return                       # the wait below falls back on its own
        self.on_message(wd._tree.envelope("report", report=report_wire))

    # -- a rank the trigger reached down the tree ---------------------------------------------
    def handle(self, trig: dict, fwd: tuple | None = None, replied: bool = False) -> None:
        """A rank the trigger reached down the tree: the trigger on to its children (``fwd``:
        :meth:`forward`'s arguments), snapshot up (``replied``: it went up already, with the
        trigger's acknowledgement), report down (fallbacks: the store)."""
        wd = self.wd
        t = wd._tree
        if fwd is not None:
            self.forward(*fwd, background=False)
        mine = replied or wd._claim()  # False: this rank already went the store's way
        self.via_tree = mine
        if mine:
            wd._ending.leave_if_ending(trig, ask=False)
        snap = folder = None
        if mine:
            snap = self._replied if replied else wd.snapshot()
            folder = wd.dump(f"collective failure first seen on rank {trig.get('rank')}: {trig.get('error')}")
        if not replied:
            t.wait_gather(time.monotonic() + gather_budget(t.v, wd.size, wd.grace))
            self.send_up(*t.take_up(snap))
            wd.timings.setdefault("published", time.monotonic())
        if self.group_top():
            threading.Thread(target=self.report_from_store, name=f"hpcring-watchdog-read:{wd.rank}",
                             daemon=True).start()
        if not mine:
            return
        report = None
        report_wire = t.wait_report(time.monotonic() + GRACE_STRETCH * wd.grace + 5.0)
        relay = wire.pack(t.envelope("report", report=report_wire)) if t.take_relay() else None
        client = None
        if report_wire is None:          # the tree did not bring it: read it where the root left it
            wd.timings.setdefault("report_from_store", time.monotonic())
            try:
                client = wd._action_client()
                report_wire = json.loads(client.get(REPORT, timeout=10.0))
            except (HpcringError, ValueError) as e:
                wd._lost = str(e)
        if report_wire is not None:
            report = _from_wire(report_wire, list(wd.topology.hosts))
        else:
            wd._ending.leave_if_ending(trig)     # no report from the root: ask before reporting our own
            report = wd.diagnose(wd.size, list(wd.topology.hosts), {wd.rank: snap}, trigger=trig,
                                 interface=wd.topology.interface, side_channel=False)
            report.files = folder
            print(report.text() + f"\n  side channel: {wd._lost}", file=sys.stderr, flush=True)
        wd._ending.finish(report, client, relay)
