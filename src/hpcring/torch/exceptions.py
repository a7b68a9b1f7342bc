"""Horovod's exception classes (``horovod.common.exceptions``), in hpcring's family.

Horovod raises :class:`HorovodInternalError` (a ``RuntimeError``) for an operation that failed
(differs across ranks, stalled, a joined rank cannot take part, the communicator failed) and
``ValueError`` for a bad argument. Here each is also an :class:`~hpcring.errors.HpcringError`, so
the message keeps hpcring's diagnosis (tensor names, ranks, hosts) and ``hint``, and both
``except RuntimeError`` / ``except ValueError`` (Horovod code) and ``except CollectiveError`` /
``except UsageError`` (hpcring code) catch them.
"""
from __future__ import annotations

from hpcring.errors import CollectiveError, UsageError


class HorovodInternalError(CollectiveError, RuntimeError):
    """An operation failed (Horovod: the op's status was an error)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic mode: the set of workers changes (newcomers wait to join). ``state.commit()`` /
    ``check_host_updates()`` raise it on every rank at the same call; ``hvd.elastic.run`` then
    resets without restoring the last commit, and skips the sync when ``skip_sync``."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class TensorMismatchError(HorovodInternalError):
    """The same name was submitted with a different kind, shape, dtype, op, scale or root."""


class StallError(HorovodInternalError):
    """Operation names did not match across ranks within the deadline."""


class JoinedRankError(HorovodInternalError):
    """An operation other ranks ran while a rank had joined, of a kind join cannot stand in for."""


class InvalidArgumentError(UsageError, ValueError):
    """A bad argument (Horovod: ValueError)."""


class NotSupportedError(UsageError, NotImplementedError, ValueError):
    """A feature hpcring.torch does not implement (Adasum). Horovod raises NotImplementedError (a
    RuntimeError) for the Adasum set-ups it cannot run, and its tests catch RuntimeError; it is a
    ValueError too, as it was documented before."""


class InvalidTypeError(UsageError, TypeError):
    """An argument of the wrong type (Horovod: TypeError)."""


def internal(err: BaseException) -> HorovodInternalError:
    """``err`` as a HorovodInternalError (kept when it already is one), message and hint kept."""
    if isinstance(err, HorovodInternalError):
        return err
    msg = getattr(err, "message", None) or f"{type(err).__name__}: {err}"
    out = HorovodInternalError(msg, hint=getattr(err, "hint", None))
    out.__cause__ = err
    return out


class InvalidStateError(UsageError, AssertionError):
    """A call out of order (Horovod: AssertionError), e.g. zero_grad() between backward() and step()."""
