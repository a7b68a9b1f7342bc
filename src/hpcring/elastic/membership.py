"""Who is in the next round: the coordinator's decisions as pure functions (no store, no clock).

A *round* is one communicator's lifetime: its members in rank order. The coordinator
(:mod:`hpcring.elastic.coordinator`) keeps one :class:`Worker` per process that ever asked to
join, and calls :func:`decide` on every tick with what it knows now:

* the first round forms once ``start_np`` workers wait (Horovod: the job starts with ``-np``
  slots), at most ``max_np`` of them, in the order they asked;
* a later round forms once every live member of the current round asks again (after a failed
  collective, or a :class:`HostsUpdatedInterrupt`) and at least one of them did, or a member was
  lost; its members are the live old members in their old rank order (the oldest first, so the
  new rank 0 holds the most recent state, as Horovod promises), then waiting newcomers in the
  order they asked, at most ``max_np``;
* with fewer than ``min_np`` candidates the round waits for newcomers (until the coordinator's
  timeout);
* newcomers waiting while a round runs with room (< ``max_np``) are announced to the members
  (``added``): their next ``state.commit()`` / ``check_host_updates()`` raises
  HostsUpdatedInterrupt, they ask again and the next round takes the newcomers in;
* ``reset_limit``: the number of rounds after the first that may form; one more is an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ALIVE, DEAD, LEFT = "alive", "dead", "left"
# HostUpdateResult of Horovod (an IntFlag there): what changed since the last notification
NO_UPDATE, REMOVED, ADDED = 0, 1, 2


@dataclass
class Worker:
    wid: str
    seq: int                      # order of its first request (older workers first)
    host: str
    status: str = ALIVE
    waiting: bool = False         # it asked to join and no round took it yet
    reason: str = "start"         # why it asked last: start, error, interrupt
    why: str = ""                 # why it is dead


@dataclass
class Decision:
    action: str                           # "wait", "form", "error", "finished" (the job is done)
    members: list[str] = field(default_factory=list)
    message: str = ""
    notify: int = NO_UPDATE               # announce to the current members (ADDED), else nothing
    abort: bool = False                   # the current round is lost: abort its collectives


def live(workers: dict[str, Worker], wids) -> list[str]:
    return [w for w in wids if workers[w].status == ALIVE]


def newcomers(workers: dict[str, Worker], members: list[str]) -> list[str]:
    """Waiting workers that are not members, oldest request first."""
    inside = set(members)
    return sorted((w.wid for w in workers.values() if w.waiting and w.status == ALIVE and w.wid not in inside),
                  key=lambda wid: workers[wid].seq)


def decide(workers: dict[str, Worker], round_no: int, members: list[str], *, start_np: int, min_np: int,
           max_np: int, resets: int, reset_limit: int | None, waited_s: float, timeout_s: float) -> Decision:
    """What to do now. ``members``: the current round's, in rank order (empty before the first).
    ``waited_s``: how long a round has been due without forming (0 while none is due)."""
    new = newcomers(workers, members)
    if round_no == 0:
        if len(new) >= start_np:
            return Decision("form", new[:max_np])
        if waited_s > timeout_s:
            return Decision("error", message=(
                f"only {len(new)} of {start_np} workers asked to join within {timeout_s:g} s "
                f"(HPCRING_ELASTIC_TIMEOUT)"))
        return Decision("wait")
    alive = live(workers, members)
    lost = len(alive) < len(members) and any(workers[m].status == DEAD for m in members)
    asked = [m for m in alive if workers[m].waiting]
    failed = any(workers[m].reason == "error" for m in asked)
    if not alive:       # every member ended: finished (left), or lost
        if new and any(workers[m].status == DEAD for m in members):
            return Decision("error", message=(
                f"every member of round {round_no} ended ({', '.join(members)}), some lost: no worker holds "
                f"the committed state to hand to {', '.join(new)}"))
        if new:
            return Decision("finished", message=(
                f"every member of round {round_no} finished; {', '.join(new)} came too late to join"))
        return Decision("wait")
    if not asked and not lost:
        # a steady round: announce newcomers it has room for
        notify = ADDED if new and len(alive) < max_np else NO_UPDATE
        return Decision("wait", notify=notify)
    if len(asked) < len(alive):
        # some live members have not come back yet: a lost member or a failed collective means
        # they cannot finish this round's collectives, so break them out of it
        return Decision("wait", abort=lost or failed)
    if reset_limit is not None and resets >= reset_limit:
        return Decision("error", message=f"the job was reset {resets} times, which reaches the reset limit "
                                          f"{reset_limit} (--reset-limit)", abort=True)
    candidates = (alive + new)[:max_np]
    if len(candidates) < min_np:
        if waited_s > timeout_s:
            return Decision("error", message=(
                f"{len(candidates)} workers are left, fewer than min_np {min_np}, and no other worker "
                f"asked to join within {timeout_s:g} s (HPCRING_ELASTIC_TIMEOUT)"), abort=True)
        return Decision("wait", abort=lost or failed)
    return Decision("form", candidates)
