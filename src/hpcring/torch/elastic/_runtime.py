"""What ``hvd.init()``/``hvd.shutdown()`` and ``hvd.elastic.run`` share in elastic mode: the
round this process is in, why it asks for the next one, and the states that hear notifications."""
from __future__ import annotations

import threading

from hpcring.elastic import member as _member, session as _session

_lock = threading.Lock()
_listeners: set = set()
next_reason = "start"          # why the next init() asks to join: start, error, interrupt


def enabled() -> bool:
    return _member.enabled()


def join():
    """The next round's Session (blocks until a round takes this worker)."""
    global next_reason
    reason, next_reason = next_reason, "start"
    s = _session.join(reason)
    m = _member.current()
    m.listeners = _notify
    return s


def leave(session) -> None:
    _session.leave_round(session)


def answered_update() -> int:
    """The newest notification the current round already took into account (0 outside elastic)."""
    if not enabled() or _member._MEMBER is None or _member._MEMBER.round is None:
        return 0
    return _member._MEMBER.round.updated


def listen(state) -> None:
    with _lock:
        _listeners.add(state)
    if enabled() and _member._MEMBER is not None:
        stamp, res = _member._MEMBER.updated
        if stamp > answered_update():
            state.on_hosts_updated(stamp, res)


def unlisten(state) -> None:
    with _lock:
        _listeners.discard(state)


def _notify(stamp: int, res: int) -> None:
    with _lock:
        states = list(_listeners)
    for s in states:
        s.on_hosts_updated(stamp, res)


def round_needs_sync() -> bool:
    """Whether the current round must sync even after a removal-only interrupt: some member came
    from a failure (it restored its commit) or is new, so ranks skipping it would diverge."""
    m = _member._MEMBER
    return bool(enabled() and m is not None and m.round is not None and m.round.sync)
