"""Hang watchdog: a failed or overdue collective becomes one report, then every rank exits.

Every backend already enforces the per-collective deadline (the ring in C, MPI and NCCL by
polling) and raises :class:`~hpcring.errors.CollectiveError` on expiry or on a peer error. What
the backends cannot do alone is say *why*: the rank that timed out only knows which peer was
silent. The watchdog adds the job-wide view, over a side channel that does not share the stuck
data path: the rendezvous store (rank 0's authenticated TCP store, separate connections).

Protocol (keys under ``diag/``):

1. At start every rank listens on a port of its own (:mod:`hpcring.diagnostics.watchdog.fanout`) and
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
   failing ranks wait to hear it like the rest (:func:`wire.step` per level), and
   fall back on the store (step 3's older path) when they do not.
3. On the trigger each rank forwards it to its children, writes its stacks and flight records
   to ``<job folder>/diag/`` and sends its snapshot (newest records, records in flight, backend
   error, main thread's place) **up the same tree**, merged with its children's subtrees
   (:mod:`hpcring.diagnostics.watchdog.tree_rounds`: each level waits a share of the grace); a leaf
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

One concern per module: ``core`` (the Watchdog: shared state, wiring, the failing thread),
``tree_path`` and ``store_fallback`` (a failure's two paths), ``ending`` (acting on the report),
``dumps`` (what a rank writes about itself), ``signal_dump`` (:data:`DUMP_SIGNAL`), ``settings``
(keys, bounds, defaults); the tree's shape ``fanout``, its rounds ``tree_rounds``, and its
messages ``wire`` (sending) and ``listener`` (receiving).
"""
from __future__ import annotations

from hpcring.diagnostics.report import from_wire as _from_wire, to_wire as _to_wire
from hpcring.diagnostics.watchdog.core import Watchdog
from hpcring.diagnostics.watchdog.dumps import EXIT_DUMP_S, note_raised
from hpcring.diagnostics.watchdog.ending import _EXIT_HOOKS, add_exit_hook
from hpcring.diagnostics.watchdog.settings import (ACK_TIMEOUT, ADDR, CLAIM_TIMEOUT, EXIT_CODE, GRACE_ENV, GRACE_STRETCH,
                                                   GROUP_SPAN, JITTER_MAX_S, JITTER_RANKS, ON_FAILURE_ENV,
                                                   PUBLISH_TIMEOUT, REPORT, TRIGGER, abort_default, grace_default, log)
from hpcring.diagnostics.watchdog.signal_dump import DUMP_SIGNAL, install_dump_signal

# every name the module had before it became a package (tests use the three private ones); a
# constant patched for a test must be patched where it is read (settings, dumps), not here
__all__ = [
    "_EXIT_HOOKS", "_from_wire", "_to_wire", "ACK_TIMEOUT", "ADDR", "CLAIM_TIMEOUT", "DUMP_SIGNAL",
    "EXIT_CODE", "EXIT_DUMP_S", "GRACE_ENV", "GRACE_STRETCH", "GROUP_SPAN", "JITTER_MAX_S", "JITTER_RANKS",
    "ON_FAILURE_ENV", "PUBLISH_TIMEOUT", "REPORT", "TRIGGER", "Watchdog", "abort_default", "add_exit_hook",
    "grace_default", "install_dump_signal", "log", "note_raised",
]
