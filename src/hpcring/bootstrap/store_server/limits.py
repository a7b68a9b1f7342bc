"""The store's descriptor limits: the soft RLIMIT_NOFILE raised to what the job's connections need."""
from __future__ import annotations

import logging

from hpcring.bootstrap.store_wire import FD_RESERVE
from hpcring.errors import BootstrapError

log = logging.getLogger("hpcring.bootstrap.store")


def _fd_limit() -> int:
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, OSError, ValueError):
        return 1024


CONNECTIONS_PER_RANK = 3   # init's client, the watchdog's listener and its action client


def fd_need(clients: int) -> int:
    """Descriptors a store serving ``clients`` connections needs in its process (one per
    connection, plus the reserve for the rest of rank 0)."""
    return clients + FD_RESERVE + 16


def ensure_fd_limit(clients: int, *, ranks: int | None = None, required: int | None = None) -> int:
    """Raise this process's soft RLIMIT_NOFILE so that ``clients`` store connections fit; returns
    the soft limit now in force. The soft limit is only raised (never lowered), and only as far
    as needed, capped by the hard limit. When even ``required`` connections (default: all of
    them; the job's rendezvous needs one per rank) cannot fit, raises BootstrapError naming the
    limit, the job size and what to do; when only the later ones (watchdog) cannot, warns so.
    """
    need, need_min = fd_need(clients), fd_need(clients if required is None else required)
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    inf = resource.RLIM_INFINITY
    if soft == inf or soft >= need:
        return soft if soft != inf else 1 << 20
    target = need if hard == inf else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("store: raised the soft descriptor limit (RLIMIT_NOFILE) from %d to %d for %d "
                     "connections", soft, target, clients)
            soft = target
        except (OSError, ValueError) as e:
            log.warning("store: could not raise RLIMIT_NOFILE from %d to %d: %s", soft, target, e)
    if soft >= need:
        return soft
    who = (f"a job of {ranks} ranks ({CONNECTIONS_PER_RANK} store connections each with the watchdog, "
           f"{clients} in all)") if ranks is not None else f"{clients} store connections"
    msg = (f"rank 0's descriptor limit is too low for the rendezvous store: RLIMIT_NOFILE is "
           f"{soft} (soft) / {'unlimited' if hard == inf else hard} (hard); {who} needs about {need}")
    hint = (f"raise the limit before starting the ranks: `ulimit -n {need}` in the job script (up "
            f"to the hard limit, `ulimit -Hn`), or ask the site to raise the hard limit "
            f"(/etc/security/limits.conf nofile, or the limits the scheduler propagates, e.g. "
            f"Slurm's PropagateResourceLimits)")
    if soft < need_min:
        raise BootstrapError(msg, hint=hint)
    log.warning("store: %s; the rendezvous fits (%d needed), connections beyond the limit will wait "
                "and may time out. Hint: %s", msg, need_min, hint)
    return soft
