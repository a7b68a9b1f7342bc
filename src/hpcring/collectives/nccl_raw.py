"""NCCL calls CuPy does not bind, on the library CuPy loaded: ``ncclCommShrink`` (NCCL >= 2.27)
and a communicator object over a raw ``ncclComm_t``.

CuPy's ``NcclCommunicator`` can only be made by ``ncclCommInitRank`` (or split); a communicator
that ``ncclCommShrink`` returns is a bare pointer. :class:`RawComm` wraps one with the methods
:class:`hpcring.collectives.nccl.NcclBackend` calls on CuPy's (same names, same arguments), so the
backend runs on either. The prototypes below are nccl.h's (tests/unit/test_nccl_shrink.py reads
the installed header and compares).

Why ctypes and not module.c: these calls are rare (a shrink per lost node; the data calls of a
shrunk communicator cost one ctypes call, about 1 us, where CuPy's cost about as much), and
building against nccl.h would make the C core need the CUDA wheels to compile.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time

from hpcring.errors import CollectiveError

SHRINK_DEFAULT = 0x00      # NCCL_SHRINK_DEFAULT
SHRINK_ABORT = 0x01        # NCCL_SHRINK_ABORT: end the parent's operations in flight first
SHRINK_MIN_VERSION = 22700
IN_PROGRESS = 7            # ncclInProgress

_c = ctypes
_P, _SZ, _I, _IP = _c.c_void_p, _c.c_size_t, _c.c_int, _c.POINTER(_c.c_int)
# name -> argtypes; every function returns ncclResult_t (int)
PROTOTYPES = {
    "ncclGetVersion": (_IP,),
    "ncclCommShrink": (_P, _IP, _I, _c.POINTER(_P), _P, _I),
    "ncclCommAbort": (_P,),
    "ncclCommRevoke": (_P, _I),
    "ncclCommDestroy": (_P,),
    "ncclCommGetAsyncError": (_P, _IP),
    "ncclCommCount": (_P, _IP),
    "ncclCommUserRank": (_P, _IP),
    "ncclAllReduce": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclReduceScatter": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclAllGather": (_P, _P, _SZ, _I, _P, _P),
    "ncclBroadcast": (_P, _P, _SZ, _I, _I, _P, _P),
    "ncclSend": (_P, _SZ, _I, _I, _P, _P),
    "ncclRecv": (_P, _SZ, _I, _I, _P, _P),
}


class NcclRawError(RuntimeError):
    """A non-zero ncclResult_t, with NCCL's own words (ncclGetErrorString, ncclGetLastError)."""

    def __init__(self, call: str, status: int, text: str) -> None:
        super().__init__(f"{call}: {text} (ncclResult_t {status})")
        self.call, self.status = call, status


def library_path() -> str | None:
    """Where nvidia-nccl-cu12 put libnccl.so.2 (what CuPy preloads), or None."""
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(base, "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    return None


_lib = None
_lib_lock = threading.Lock()


def load(path: str | None = None):
    """The libnccl CuPy uses (its soname when already loaded, else the wheel's file), with the
    prototypes set on every function it has; None when there is no libnccl."""
    global _lib
    if path is None and _lib is not None:
        return _lib
    with _lib_lock:
        lib = None
        for name in ([path] if path else ["libnccl.so.2", library_path()]):
            if not name:
                continue
            try:
                lib = _c.CDLL(name, mode=_c.RTLD_GLOBAL)
                break
            except OSError:
                continue
        if lib is None:
            return None
        for fn, args in PROTOTYPES.items():
            f = getattr(lib, fn, None)
            if f is not None:
                f.argtypes, f.restype = args, _c.c_int
        for fn in ("ncclGetErrorString", "ncclGetLastError"):
            f = getattr(lib, fn, None)
            if f is not None:
                f.restype = _c.c_char_p
        if getattr(lib, "ncclGetErrorString", None) is not None:
            lib.ncclGetErrorString.argtypes = (_I,)
        if getattr(lib, "ncclGetLastError", None) is not None:
            lib.ncclGetLastError.argtypes = (_P,)
        if path is None:
            _lib = lib
        return lib


def version(lib) -> int:
    v = _c.c_int(0)
    _check(lib, "ncclGetVersion", lib.ncclGetVersion(_c.byref(v)))
    return v.value


def has_shrink(lib) -> bool:
    """True when this libnccl exports ncclCommShrink (NCCL >= 2.27)."""
    return lib is not None and hasattr(lib, "ncclCommShrink")


def has_revoke(lib) -> bool:
    """True when this libnccl exports ncclCommRevoke (stops a communicator's operations and keeps
    it for a shrink, where ncclCommAbort frees it)."""
    return lib is not None and hasattr(lib, "ncclCommRevoke")


def revoke(lib, comm) -> None:
    """``ncclCommRevoke(comm, 0)``: the operations in flight end, the communicator stays valid
    for ``ncclCommShrink``. ``comm``: CuPy's NcclCommunicator or a RawComm."""
    ptr = int(comm.comm)
    _check(lib, "ncclCommRevoke", lib.ncclCommRevoke(ptr, 0), ptr)


def _check(lib, call: str, status: int, comm=None) -> None:
    if status == 0:
        return
    text = lib.ncclGetErrorString(status).decode(errors="replace") if hasattr(lib, "ncclGetErrorString") else "error"
    last = lib.ncclGetLastError(comm).decode(errors="replace") if comm and hasattr(lib, "ncclGetLastError") else ""
    raise NcclRawError(call, status, text + (f": {last}" if last else ""))


class RawComm:
    """A raw ``ncclComm_t`` with the methods of CuPy's ``NcclCommunicator`` that hpcring calls."""

    def __init__(self, lib, ptr: int) -> None:
        if not ptr:
            raise CollectiveError("NCCL returned a NULL communicator")
        self._lib, self._ptr = lib, int(ptr)

    @property
    def comm(self) -> int:
        return self._ptr

    def _int(self, fn: str) -> int:
        v = _c.c_int(0)
        _check(self._lib, fn, getattr(self._lib, fn)(self._ptr, _c.byref(v)), self._ptr)
        return v.value

    def size(self) -> int:
        return self._int("ncclCommCount")

    def rank_id(self) -> int:
        return self._int("ncclCommUserRank")

    def allReduce(self, send, recv, count, dtype, op, stream):
        _check(self._lib, "ncclAllReduce", self._lib.ncclAllReduce(send, recv, count, dtype, op, self._ptr, stream), self._ptr)

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        _check(self._lib, "ncclReduceScatter",
               self._lib.ncclReduceScatter(send, recv, count, dtype, op, self._ptr, stream), self._ptr)

    def allGather(self, send, recv, count, dtype, stream):
        _check(self._lib, "ncclAllGather", self._lib.ncclAllGather(send, recv, count, dtype, self._ptr, stream), self._ptr)

    def broadcast(self, send, recv, count, dtype, root, stream):
        _check(self._lib, "ncclBroadcast",
               self._lib.ncclBroadcast(send, recv, count, dtype, root, self._ptr, stream), self._ptr)

    def send(self, ptr, count, dtype, peer, stream):
        _check(self._lib, "ncclSend", self._lib.ncclSend(ptr, count, dtype, peer, self._ptr, stream), self._ptr)

    def recv(self, ptr, count, dtype, peer, stream):
        _check(self._lib, "ncclRecv", self._lib.ncclRecv(ptr, count, dtype, peer, self._ptr, stream), self._ptr)

    def check_async_error(self):
        v = _c.c_int(0)
        _check(self._lib, "ncclCommGetAsyncError", self._lib.ncclCommGetAsyncError(self._ptr, _c.byref(v)), self._ptr)
        if v.value not in (0, IN_PROGRESS):
            _check(self._lib, "async error", v.value, self._ptr)

    def abort(self):
        ptr, self._ptr = self._ptr, 0
        if ptr:
            _check(self._lib, "ncclCommAbort", self._lib.ncclCommAbort(ptr))

    def destroy(self):
        ptr, self._ptr = self._ptr, 0
        if ptr:
            _check(self._lib, "ncclCommDestroy", self._lib.ncclCommDestroy(ptr))


def shrink(lib, parent, exclude: list[int], *, timeout: float, abort: bool = True, on_timeout=None) -> RawComm:
    """``ncclCommShrink(parent, exclude, ...)`` under a deadline: the communicator of the parent's
    ranks not in ``exclude`` (renumbered in order), its configuration inherited. ``parent``: CuPy's
    NcclCommunicator or a RawComm (its ``comm`` pointer). ``abort``: NCCL_SHRINK_ABORT, for a
    parent whose operations may be stuck on a lost rank. Collective over the survivors.

    NCCL has no timeout, so the call runs on a helper thread; past ``timeout`` this thread aborts
    the parent (ncclCommAbort unblocks the call; ``on_timeout()`` instead of ``parent.abort()``
    when given, for an owner that tracks whether its communicator is freed) and raises, naming
    how long it waited."""
    if not has_shrink(lib):
        raise CollectiveError("this NCCL has no ncclCommShrink (needs NCCL >= 2.27)",
                              hint="pip install -U nvidia-nccl-cu12; hpcring falls back to a new communicator")
    ptr = int(parent.comm)
    ranks = sorted(set(int(r) for r in exclude))
    arr = (_c.c_int * max(1, len(ranks)))(*ranks)
    out = _P(0)
    box: dict = {}

    def call():
        box["status"] = lib.ncclCommShrink(ptr, arr, len(ranks), _c.byref(out), None,
                                           SHRINK_ABORT if abort else SHRINK_DEFAULT)

    t0 = time.monotonic()
    th = threading.Thread(target=call, name="hpcring-nccl-shrink", daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        try:
            (on_timeout or parent.abort)()
        except Exception:  # noqa: BLE001 - the error below says what matters
            pass
        th.join(min(10.0, max(1.0, timeout)))
        raise CollectiveError(f"ncclCommShrink (excluding ranks {ranks}) did not return within {timeout:g} s "
                              f"(waited {time.monotonic() - t0:.1f} s): another survivor is missing or stuck; "
                              f"the parent communicator was aborted",
                              hint="the elastic round fails and the next one builds a new communicator")
    try:
        _check(lib, "ncclCommShrink", box.get("status", -1), ptr)
    except NcclRawError as e:
        raise CollectiveError(f"ncclCommShrink (excluding ranks {ranks}) failed: {e}") from None
    return RawComm(lib, out.value)


__all__ = ["NcclRawError", "PROTOTYPES", "RawComm", "SHRINK_ABORT", "SHRINK_MIN_VERSION", "has_revoke", "has_shrink",
           "library_path", "load", "revoke", "shrink", "version"]
