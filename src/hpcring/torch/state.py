"""The process-wide hpcring.torch state: session, communicator and engine (set by ``init``)."""
from __future__ import annotations

from hpcring.torch.exceptions import InvalidArgumentError

_engine = None
_session = None


def engine():
    if _engine is None:
        raise InvalidArgumentError("hpcring.torch is not initialized", hint="call hvd.init() first")
    return _engine


def session():
    if _session is None:
        raise InvalidArgumentError("hpcring.torch is not initialized", hint="call hvd.init() first")
    return _session


def set_state(session_, engine_) -> None:
    global _engine, _session
    _session, _engine = session_, engine_
