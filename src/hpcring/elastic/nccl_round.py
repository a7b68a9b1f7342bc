"""An elastic round's NCCL communicator: the last round's, shrunk, when only ranks were lost;
a new one otherwise.

``ncclCommShrink`` (NCCL >= 2.27) makes the survivors' communicator from the old one without a
new unique id or a full bootstrap, renumbering them in their old order. The coordinator forms a
round as the live members in their old order, then newcomers (membership.decide), so when a round
has no newcomers its ranks are exactly the order a shrink gives. Otherwise (newcomers, a first
round, an NCCL without the symbol, a communicator that was aborted and so freed) every rank makes
a new one through the round's store (``ncclCommInitRank``).

Every rank of a round must take the same path (a shrink and an init do not meet), so each rank
that cannot shrink says so under the round's key before a store barrier; one "no" means a new
communicator everywhere. That costs each rank one add, one barrier and one check: O(1) per rank.

A failure in a round revokes the communicator (``ncclCommRevoke``: its operations end, it stays
valid) instead of aborting it, so the next round can shrink it; the shrink itself passes
NCCL_SHRINK_ABORT for an NCCL without revoke.
"""
from __future__ import annotations

import logging
import threading

from hpcring.collectives import nccl_raw
from hpcring.collectives.api import Communicator
from hpcring.collectives.nccl import NcclBackend

log = logging.getLogger("hpcring.elastic.nccl")

_lock = threading.Lock()
_previous: tuple[tuple[str, ...], object] | None = None   # (members in rank order, NcclBackend)


def plan(previous: tuple[str, ...] | list[str] | None, members: tuple[str, ...] | list[str]) -> list[int] | None:
    """The previous round's ranks to exclude, when ``members`` are its survivors in their old
    order and at least one was lost; else None (a new communicator)."""
    if not previous:
        return None
    now = set(members)
    if [m for m in previous if m in now] != list(members):
        return None             # newcomers, or another order
    lost = [r for r, m in enumerate(previous) if m not in now]
    return lost or None


def keep(members, backend) -> None:
    """Hold this round's NCCL backend (closed by its Communicator with ``keep_backend``) for the
    next round's shrink; a backend held before is freed."""
    global _previous
    with _lock:
        old, _previous = _previous, (tuple(members), backend)
    if old is not None:
        _free(old[1])


def release() -> None:
    """Free the held backend, if any (a round that builds a new communicator)."""
    global _previous
    with _lock:
        old, _previous = _previous, None
    if old is not None:
        _free(old[1])


def _free(backend) -> None:
    try:
        backend.close()
    except Exception as e:  # noqa: BLE001 - freeing an old communicator must not fail a round
        log.warning("closing the previous round's NCCL communicator failed: %s", e)


def _take():
    global _previous
    with _lock:
        prev, _previous = _previous, None
    return prev


def build(topology, store, secret, members, prefix: str, timeout: float) -> tuple[Communicator, str]:
    """The round's NCCL Communicator and how it was made ("shrunk" or "new"). Collective."""
    prev = _take()
    try:
        exclude = plan(prev[0] if prev else None, members)
        lib = nccl_raw.load() if exclude is not None else None
        able = exclude is not None and nccl_raw.has_shrink(lib) and not getattr(prev[1], "_freed", True)
        if not able:
            store.add(f"{prefix}/nccl-noshrink", 1)
        store.barrier(f"{prefix}/nccl-shrink-vote", topology.size, timeout=timeout)
    except BaseException:
        if prev is not None:
            _free(prev[1])
        raise
    try:
        if able and store.check(f"{prefix}/nccl-noshrink") is None:
            be, how = NcclBackend.shrink(prev[1], exclude, topology, timeout), "shrunk"
        else:
            if prev is not None:
                _free(prev[1])
            be, how = NcclBackend.create(topology, store, secret, timeout, prefix=f"nccl/{prefix}"), "new"
    except BaseException:
        if prev is not None:
            _free(prev[1])       # a failed shrink leaves the old communicator to free (once)
        raise
    be.keep_for_shrink = True
    return Communicator(be, timeout=timeout), how


__all__ = ["build", "keep", "plan", "release"]
