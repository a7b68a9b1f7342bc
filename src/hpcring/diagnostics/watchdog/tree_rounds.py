"""One rank's place in a failure's tree, and what comes back up and down it after the trigger.

The trigger goes down the k-nomial tree of :mod:`hpcring.diagnostics.watchdog.fanout`; this module is the
state of the rounds that follow on the same tree, so that rank 0's store serves one connection
per failure instead of one per rank (at 4096 ranks the per-rank store connections and snapshots
were most of the time from a frozen rank to its report):

* ``gather`` (up): each rank waits, at most :func:`gather_budget`, for its children's subtrees,
  then sends its own snapshot merged with theirs to its parent (``up``: the address the trigger
  came from). A child's subtree that arrives after that is passed up on its own.
* ``report`` (down): the root's report, in its wire form; each rank passes it to its children
  before acting on it.
* ``ack`` (up) and ``exit`` (down), abort mode only: a rank leaves once every rank that answered
  has printed its line (the first exit ends the job).

A rank the tree cannot reach, or whose parent cannot be reached, falls back on the store (the
watchdog's older path); the root reads whatever is still missing from the store in one batched
read, so the two paths mix. Every wait here has a deadline.
"""
from __future__ import annotations

import threading
import time

from hpcring.diagnostics.watchdog import fanout
from hpcring.ranks import expand_ranges


def gather_budget(v: int, n: int, grace: float) -> float:
    """How long relative rank ``v`` waits for its children's snapshots before sending what it has:
    a share of the grace proportional to the height of its subtree, so that a parent's wait
    covers its children's and the root (which waits the whole grace) hears from its largest
    subtree before its own grace ends. Leaves: 0."""
    top = fanout.levels(n)
    height = fanout.levels(len(fanout.subtree(v, n))) if v else top + 1
    return grace * height / (top + 2)


class TreeRounds:
    """This rank's place in the tree of one failure (set once, by the trigger) and what its
    children sent back. Thread-safe: the listener thread delivers, the watchdog's threads wait."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.cond = threading.Condition()
        self.root: int | None = None
        self.v: int | None = None              # this rank's index relative to the root
        self.up: str | None = None             # the parent's listener (None at the root)
        self.addrs: list = []                  # listeners of this rank's subtree, from itself on
        self.kids: list[tuple[int, str]] = []  # (relative index, address) the trigger was delivered to
        self.forwarded = False                 # the trigger's forwarding is over (kids is complete)
        self.snaps: dict[int, dict] = {}       # rank -> snapshot, from the subtrees below
        self.gathered: set[int] = set()        # relative indices of the kids whose subtree came up
        self.stored: set[int] = set()          # ranks below whose snapshots went to the store (group heads)
        self.lost: set[int] = set()            # ranks below the trigger could not reach
        self.sent_up = False
        self.report: dict | None = None        # the root's report, wire form
        self.waiting = 0                       # threads in wait_report: the first one passes it on
        self.relay_owed = False                # ... (take_relay), else the listener's caller does
        self.acks: dict[int, int] = {}         # kid -> ranks of its subtree that acknowledged
        self.exit = threading.Event()

    # -- the trigger ------------------------------------------------------------------------
    def place(self, root: int, v: int, up: str | None, addrs: list | None = None) -> bool:
        """Take this rank's place (the first trigger only); False when it already has one."""
        with self.cond:
            if self.v is not None:
                return False
            self.root, self.v, self.up, self.addrs = root, v, up, list(addrs or [])
            return True

    @property
    def placed(self) -> bool:
        return self.v is not None

    @property
    def is_root(self) -> bool:
        return self.v == 0

    def set_kids(self, delivered: list[tuple[int, str]], lost: list[int] = ()) -> set[int]:
        """The trigger's forwarding is over: ``delivered`` are this rank's children, ``lost``
        the ranks below it that it could not reach (accounted for here). Returns them when this
        rank's own subtree already went up without them (the caller passes them on), else an
        empty set."""
        with self.cond:
            self.kids, self.forwarded = list(delivered), True
            self.lost |= set(lost)
            self.cond.notify_all()
            return set(lost) if self.sent_up and not self.is_root else set()

    def _mine(self, msg: dict) -> int | None:
        """The sender's relative index when ``msg`` belongs to this rank's tree, else None."""
        try:
            kid = int(msg["v"])
            ok = int(msg["root"]) == self.root and int(msg["n"]) == self.size
        except (KeyError, TypeError, ValueError):
            return None
        return kid if ok and self.v is not None and kid in fanout.subtree(self.v, self.size) else None

    # -- gather (up) ------------------------------------------------------------------------
    def on_gather(self, msg: dict) -> tuple[dict, set[int], set[int]] | None:
        """A subtree's snapshots arrived (``snaps``; ``stored``: ranks whose snapshots went to the
        store instead; ``lost``: ranks it could not reach; both as rank ranges). Returns
        ``(snaps, stored, lost)`` when this rank already sent its own up (the caller passes them
        on alone), else None (they go up with this rank's)."""
        kid = self._mine(msg)
        snaps = msg.get("snaps")
        if kid is None or not isinstance(snaps, dict):
            return None
        try:
            snaps = {int(r): v for r, v in snaps.items()}
            stored = set(expand_ranges(msg.get("stored", ""), self.size))
            lost = set(expand_ranges(msg.get("lost", ""), self.size))
        except (TypeError, ValueError):
            return None
        with self.cond:
            self.gathered.add(kid)
            late = self.sent_up and not self.is_root
            if not late:
                for r, s in snaps.items():
                    self.snaps.setdefault(r, s)
                self.stored |= stored
                self.lost |= lost
            self.cond.notify_all()
        return (snaps, stored, lost) if late else None

    def wait_gather(self, deadline: float) -> None:
        """Until every child's subtree came up (after the forwarding ended) or ``deadline``."""
        with self.cond:
            while not (self.forwarded and all(k in self.gathered for k, _ in self.kids)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def take_up(self, own: dict | None) -> tuple[dict[int, dict], set[int], set[int]]:
        """What this rank sends up: ``(snapshots, stored, lost)``: its own snapshot (None: it
        went to the store, and counts as stored) and its subtree's so far, the ranks below whose
        snapshots went to the store, and those the trigger could not reach; later arrivals are
        passed up alone (:meth:`on_gather`)."""
        with self.cond:
            self.sent_up = True
            out, stored, lost = dict(self.snaps), set(self.stored), set(self.lost)
        if own is not None:
            out[self.rank] = own
        else:
            stored.add(self.rank)
        return out, stored, lost

    def count(self) -> int:
        with self.cond:
            return len(self.snaps)

    def lost_ranks(self) -> set[int]:
        """The ranks below the trigger it could not reach (the root: of the whole tree)."""
        with self.cond:
            return set(self.lost)

    def accounted(self) -> tuple[int, bool]:
        """At the root: how many ranks are accounted for (itself, snapshots, stored,
        unreachable), and whether any was unreachable."""
        with self.cond:
            return len(self.snaps.keys() | self.stored | self.lost | {self.rank}), bool(self.lost)

    # -- report (down) ----------------------------------------------------------------------
    def on_report(self, msg: dict) -> bool:
        """The report came down; True the first time when no thread waits for it in
        :meth:`wait_report` (the caller then passes it on), False otherwise (a waiting thread
        passes it on: :meth:`take_relay`; no thread is started for it)."""
        if not isinstance(msg.get("report"), dict) or msg.get("root") != self.root:
            return False
        with self.cond:
            if self.report is not None:
                return False
            self.report = msg["report"]
            self.relay_owed = self.waiting > 0
            self.cond.notify_all()
            return not self.relay_owed

    def wait_report(self, deadline: float) -> dict | None:
        with self.cond:
            self.waiting += 1
            try:
                while self.report is None and time.monotonic() < deadline:
                    self.cond.wait(max(0.0, deadline - time.monotonic()))
            finally:
                self.waiting -= 1
            return self.report

    def take_relay(self) -> bool:
        """True once, for the thread that is to pass the report on (on_report left it to it)."""
        with self.cond:
            owed, self.relay_owed = self.relay_owed, False
            return owed

    # -- ack (up), exit (down) ---------------------------------------------------------------
    def on_ack(self, msg: dict) -> None:
        kid = self._mine(msg)
        if kid is None:
            return
        with self.cond:
            self.acks[kid] = int(msg.get("count", 1))
            self.cond.notify_all()

    def wait_acks(self, deadline: float) -> int:
        """Ranks below this one that acknowledged, once every child has (or at ``deadline``)."""
        with self.cond:
            while not (self.forwarded and all(k in self.acks for k, _ in self.kids)) and time.monotonic() < deadline:
                self.cond.wait(max(0.0, deadline - time.monotonic()))
            return sum(self.acks.values())

    def envelope(self, kind: str, **body) -> dict:
        """A message of this tree from this rank."""
        return {"kind": kind, "root": self.root, "n": self.size, "v": self.v, **body}
