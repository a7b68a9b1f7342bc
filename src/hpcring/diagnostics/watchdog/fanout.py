"""The watchdog's trigger fan-out: a k-nomial tree (radix :data:`RADIX`) over the ranks, rooted at
the rank that saw the failure first, so a trigger reaches n ranks in about log8 n hops (4 at 4096
ranks, 6 at 64k) without any rank keeping a connection open for the whole job.

Tree (indices relative to the root: ``v = (rank - root) % n``, written in base k = RADIX): the
children of ``v`` are ``v + j * k**i`` for j = 1..k-1 and every ``k**i`` below ``span(v)``, the
place of ``v``'s lowest non-zero digit (all powers below n for the root), largest first; the
subtree of ``c`` is the contiguous block ``[c, c + span(c))``. A rank sends to its (k-1) log_k n
children at most all at once, from one thread over non-blocking sockets
(:func:`wire.send_many`), so a level costs one round trip, not k: radix 2 (binomial) would be the
optimum for one send at a time and takes 3x the levels. Each hop is a fresh authenticated
connection, and on a loaded node a hop is what costs (the harness, docs/scale.md). A message to
``c`` carries the addresses of that block, so a forwarder needs nothing from the store, and a
parent that cannot deliver to a child within :data:`wire.STEP_TIMEOUT` (dead: refused; frozen: no
greeting) delivers to the child's children itself: one stopped rank never cuts off its subtree.

The same tree carries the rest of a failure back and forth (:mod:`hpcring.diagnostics.watchdog`):
each message names its ``kind``. ``trigger`` goes down (with ``up``, the sender's own address, so
the receiver knows where to answer), ``gather`` comes up (a subtree's snapshots, merged at every
hop), ``report`` goes down, and in abort mode ``ack`` comes up and ``exit`` goes down: the store on
rank 0 then sees one connection per failure, not one per rank.

The messages themselves, and how they are authenticated: :mod:`hpcring.diagnostics.watchdog.wire`
(sending) and :mod:`hpcring.diagnostics.watchdog.listener` (receiving).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from hpcring.diagnostics.watchdog import wire

log = logging.getLogger("hpcring.diagnostics.fanout")     # its name before the move (a logging config may name it)

RETRY_STEPS = 3               # a later round's second try at a rank the first could not reach: 3 steps


# ------------------------------------------------------------------------------------- the tree

RADIX = 8


def span(v: int, n: int) -> int:
    """Size bound of ``v``'s subtree: RADIX to the number of ``v``'s trailing zero digits (n for
    the root)."""
    if v == 0:
        return n
    s = 1
    while v % (s * RADIX) == 0:
        s *= RADIX
    return s


def children(v: int, n: int) -> list[int]:
    """Children of relative index ``v`` in an ``n``-rank tree, the largest subtree first."""
    out, step, top = [], 1, span(v, n)
    while step < top:
        out += [v + j * step for j in range(1, RADIX) if v + j * step < n]
        step *= RADIX
    return out[::-1]


def subtree(v: int, n: int) -> range:
    """The relative indices under ``v`` (``v`` included)."""
    return range(v, min(n, v + span(v, n)))


def levels(size: int) -> int:
    """Levels below the top of a subtree of ``size`` ranks, at most: the base-RADIX digits of
    ``size - 1`` (a child's is always less than its parent's)."""
    m, out = size - 1, 0
    while m > 0:
        m, out = m // RADIX, out + 1
    return out


def depth(n: int) -> int:
    """Hops from the root to the farthest rank: the most non-zero base-RADIX digits of an index
    below n: L = digits of n - 1, or L - 1 when 11...1 (L ones) is not below n."""
    top = levels(n)
    return top if top and (RADIX ** top - 1) // (RADIX - 1) <= n - 1 else max(0, top - 1)


# --------------------------------------------------------------------------------- forwarding

def message(root: int, n: int, v: int, addrs: list, trig: dict, up: str | None = None) -> bytes:
    """The trigger's body for relative index ``v``: the trigger, the addresses of ``v``'s subtree
    (``addrs`` indexed from ``v``) and ``up``, the sender's listener (where ``v`` answers)."""
    return wire.pack({"kind": "trigger", "root": root, "n": n, "v": v, "trig": trig, "addrs": addrs, "up": up})


def forward(root: int, n: int, v: int, addrs: list, trig: dict, secret: bytes,
            step_timeout: float | None = None, delivered: list | None = None,
            on_reply: Callable[[int, bytes], None] | None = None) -> list[int]:
    """Deliver the trigger to ``v``'s children (``addrs``: addresses of ``subtree(v)``, from
    ``v`` on, None where unknown; ``addrs[0]``, this rank's own, is sent along as ``up``), to all
    at once (:func:`wire.send_many`: a frozen child costs the step timeout once, not per sibling),
    taking over the subtree of a child that cannot be reached. Appends ``(relative index, address)`` of every rank it
    delivered to (this rank's children in the tree as it stands) to ``delivered``, and calls
    ``on_reply(relative index, reply)`` for every non-empty reply (a leaf's snapshot). Returns
    (once every branch is done) the relative indices that could not be reached at all."""
    up = addrs[0] if addrs else None
    step_timeout = wire.step() if step_timeout is None else step_timeout
    return _spread(n, v, addrs, children(v, n), lambda c, block: message(root, n, c, block, trig, up),
                   secret, step_timeout, delivered, on_reply)


def relay(n: int, v: int, addrs: list, kids: list[int], body: bytes, secret: bytes,
          step_timeout: float | None = None) -> list[int]:
    """A later round down the tree (the report, the exit): ``body`` to ``kids`` (relative
    indices: ``v``'s children), covering the subtree of one that cannot be reached now (it died
    or stalled since) as :func:`forward` does, then trying each rank it could not reach once more
    with :data:`RETRY_STEPS` times the step timeout: it answered the trigger, so it is more
    likely starved than gone, and otherwise waits for its own fallback (the store, seconds
    later). Returns the relative indices not reached."""
    step_timeout = wire.step() if step_timeout is None else step_timeout
    lost = _spread(n, v, addrs, kids, lambda c, block: body, secret, step_timeout, None)
    if not lost:
        return lost
    retry = [c for c in lost if 0 <= c - v < len(addrs) and addrs[c - v]]
    errors = wire.send_many([(addrs[c - v], body) for c in retry], secret, RETRY_STEPS * step_timeout)
    return sorted({c for c in lost if c not in retry} | {c for c, e in zip(retry, errors) if e is not None})


def _spread(n: int, v: int, addrs: list, first: list[int], body_for, secret: bytes, step_timeout: float,
            delivered: list | None, on_reply: Callable[[int, bytes], None] | None = None) -> list[int]:
    """Deliver to ``first`` (relative indices) at once (:func:`wire.send_many`), then to the children
    of each that could not be reached, level by level. Returns the relative indices not reached."""
    lost: list[int] = []
    todo = list(first)
    while todo:
        jobs, sent, later = [], [], []
        for c in todo:
            addr = addrs[c - v] if 0 <= c - v < len(addrs) else None
            if addr:
                jobs.append((addr, body_for(c, addrs[c - v:c - v + len(subtree(c, n))])))
                sent.append(c)
            else:
                lost.append(c)
                later += children(c, n)    # its children, in the next batch (largest first)
        replies: list[bytes] = []
        for c, (addr, _), err, reply in zip(sent, jobs, wire.send_many(jobs, secret, step_timeout, replies), replies):
            if err is None:
                if delivered is not None:
                    delivered.append((c, addr))
                if reply and on_reply is not None:
                    on_reply(c, reply)
                continue
            log.info("watchdog fan-out: relative rank %d at %s unreachable (%s); covering its subtree", c, addr, err)
            lost.append(c)
            later += children(c, n)
        todo = later
    return sorted(lost)
