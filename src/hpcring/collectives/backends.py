"""The small interface every collective backend implements (ring, MPI, NCCL).

A backend moves bytes of contiguous 1-D buffers; all shape handling, dtype mapping, DLPack,
async execution and error wording live in :mod:`hpcring.collectives.api`. Contract for every
method:

* buffers are 1-D C-contiguous arrays of the backend's memory kind (``device``: ``"cpu"`` means
  numpy arrays in host memory; ``"cuda"`` means CuPy arrays on the backend's GPU ``device_id``,
  with its CuPy module as ``array_module``, and numpy buffers which the backend stages itself);
  a ``"cuda"`` backend runs each op on the current CuPy stream and returns when it completed;
* ``dtype`` is one of :data:`DTYPES` (bfloat16 buffers are uint16 storage), ``op`` one of
  :data:`OPS` (``avg`` only for floating-point dtypes): :mod:`hpcring.collectives.dtypes`;
* ``timeout`` is the deadline in seconds for this call (> 0);
* failures raise :class:`hpcring.errors.CollectiveError` whose message names the operation, the
  peer rank and its host; after a failure the backend is dead (``error`` keeps the first message)
  and every later call fails the same way.
"""
from __future__ import annotations

import abc

from hpcring.collectives.dtypes import DTYPES, FLOAT_DTYPES, ITEMSIZE, OPS  # noqa: F401 - the backends' names
from hpcring.errors import CollectiveError


class Backend(abc.ABC):
    """One communicator's transport and algorithms."""

    name: str = "abstract"
    device: str = "cpu"

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def error(self) -> str | None:
        """The first (sticky) failure, or None while healthy."""
        return None

    @abc.abstractmethod
    def allreduce(self, sendbuf, recvbuf, dtype: str, op: str, timeout: float) -> None:
        """recvbuf = OP over ranks of sendbuf (same length; sendbuf is recvbuf for in place)."""

    @abc.abstractmethod
    def allgather(self, sendbuf, recvbuf, dtype: str, timeout: float) -> None:
        """recvbuf (size * len(sendbuf)) = the ranks' sendbufs in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, sendbuf, recvbuf, dtype: str, op: str, timeout: float) -> None:
        """recvbuf = this rank's chunk of OP over ranks of sendbuf; chunk r has
        len // size + (r < len % size) elements (see :func:`chunk_counts`)."""

    @abc.abstractmethod
    def broadcast(self, buf, root: int, dtype: str, timeout: float) -> None:
        """buf on every rank = buf on root."""

    @abc.abstractmethod
    def alltoall(self, sendbuf, recvbuf, dtype: str, timeout: float) -> None:
        """Block j of sendbuf goes to rank j; block i of recvbuf comes from rank i
        (len divisible by size; sendbuf may be recvbuf)."""

    @abc.abstractmethod
    def barrier(self, timeout: float) -> None:
        """Return once every rank has entered."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; idempotent."""


class LibraryBackend(Backend):
    """What the MPI and NCCL backends share: a library's communicator (mpi4py's, CuPy's NCCL one)
    under hpcring's deadline, a per-backend sequence number, and a sticky first error
    (``_error``)."""

    label = "?"            # "MPI", "NCCL": used in error messages

    def _init_state(self, rank: int, size: int, hosts) -> None:
        self._rank, self._size = rank, size
        self._hosts = tuple(hosts) if hosts else None
        self._seq = 0
        self._error: str | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def error(self) -> str | None:
        return self._error

    def _host(self, default: str = "?") -> str:
        return self._hosts[self._rank] if self._hosts and self._rank < len(self._hosts) else default

    def _begin(self, name: str) -> int:
        """Next sequence number for collective ``name``; raises the sticky error of a failed or
        closed communicator."""
        if self._error is not None:
            raise CollectiveError(self._error, hint=f"the {self.label} communicator failed earlier "
                                                    "(it cannot be reused); restart the job")
        if self._closed:
            raise CollectiveError(f"{name}: the {self.label} communicator is closed")
        self._seq += 1
        return self._seq

    @staticmethod
    def _lazy_desc(count: int, dtype: str, op: str | None = None, root: int | None = None) -> "LazyDesc":
        """:meth:`_desc`, formatted only when a message uses it (hot paths build one per call)."""
        return LazyDesc(count, dtype, op, root)

    @staticmethod
    def _desc(count: int, dtype: str, op: str | None = None, root: int | None = None) -> str:
        """``(count=.., dtype=.., N bytes, op=.., root=..)`` for error messages."""
        parts = [f"count={count}", f"dtype={dtype}", f"{count * ITEMSIZE.get(dtype, 1)} bytes"]
        if op is not None:
            parts.append(f"op={op}")
        if root is not None:
            parts.append(f"root={root}")
        return "(" + ", ".join(parts) + ")"


class LazyDesc:
    """``(count=.., dtype=.., N bytes, op=.., root=..)`` of :meth:`LibraryBackend._desc`, as a str
    when formatted."""

    __slots__ = ("count", "dtype", "op", "root")

    def __init__(self, count, dtype, op=None, root=None) -> None:
        self.count, self.dtype, self.op, self.root = count, dtype, op, root

    def __str__(self) -> str:
        return LibraryBackend._desc(self.count, self.dtype, self.op, self.root)

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def chunk_counts(count: int, size: int) -> list[int]:
    """Element counts of the reduce-scatter chunks (the first count % size get one more)."""
    base, extra = divmod(count, size)
    return [base + (1 if r < extra else 0) for r in range(size)]
