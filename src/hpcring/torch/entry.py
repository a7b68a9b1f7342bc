"""One submitted operation (:class:`Entry`) and the handles that ``*_async`` returns.

An entry's *signature* (kind, dtype, shape, op, scale factors, root, device type) must be the same
on every rank for its name; its *fusion key* (the signature without the shape) decides which ready
entries share one fusion buffer. Both are hashed to 63-bit integers for the negotiation messages.
"""
from __future__ import annotations

import functools
import hashlib
import threading
import time
from typing import Any

import torch

from hpcring.collectives.dtypes import torch_dtypes
from hpcring.torch.exceptions import HorovodInternalError

KINDS = ("allreduce", "broadcast", "allgather", "alltoall", "reducescatter", "barrier", "join")
FUSABLE = ("allreduce", "broadcast")
# every torch dtype an operation may carry (reductions: see executor.reduce_dtype)
DTYPES = tuple(d for d in (
    *torch_dtypes(torch),           # the communicator's own first, in its table's order
    torch.int8, torch.int16, torch.bool, torch.complex64, torch.complex128,
    getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None)
DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in DTYPES}


@functools.lru_cache(maxsize=65536)     # the same names and signatures recur every step
def h63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def dtype_code(dt) -> int:
    return DTYPES.index(dt) if dt in DTYPES else 255


def dtype_name(code: int) -> str:
    return DTYPE_NAMES[DTYPES[code]] if code < len(DTYPES) else "?"


class AsyncHandle:
    """What ``*_async`` returns; pass it to :func:`hpcring.torch.synchronize` / ``poll``.

    ``wait`` never blocks without a bound: it checks every half second that the engine that owns
    the operation is still alive and making progress (:meth:`Engine.check_alive`), so a dead
    engine or a frozen peer ends the wait with the engine's report instead of a silent hang."""

    __slots__ = ("name", "_event", "_result", "_error", "_finish", "_engine")

    def __init__(self, name: str, finish=None, engine=None) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finish = finish          # result post-processing in the waiting thread (decompress)
        self._engine = engine

    def _set(self, result=None, error: BaseException | None = None) -> None:
        if self._event.is_set():
            return
        self._result, self._error = result, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise HorovodInternalError(f"hpcring.torch: '{self.name}' did not finish within {timeout:.1f} s")
            if self._engine is not None:
                self._engine.check_alive(self)
        if self._error is not None:
            raise self._error
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


class GroupHandle(AsyncHandle):
    """A handle over several (grouped operations): the result is the list of their results."""

    __slots__ = ("members",)

    def __init__(self, name: str, members: list[AsyncHandle]) -> None:
        super().__init__(name)
        self.members = members

    def done(self) -> bool:
        return all(h.done() for h in self.members)

    def wait(self, timeout: float | None = None):
        results, first = [], None
        for h in self.members:           # wait for all, then raise the first error
            try:
                results.append(h.wait(timeout))
            except BaseException as err:  # noqa: BLE001
                results.append(None)
                first = first or err
        if first is not None:
            raise first
        return results


class Entry:
    """One submitted operation. ``tensor``: the input (contiguous); ``output``: where an
    allreduce/broadcast result goes (written in place, may be ``tensor``). ``name`` None: the
    engine gives it its automatic name when it accepts it (:meth:`Engine.submit`)."""

    __slots__ = ("name", "kind", "tensor", "output", "op", "pre", "post", "root", "splits", "handle",
                 "t_queued", "name_hash", "sig_hash", "fuse_hash", "numel", "nbytes", "code", "stream",
                 "held", "pset", "auto")

    def __init__(self, name: str | None, kind: str, tensor, output=None, *, op: str = "sum", pre: float = 1.0,
                 post: float = 1.0, root: int = -1, splits=None, pset: int = 0) -> None:
        self.kind, self.tensor, self.output = kind, tensor, output
        self.op, self.pre, self.post, self.root, self.splits = op, pre, post, root, splits
        self.pset = pset
        self.handle = AsyncHandle(name)
        self.name, self.name_hash = None, 0
        self.auto = None               # (kind, n): the automatic name it took (Engine.take_auto)
        if name is not None:
            self.set_name(name)
        self.t_queued = time.time()
        dt = tensor.dtype if tensor is not None else torch.uint8
        dev = tensor.device.type if tensor is not None else "-"
        # allgather / alltoall first dims may differ between ranks: not part of the signature
        shape = tuple(tensor.shape[1:]) if kind in ("allgather", "alltoall") and tensor is not None \
            else tuple(tensor.shape) if tensor is not None else ()
        fuse = f"{kind}|{dt}|{dev}|{op}|{pre!r}|{post!r}|{root}"
        self.fuse_hash = h63(fuse)
        self.sig_hash = h63(f"{fuse}|{shape}")
        self.numel = tensor.numel() if tensor is not None else 0
        self.nbytes = self.numel * tensor.element_size() if tensor is not None else 0
        self.code = KINDS.index(kind) * 256 + dtype_code(dt)
        self.held = False              # set by Engine.submit: an optimizer expects it, on the host
        self.stream = None
        if tensor is not None and tensor.is_cuda:
            self.stream = torch.cuda.current_stream(tensor.device)

    def set_name(self, name: str) -> None:
        self.name = self.handle.name = name
        self.name_hash = h63(name)

    def describe(self) -> str:
        dt = DTYPE_NAMES.get(self.tensor.dtype, "?") if self.tensor is not None else "-"
        return f"'{self.name}' ({self.kind}, {self.numel} x {dt})"


class StandIn(Entry):
    """A joined rank's part in an allreduce the other ranks run: zeros of the negotiated size and
    dtype, under the negotiated fusion key (so it fuses exactly as the other ranks' entry)."""

    def __init__(self, name_hash: int, numel: int, code: int, fuse_hash: int) -> None:
        z = torch.zeros(numel, dtype=DTYPES[code % 256])
        super().__init__(f"joined#{name_hash:x}", "allreduce", z, z)
        self.name_hash, self.fuse_hash = name_hash, fuse_hash
