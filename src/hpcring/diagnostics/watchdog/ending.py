"""How a rank acts on the report: it holds and prints it, runs the exit hooks, and in abort mode
leaves with every rank that answered (acknowledged up the tree or through the store), asking the
scheduler to end the job where it must; and a rank whose peers the scheduler stopped just leaves."""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

from hpcring import schedulers
from hpcring.diagnostics import teardown
from hpcring.diagnostics.report import Report
from hpcring.diagnostics.watchdog import fanout, wire
from hpcring.diagnostics.watchdog.settings import ACK_TIMEOUT, EXIT_CODE
from hpcring.errors import HpcringError

_EXIT_HOOKS: list[Callable[[str], None]] = []


def add_exit_hook(fn: Callable[[str], None]) -> None:
    """Call ``fn(headline)`` just before the watchdog ends this process (e.g. to write the
    rank's status file); hooks must be quick and must not raise."""
    _EXIT_HOOKS.append(fn)


class Ending:
    """Held by the Watchdog (``wd``); both paths end a failure here."""

    def __init__(self, wd) -> None:
        self.wd = wd
        self._asked = False

    def by_scheduler(self, trig: dict, ask: bool = True) -> bool:
        """Whether the scheduler is ending this run, so a peer's leaving is no failure. The root
        asked when it claimed the trigger (``trig['ending']``). A rank left with its own view asks
        once itself (``ask``): rank 0's store is gone, so no root could ask -- the common case is
        a rank 0 that requeued its own job and returned (Lightning's auto-requeue), which the
        ring's peers see at once as a reset connection. One query per such rank, bounded by
        ``schedulers.RUN_ENDING_TIMEOUT``; the same rank asks again before any kill
        (``teardown.end_job``), since a requeue may come later than the failure."""
        if not trig.get("ending") and ask and not self._asked:
            self._asked = True
            ending = schedulers.run_ending(os.environ)
            if ending:
                trig["ending"] = ending
        return bool(trig.get("ending"))

    def leave_if_ending(self, trig: dict, ask: bool = True) -> None:
        """End this rank quietly (:meth:`end_for_scheduler`) when the scheduler is ending the run
        (:meth:`by_scheduler`); return otherwise, to go on to the report."""
        if self.by_scheduler(trig, ask):
            self.end_for_scheduler(trig)

    def finish(self, report: Report, client, relay: bytes | None = None) -> None:
        """Hold, print and act on the report; ``relay``: the report's message, to pass on to our
        children in this thread once our own line is out (the listener left it to us)."""
        wd, path = self.wd, self.wd._tree_path
        wd.timings.setdefault("report", time.monotonic())
        wd.report = report
        action = f"exiting with code {EXIT_CODE}" if wd.abort else "raising CollectiveError"
        print(f"hpcring: rank {wd.rank} ({wd.host}): {report.headline}; {action}", file=sys.stderr, flush=True)
        for hook in list(_EXIT_HOOKS):
            try:
                hook(report.headline)
            except Exception:  # noqa: BLE001 - a hook must not stop the exit
                pass
        wd._done.set()
        path.wake()
        if relay is not None:
            path.down(relay, inline=True)
        if not wd.abort:
            return
        reporter = wd._tree.is_root
        t = wd._tree
        if t.placed and wd._lost is None and (t.is_root or path.via_tree):
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
                path.down(wire.pack(t.envelope("exit")), wait=wire.step() + 2.0)
            else:
                try:
                    wire.send(t.up, wire.pack(t.envelope("ack", count=below + 1)), wd._secret)
                except (OSError, ConnectionError, ValueError, TypeError):
                    pass
                t.exit.wait(ACK_TIMEOUT + wire.step() * (fanout.depth(wd.size) + 1))
                path.down(wire.pack(t.envelope("exit")), wait=wire.step() + 2.0)
        elif client is not None and wd._lost is None:
            # The store's path: the last to acknowledge sets diag/acked; the others wait for it
            # parked (no polling: thousands of ranks polling counters would flood the store).
            try:
                reporter = client.check("diag/reporter-rank") == str(wd.rank).encode()
                if client.add("diag/nack", 1) >= client.add("diag/nsnap", 0):
                    client.set("diag/acked", b"1")
                else:
                    client.get("diag/acked", timeout=5.0)
            except HpcringError:
                pass
        else:
            # No side channel: a rank that still has one may be writing the full report; leaving
            # now would end the job (and that report) under it.
            time.sleep(wd.grace + 5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        if reporter or client is None and not t.placed or wd._lost is not None:
            teardown.end_job(wd.rank, report.headline)   # frozen ranks included; the report is on disk
        os._exit(EXIT_CODE)

    def end_for_scheduler(self, trig: dict) -> None:
        # The scheduler stopped the peers (a requeue, a cancel, the time limit): no report, no
        # scancel (that would cancel the requeued job), no failure record; it ends this rank too,
        # once the ranks below it in the tree have heard (bounded: 2 s per unreachable child);
        # a rank off the tree (its own view) has no one below it to wait for.
        wd = self.wd
        if wd._tree.placed:
            wd._tree_path.fwd_done.wait(wire.step() * (fanout.depth(wd.size) + 2))
        print(f"hpcring: rank {wd.rank} ({wd.host}): {trig['ending']}: a peer left "
              f"{_op_name(trig.get('op'))}because of it, not a collective failure; exiting",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + 15)


def _op_name(op: dict | None) -> str:
    if not op:
        return ""
    return f"{op.get('op', 'a collective')}#{op.get('seq', '?')} "
