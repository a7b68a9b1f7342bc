"""The store's path of a failure: the trigger claimed at rank 0's store (the first rank becomes
the tree's root), the root's wait for every snapshot and its report, and the fallback of a rank
the tree did not reach or that is cut off (snapshot through the store, the report read from it)."""
from __future__ import annotations

import json
import sys
import time

from hpcring.bootstrap.store_client import ClientBusy
from hpcring.diagnostics.report import Report, from_wire as _from_wire, parse_link, to_wire as _to_wire
from hpcring.diagnostics.watchdog import fanout, wire
from hpcring.diagnostics.watchdog.dumps import _publish
from hpcring.diagnostics.watchdog.settings import ADDR, CLAIM_TIMEOUT, GRACE_STRETCH, REPORT, TRIGGER
from hpcring.errors import HpcringError


class StoreFallback:
    """Held by the Watchdog (``wd``: the failure's shared state, its store connections); the
    root's rounds on the tree go through ``wd._tree_path``."""

    def __init__(self, wd) -> None:
        self.wd = wd

    def trigger(self, trig: dict) -> bool:
        """Claim the trigger at the store (a connection of our own): the first rank becomes the
        root and sends it down the tree. True when this rank is to handle the failure the
        store's way (the root, a rank the tree did not reach, one cut off from the store)."""
        wd = self.wd
        addrs = None
        wd.timings.setdefault("claimed", time.monotonic())
        try:
            if self.claim_trigger():
                client = wd._action_client()     # the root's own connection, for its rounds
                client.add("diag/reporter", 1)     # the root reports: no fallback rank may claim it
                client.set("diag/reporter-rank", str(wd.rank).encode())
                wd._ending.by_scheduler(trig)       # one query, from the rank that saw the failure first
                client.set(TRIGGER, json.dumps(trig).encode())
                addrs = self.addresses(client)
            else:
                # Another rank was first: its trigger reaches us down its tree; if not (our
                # address unknown to it, a lost branch), the store's path, with its trigger.
                if wd._heard.wait(min(wd.grace, wire.step() * (fanout.depth(wd.size) + 2))):
                    return False
                client = wd._action_client()
                try:
                    trig = json.loads(client.get(TRIGGER, timeout=5.0))
                except (HpcringError, ValueError):
                    pass                   # our own trigger, then: the report says what it can
        except HpcringError as e:
            wd._lost = f"rank 0's store at {wd._address[0]}:{wd._address[1]}: {e}"
        if wd._lost is not None and wd._client is None:
            return True                  # our own view (the store's path, without a client)
        if addrs is not None and wd._tree.place(wd.rank, 0, None, addrs):
            wd._heard.set()
            wd._tree_path.forward(wd.rank, 0, addrs, trig)
        return True

    def claim_trigger(self) -> bool:
        """Whether this rank is the first to claim the trigger (``diag/ntrigger``). Through the
        session's store connection when another thread does not hold it for :data:`CLAIM_TIMEOUT`
        (thousands of ranks claim within a second: a connection and handshake each at the store
        was most of that), else through a connection of our own; either fails within
        :data:`CLAIM_TIMEOUT` when the store cannot be reached."""
        if self.wd._init_store is not None:
            try:
                return self.wd._init_store.add("diag/ntrigger", 1, timeout=CLAIM_TIMEOUT) == 1
            except ClientBusy:
                pass
        return self.wd._action_client().add("diag/ntrigger", 1) == 1

    def addresses(self, client) -> list:
        """Every rank's listener (one batched read), rotated so index 0 is this rank (the root)."""
        rank, size = self.wd.rank, self.wd.size
        values = client.multi_check([f"{ADDR}{r}" for r in range(size)])
        return [None if values[(rank + i) % size] is None
                else values[(rank + i) % size].decode() for i in range(size)]

    def handle_with_store(self, trig: dict) -> None:
        wd = self.wd
        if wd._lost is not None and wd._client is None:
            self.handle(trig, None)
            return
        try:
            client = wd._action_client()
            wd.timings.setdefault("connected", time.monotonic())
        except HpcringError as e:
            wd._lost, client = str(e), None
        self.handle(trig, client)

    def handle(self, trig: dict, client) -> None:
        """The root (``client``: its store connection), or a rank the tree did not reach (the
        store's path: snapshot through the store, the report read from it), or one cut off."""
        wd = self.wd
        if not wd._claim():
            return
        wd._ending.leave_if_ending(trig, ask=client is None)
        snap = wd.snapshot()
        folder = wd.dump(f"collective failure first seen on rank {trig.get('rank')}: {trig.get('error')}")
        report = None
        if client is not None:
            try:
                if wd._tree.is_root:
                    report = self.collect(client, trig, folder, snap)
                    wd.timings.setdefault("published", time.monotonic())
                    _publish(report, folder)
                    report_wire = _to_wire(report)
                    client.set(REPORT, json.dumps(report_wire).encode())
                    wd._tree_path.down(wire.pack(wd._tree.envelope("report", report=report_wire)))
                    print(report.text(), file=sys.stderr, flush=True)
                else:
                    client.set(f"diag/snap/{wd.rank}", json.dumps(snap).encode())
                    client.add("diag/nsnap", 1)
                    wd.timings.setdefault("published", time.monotonic())
                    report = _from_wire(json.loads(client.get(REPORT, timeout=GRACE_STRETCH * wd.grace + 15.0)),
                                        list(wd.topology.hosts))
            except HpcringError as e:
                wd._lost = str(e)
        if report is None:
            wd._ending.leave_if_ending(trig)     # the store went while we waited: ask before reporting
            report = wd.diagnose(wd.size, list(wd.topology.hosts), {wd.rank: snap}, trigger=trig,
                                 interface=wd.topology.interface, side_channel=False)
            report.files = folder
            print(report.text() + f"\n  side channel: {wd._lost}", file=sys.stderr, flush=True)
        wd._ending.finish(report, client)

    def collect(self, client, trig: dict, folder: str | None, own: dict) -> Report:
        # Until every rank is accounted for (its snapshot came, or the tree could not reach it: a
        # dead or frozen rank is known at once); else up to the grace, and past it only while
        # snapshots still arrive (two tree steps apart at most: ranks alive but slow, a large job,
        # a loaded node), up to GRACE_STRETCH x grace. Snapshots come up the tree (whole subtrees
        # at a time) or through the store (group heads, ranks off the tree; counted there).
        wd = self.wd
        tree = wd._tree
        start = time.monotonic()
        soft, hard, seen = start + wd.grace, start + GRACE_STRETCH * wd.grace, -1
        # peers whose connection the backend saw closed or reset: gone, not starved; an unreachable
        # rank among them gets no grace (a lost node would cost every restart that much)
        gone = {ln["peer"] for ln in (parse_link(own.get("error"), wd.rank),
                                      parse_link(trig.get("error"), trig.get("rank", -1)))
                if ln and ln.get("gone")}
        next_poll = start
        stored = 0
        while True:
            now = time.monotonic()
            if now >= next_poll:         # the store's counters: 10 reads a second, one rank
                stored = client.add("diag/nsnap", 0) + client.add("diag/nexit", 0)
                next_poll = now + 0.1
            got = 1 + tree.count() + stored
            accounted, some_lost = tree.accounted()
            if got >= wd.size or now >= hard:
                break
            if accounted >= wd.size and (not some_lost or now >= start + wd.grace
                                         or tree.lost_ranks() <= gone):
                break                    # every rank's snapshot is in, or it was unreachable (those
                # get the grace: starved, not stopped, they publish through the store instead)
            if got > seen:
                seen, soft = got, max(soft, min(hard, now + 2 * wire.step()))
            elif now >= soft:
                break
            with tree.cond:
                tree.cond.wait(0.05)
        snaps = {**tree.take_up(None)[0], wd.rank: own}
        # The rest from the store, in two batched reads of the missing ranks' keys.
        missing = [r for r in range(wd.size) if r not in snaps]
        snap_values = client.multi_check([f"diag/snap/{r}" for r in missing]) if missing else []
        exit_values = client.multi_check([f"diag/exit/{r}" for r in missing]) if missing else []
        snaps.update({r: json.loads(v) for r, v in zip(missing, snap_values) if v is not None})
        exits = {r: json.loads(v) for r, v in zip(missing, exit_values) if v is not None and r not in snaps}
        report = wd.diagnose(wd.size, list(wd.topology.hosts), snaps, exits, trig,
                             interface=wd.topology.interface)
        report.files = folder
        return report
