"""Rendezvous data through the launcher's PMIx server (``srun --mpi=pmix``, jsrun, prterun).

The system's libpmix (Debian: libpmix2) through ctypes; no Python dependency. Only what the
address exchange needs: ``PMIx_Init``, ``PMIx_Put`` + ``PMIx_Commit``, ``PMIx_Fence`` collecting
data, ``PMIx_Get``, ``PMIx_Finalize``.

Layouts are those of PMIx's public ``pmix_common.h`` (v3 to v5 share them on LP64):
``pmix_proc_t`` = 256-byte namespace + u32 rank (260 bytes); ``pmix_value_t`` = u16 type + a
24-byte union (largest member ``pmix_envar_t``; 8-aligned) = 32 bytes; ``pmix_info_t`` = 512-byte
key + u32 flags + value = 552 bytes. tests/unit/test_pmix.py checks them against the header.

Authentication. PMIx's own security (munge/native) covers a client's socket to its local server;
the data between nodes travels over the launcher's channels (Slurm's pmix plugin: TCP between
slurmstepds), which we do not trust more than the network. So every value carries
``HMAC-SHA256(job secret, label | namespace | rank | key | value)``: a peer on the network that
rewrites or injects fence data cannot make a rank accept a host or a store address it did not
publish (it can only delay or break the rendezvous, which it can anyway by dropping packets), and a
value cannot be moved to another rank, key or job step. Rank 0's store address read from here is
then proved a second time by the store's mutual handshake.

Deadlines. ``PMIx_Init`` and ``PMIx_Fence`` can block forever (a server that never answers, a rank
that never arrives): both run in a daemon thread that the caller waits for with a deadline, and
the fence also carries ``PMIX_TIMEOUT`` so a server that honours it gives up on its own. On expiry
the caller gets a BootstrapError; the blocked thread is abandoned (it holds no Python locks) and the
PMIx client is not finalized (finalizing with a fence in flight can itself block).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence

from hpcring.errors import BootstrapError
from hpcring.ranks import each_on_host

log = logging.getLogger("hpcring.bootstrap.pmix")

# --- constants from pmix_common.h (PMIx 4.2; stable since v3) ---------------------------------
MAX_NSLEN = 255
MAX_KEYLEN = 511
RANK_WILDCARD = 0xFFFFFFFE          # UINT32_MAX - 1
PMIX_BOOL = 1
PMIX_STRING = 3
PMIX_INT = 6
PMIX_UINT32 = 14
PMIX_BYTE_OBJECT = 27
PMIX_GLOBAL = 3                     # pmix_scope_t: share with local and remote processes
PMIX_SUCCESS = 0
PMIX_ERR_TIMEOUT = -24
KEY_JOB_SIZE = b"pmix.job.size"
KEY_COLLECT_DATA = b"pmix.collect"
KEY_TIMEOUT = b"pmix.timeout"
KEY_HOSTNAME = b"pmix.hname"

MAC_LABEL = b"hpcring-pmix-v1"
MAC_LEN = 32
KEY_PREFIX = "hpcring."             # our keys, apart from PMIx's reserved "pmix." space
LIBRARY_NAMES = ("libpmix.so.2", "libpmix.so")
PROBE_BUDGET_S = 2.0                # after a fence timeout, how long to look for the missing ranks
PROBE_MAX_RANKS = 1024              # beyond this, one thread per rank costs more than it tells


class Proc(ctypes.Structure):
    _fields_ = [("nspace", ctypes.c_char * (MAX_NSLEN + 1)), ("rank", ctypes.c_uint32)]


class ByteObject(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Envar(ctypes.Structure):      # only here to give the union its real size (24 bytes)
    _fields_ = [("envar", ctypes.c_char_p), ("value", ctypes.c_char_p), ("separator", ctypes.c_char)]


class _ValueData(ctypes.Union):
    _fields_ = [("flag", ctypes.c_bool), ("string", ctypes.c_char_p), ("integer", ctypes.c_int),
                ("uint32", ctypes.c_uint32), ("uint64", ctypes.c_uint64), ("bo", ByteObject),
                ("ptr", ctypes.c_void_p), ("envar", _Envar)]


class Value(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint16), ("data", _ValueData)]


class Info(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char * (MAX_KEYLEN + 1)), ("flags", ctypes.c_uint32), ("value", Value)]


def present(environ: Mapping[str, str] | None = None) -> bool:
    """Did a PMIx-capable launcher start this process (namespace, rank and a server to talk to)?"""
    env = os.environ if environ is None else environ
    return bool(env.get("PMIX_NAMESPACE")) and bool(env.get("PMIX_RANK")) and any(
        k.startswith("PMIX_SERVER_URI") for k in env)


def load_library(path: str | None = None) -> ctypes.CDLL:
    """libpmix with the prototypes we call; BootstrapError naming what was tried when it is absent."""
    names = [path] if path else [*LIBRARY_NAMES, ctypes.util.find_library("pmix")]
    errors = []
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)   # its plugins resolve symbols in it
            break
        except OSError as e:
            errors.append(f"{name}: {e}")
    else:
        raise BootstrapError("cannot load libpmix: " + ("; ".join(errors) or "no library found"),
                             hint="install the system's PMIx client library (Debian: apt-get install libpmix2) "
                                  "or set HPCRING_RENDEZVOUS=store")
    try:
        sig = {
            "PMIx_Init": [ctypes.POINTER(Proc), ctypes.POINTER(Info), ctypes.c_size_t],
            "PMIx_Finalize": [ctypes.POINTER(Info), ctypes.c_size_t],
            "PMIx_Put": [ctypes.c_uint8, ctypes.c_char_p, ctypes.POINTER(Value)],
            "PMIx_Commit": [],
            "PMIx_Fence": [ctypes.POINTER(Proc), ctypes.c_size_t, ctypes.POINTER(Info), ctypes.c_size_t],
            "PMIx_Get": [ctypes.POINTER(Proc), ctypes.c_char_p, ctypes.POINTER(Info), ctypes.c_size_t,
                         ctypes.POINTER(ctypes.POINTER(Value))],
            "PMIx_Value_destruct": [ctypes.POINTER(Value)],
            "PMIx_Error_string": [ctypes.c_int],
            "PMIx_Get_version": [],
        }
        for fname, args in sig.items():
            fn = getattr(lib, fname)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        lib.PMIx_Value_destruct.restype = None
        lib.PMIx_Error_string.restype = ctypes.c_char_p
        lib.PMIx_Get_version.restype = ctypes.c_char_p
    except AttributeError as e:
        raise BootstrapError(f"{name} is not a usable PMIx client library: {e}",
                             hint="set HPCRING_RENDEZVOUS=store") from None
    return lib


def _bounded(fn, timeout: float, what: str):
    """Run the blocking foreign call ``fn`` with a deadline (ctypes drops the GIL while it runs)."""
    box: dict = {}

    def run():
        try:
            box["rc"] = fn()
        except BaseException as e:   # noqa: BLE001 - handed to the waiting thread
            box["exc"] = e
    t = threading.Thread(target=run, name=f"hpcring-pmix-{what.split()[0]}", daemon=True)
    t.start()
    t.join(max(0.0, timeout))
    if t.is_alive():
        raise _Expired(what)
    if "exc" in box:
        raise box["exc"]
    return box["rc"]


class _Expired(Exception):
    pass


def mac(secret: bytes, nspace: str, rank: int, key: str, value: bytes) -> bytes:
    msg = b"\0".join([MAC_LABEL, nspace.encode(), str(rank).encode(), key.encode()]) + b"\0" + value
    return hmac.new(secret, msg, hashlib.sha256).digest()


class PmixClient:
    """One process's PMIx client: publish values, fence, read every rank's (or one peer's).

    ``PmixClient(secret, timeout)`` initialises (bounded by ``timeout``); ``rank``, ``size`` and
    ``namespace`` are PMIx's view of this process. ``exchange(items, keys, ranks, timeout)`` is the
    batched operation the bootstrap uses: put + commit, one collecting fence, local gets.
    """

    def __init__(self, secret: bytes, timeout: float = 30.0, library: str | None = None):
        self.secret = secret
        self.lib = load_library(library)
        self.version = (self.lib.PMIx_Get_version() or b"?").decode(errors="replace")
        self.me = Proc()
        try:
            rc = _bounded(lambda: self.lib.PMIx_Init(ctypes.byref(self.me), None, 0), timeout, "init")
        except _Expired:
            raise BootstrapError(f"PMIx_Init did not return within {timeout:.0f} s (PMIx {self.version})",
                                 hint="the launcher's PMIx server is not answering; "
                                      "set HPCRING_RENDEZVOUS=store") from None
        self._check(rc, "PMIx_Init")
        self.namespace = self.me.nspace.decode()
        self.rank = int(self.me.rank)
        self._open = True
        self.size = self._job_size()

    # -- small helpers ------------------------------------------------------------------------
    def _err(self, rc: int) -> str:
        return f"{(self.lib.PMIx_Error_string(rc) or b'?').decode(errors='replace')} ({rc})"

    def _check(self, rc: int, what: str) -> None:
        if rc != PMIX_SUCCESS:
            raise BootstrapError(f"{what} failed: {self._err(rc)} (PMIx {self.version})",
                                 hint="set HPCRING_RENDEZVOUS=store to meet through hpcring's own store")

    def _proc(self, rank: int) -> Proc:
        p = Proc()
        p.nspace = self.namespace.encode()
        p.rank = rank
        return p

    def _get(self, rank: int, key: bytes, timeout: int | None = None) -> tuple[int, bytes | int] | None:
        """PMIx_Get as ``(type, bytes or int)``, copied out of PMIx's memory; None when absent.
        ``timeout`` (whole seconds) bounds a get that has to ask the peer's server (direct modex)."""
        out = ctypes.POINTER(Value)()
        proc = self._proc(rank)
        info, n = None, 0
        if timeout is not None:
            info, n = (Info * 1)(), 1
            info[0].key = KEY_TIMEOUT
            info[0].value.type = PMIX_INT
            info[0].value.data.integer = max(1, int(timeout))
        rc = self.lib.PMIx_Get(ctypes.byref(proc), key, info, n, ctypes.byref(out))
        if rc != PMIX_SUCCESS or not out:
            return None
        try:
            v = out.contents
            if v.type == PMIX_BYTE_OBJECT:
                return v.type, ctypes.string_at(v.data.bo.bytes, v.data.bo.size) if v.data.bo.size else b""
            if v.type == PMIX_STRING:
                return v.type, v.data.string or b""
            if v.type == PMIX_UINT32:
                return v.type, int(v.data.uint32)
            return v.type, int(v.data.uint64)
        finally:
            # PMIx allocated the value with malloc: destruct the payload, free the struct
            self.lib.PMIx_Value_destruct(out)
            _libc().free(ctypes.cast(out, ctypes.c_void_p))

    def _job_size(self) -> int:
        v = self._get(RANK_WILDCARD, KEY_JOB_SIZE)
        if v is None:
            raise BootstrapError(f"PMIx did not tell the job size ({KEY_JOB_SIZE.decode()}) of {self.namespace}",
                                 hint="set HPCRING_RENDEZVOUS=store")
        if not isinstance(v[1], int):
            raise BootstrapError(f"PMIx gave the job size of {self.namespace} as type {v[0]}, not a number",
                                 hint="set HPCRING_RENDEZVOUS=store")
        return v[1] & 0xFFFFFFFF

    # -- the interface the bootstrap uses ------------------------------------------------------
    def publish(self, items: Mapping[str, bytes]) -> None:
        """Put each value (with its MAC) for every rank to read after the next fence, then commit."""
        keep = []
        for key, value in items.items():
            blob = value + mac(self.secret, self.namespace, self.rank, key, value)
            buf = ctypes.create_string_buffer(blob, len(blob))
            keep.append(buf)
            v = Value()
            v.type = PMIX_BYTE_OBJECT
            v.data.bo.bytes = ctypes.cast(buf, ctypes.c_void_p)
            v.data.bo.size = len(blob)
            self._check(self.lib.PMIx_Put(PMIX_GLOBAL, (KEY_PREFIX + key).encode(), ctypes.byref(v)),
                        f"PMIx_Put({key})")   # PMIx copies the value: our buffer may go after this
        self._check(self.lib.PMIx_Commit(), "PMIx_Commit")

    def fence(self, timeout: float, probe_key: str | None = None, probe_budget: float = PROBE_BUDGET_S) -> None:
        """Every rank of the namespace reaches here (collecting the committed data), within ``timeout``.
        On expiry, ranks that never committed ``probe_key`` are named (see ``_who_is_missing``)."""
        infos = (Info * 2)()
        infos[0].key = KEY_COLLECT_DATA
        infos[0].value.type = PMIX_BOOL
        infos[0].value.data.flag = True
        infos[1].key = KEY_TIMEOUT       # the server's own deadline, a little after ours
        infos[1].value.type = PMIX_INT
        infos[1].value.data.integer = max(1, int(timeout) + 2)
        everyone = self._proc(RANK_WILDCARD)
        start = time.monotonic()
        try:
            rc = _bounded(lambda: self.lib.PMIx_Fence(ctypes.byref(everyone), 1, infos, 2), timeout, "fence")
        except _Expired:
            self._open = False   # a fence is in flight: finalizing could block on it
            missing, why = self._who_is_missing(probe_key, probe_budget)
            fence = f"the PMIx fence of {self.namespace} did not complete within {timeout:.1f} s"
            if missing:   # the store path's wording, so users and tools read one message either way
                raise BootstrapError(
                    f"rendezvous incomplete: {len(missing)} of {self.size} ranks never reached hpcring.init(): "
                    f"{each_on_host(missing, self.hosts_from_pmix(missing))} ({fence}; {why})",
                    hint=_MISSING_HINT) from None
            raise BootstrapError(f"rendezvous through PMIx incomplete: {fence} ({self.size} ranks; rank "
                                 f"{self.rank} was there); {why}", hint=_MISSING_HINT) from None
        if rc == PMIX_ERR_TIMEOUT:
            raise BootstrapError(
                f"rendezvous through PMIx incomplete: the PMIx server timed the fence of {self.namespace} out "
                f"after {time.monotonic() - start:.1f} s ({self.size} ranks; some never reached hpcring.init())",
                hint=_MISSING_HINT)
        self._check(rc, "PMIx_Fence")

    def _who_is_missing(self, key: str | None, budget: float = PROBE_BUDGET_S) -> tuple[list[int], str]:
        """PMIx does not say who failed to reach a fence; ask for every rank's ``key`` directly
        (Slurm and PRRTE fetch a committed value from the peer's node: "direct modex"), all at once
        and within ``budget`` seconds. A rank whose value does not come (or fails its MAC) is named.
        Only a hint: a peer whose node is slow to answer is named too, and large jobs are not probed.
        Returns (the ranks named, an explanation)."""
        if key is None or self.size > PROBE_MAX_RANKS:
            return [], "PMIx does not say which ranks are missing"
        found: dict[int, bool] = {}

        def probe(r: int) -> None:
            try:
                v = self._get(r, (KEY_PREFIX + key).encode(), timeout=max(1, int(budget)))
                found[r] = v is not None and isinstance(v[1], bytes) and self._verified(r, key, v[1]) is not None
            except Exception:   # noqa: BLE001 - a probe that fails names the rank as missing
                found[r] = False
        threads = [threading.Thread(target=probe, args=(r,), daemon=True) for r in range(self.size) if r != self.rank]
        for t in threads:
            t.start()
        end = time.monotonic() + budget
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        missing = [r for r in range(self.size) if r != self.rank and not found.get(r, False)]
        if not missing:
            return [], "every rank's data can be fetched, so a PMIx server did not finish the fence"
        if len(missing) == self.size - 1 > 1:   # a server without direct modex answers no one: no clue
            return [], "PMIx does not say which ranks are missing (no peer's data could be fetched before the fence)"
        return missing, f"their data could not be fetched from their nodes within {budget:.0f} s"

    def hosts_from_pmix(self, ranks: Sequence[int]) -> list[str]:
        """Host names the launcher gave PMIx (job-level data, known before any fence), indexed by rank."""
        hosts = ["?"] * self.size
        for r in ranks:
            v = self._get(r, KEY_HOSTNAME)
            if v is not None and isinstance(v[1], bytes):
                hosts[r] = v[1].decode(errors="replace")
        return hosts

    def _verified(self, rank: int, key: str, blob: bytes) -> bytes | None:
        value, tag = blob[:-MAC_LEN], blob[-MAC_LEN:]
        if len(blob) < MAC_LEN or not hmac.compare_digest(tag, mac(self.secret, self.namespace, rank, key, value)):
            return None
        return value

    def read(self, rank: int, key: str) -> bytes:
        """``key`` as published by ``rank`` (after a fence), its MAC checked."""
        v = self._get(rank, (KEY_PREFIX + key).encode())
        if v is None:
            raise BootstrapError(f"rank {rank} published no {key!r} through PMIx ({self.namespace})",
                                 hint="all ranks must run the same hpcring version and HPCRING_RENDEZVOUS")
        value = self._verified(rank, key, v[1] if isinstance(v[1], bytes) else b"")
        if value is None:
            raise BootstrapError(
                f"PMIx value {key!r} of rank {rank} ({self.namespace}) fails its MAC: forged or altered on the "
                "way, or that rank has another job secret",
                hint="every rank must read the same HPCRING_SECRET_FILE; check who else can reach the nodes' network")
        return value

    def exchange(self, items: Mapping[str, bytes], key: str, timeout: float,
                 ranks: Sequence[int] | None = None) -> list[bytes]:
        """Publish ``items``, fence, and return ``key`` of each of ``ranks`` (default: all), in order.
        Returns or raises within ``timeout`` (a quarter of it, at most PROBE_BUDGET_S, is kept for
        naming the missing ranks when the fence does not complete)."""
        self.publish(items)
        probe = min(PROBE_BUDGET_S, 0.25 * timeout)
        self.fence(timeout - probe, probe_key=key, probe_budget=probe)
        return [self.read(r, key) for r in (range(self.size) if ranks is None else ranks)]

    def finalize(self, timeout: float = 5.0) -> None:
        if not self._open:
            return
        self._open = False
        try:
            _bounded(lambda: self.lib.PMIx_Finalize(None, 0), timeout, "finalize")
        except _Expired:
            log.warning("PMIx_Finalize did not return within %.0f s; leaving it", timeout)


_MISSING_HINT = ("check the scheduler (e.g. `sacct -j JOB -o JobID,State,NodeList`) and the ranks' stderr; "
                 "HPCRING_INIT_TIMEOUT sets how long ranks wait; HPCRING_RENDEZVOUS=store names missing ranks")


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    return libc
