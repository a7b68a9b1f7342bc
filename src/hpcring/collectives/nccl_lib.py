"""The NCCL library as CuPy binds it: unique ids, type and op codes, versions, availability.

Pure helpers, tested without a GPU (and against the installed CuPy where it runs without one);
the backend itself is :mod:`hpcring.collectives.nccl`.
"""
from __future__ import annotations

import importlib.util
import os
import time

from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS
from hpcring.errors import CollectiveError, UsageError

POLL_MIN = 50e-6
POLL_MAX = 1e-3
UID_BYTES = 128

# ncclDataType_t / ncclRedOp_t values (nccl.h); used when cupy does not export a name
NCCL_DTYPE = {"uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
NCCL_OP = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_CUPY_DTYPE_NAME = {"uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "int64": "NCCL_INT64",
                    "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
                    "bfloat16": "NCCL_BFLOAT16"}
_CUPY_OP_NAME = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN", "avg": "NCCL_AVG"}
BF16_MIN_VERSION = 21003     # NCCL 2.10.3
AVG_MIN_VERSION = 21000      # NCCL 2.10.0
SENDRECV_MIN_VERSION = 20700


# ---------------------------------------------------------------------------------------------
# pure helpers (tested without a GPU)
# ---------------------------------------------------------------------------------------------
def uid_to_bytes(uid) -> bytes:
    """CuPy's unique id -> 128 raw bytes. CuPy >= 14 already hands out ``bytes``; CuPy <= 13 a
    tuple of 128 C ``char`` values (signed on x86)."""
    if len(uid) != UID_BYTES:
        raise CollectiveError(f"NCCL unique id has {len(uid)} bytes, expected {UID_BYTES}")
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(int(c) & 0xFF for c in uid)


def uid_from_bytes(data: bytes, *, as_bytes: bool = False):
    """128 raw bytes -> what ``NcclCommunicator(ndev, commId, rank)`` takes: ``bytes`` for CuPy
    >= 14 (``as_bytes``), else the tuple of signed chars of CuPy <= 13."""
    if len(data) != UID_BYTES:
        raise CollectiveError(f"NCCL unique id from the store has {len(data)} bytes, expected {UID_BYTES}",
                              hint="another job or an older hpcring wrote this key")
    if as_bytes:
        return bytes(data)
    return tuple(b - 256 if b > 127 else b for b in data)


def uid_takes_bytes(cupy) -> bool:
    """True when this CuPy's ``NcclCommunicator`` takes the unique id as ``bytes`` (CuPy >= 14)."""
    try:
        return int(str(cupy.__version__).split(".")[0]) >= 14
    except (AttributeError, ValueError):
        return True


def check_gpu_sharing(mine: int, entries: dict[int, str], host: str) -> None:
    """Refuse two ranks of one host on one physical GPU before NCCL is called (NCCL would fail
    with "Duplicate GPU detected" or hang). ``entries``: rank -> PCI bus id of its GPU, for the
    ranks on ``host`` (this rank ``mine`` included)."""
    by_gpu: dict[str, list[int]] = {}
    for r, bus in sorted(entries.items()):
        by_gpu.setdefault(bus, []).append(r)
    clash = by_gpu.get(entries[mine], [])
    if len(clash) > 1:
        ranks = ", ".join(str(r) for r in clash)
        raise CollectiveError(
            f"ranks {ranks} on {host} would share one GPU (PCI {entries[mine]}): NCCL needs one GPU per rank",
            hint="request as many GPUs as tasks per node (--gpus-per-node N --tasks-per-node N), or give each "
                 "local rank its own CUDA_VISIBLE_DEVICES; hpcring pins GPU = local rank when the job has GPUs")


def nccl_dtype(dtype: str, version: int, nccl_mod=None) -> int:
    """The ncclDataType_t for an hpcring dtype; bfloat16 only with NCCL >= 2.10.3."""
    if dtype not in DTYPES:
        raise UsageError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if dtype == "bfloat16" and version < BF16_MIN_VERSION:
        raise CollectiveError(f"bfloat16 needs NCCL >= 2.10.3, this is NCCL {format_version(version)}",
                              hint="upgrade nvidia-nccl-cu12, or convert to float32 first")
    return int(getattr(nccl_mod, _CUPY_DTYPE_NAME[dtype], NCCL_DTYPE[dtype]))


def nccl_op(op: str, dtype: str, version: int, nccl_mod=None) -> tuple[int, bool]:
    """(ncclRedOp_t, divide_after): avg is ncclAvg when available, else sum + a division."""
    if op not in OPS:
        raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
    if op == "avg":
        if dtype not in FLOAT_DTYPES:
            raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
        if version >= AVG_MIN_VERSION:
            return int(getattr(nccl_mod, "NCCL_AVG", NCCL_OP["avg"])), False
        return int(getattr(nccl_mod, "NCCL_SUM", NCCL_OP["sum"])), True
    return int(getattr(nccl_mod, _CUPY_OP_NAME[op], NCCL_OP[op])), False


def format_version(code: int) -> str:
    """NCCL version code -> 'major.minor.patch' (>= 2.9: M*10000 + m*100 + p, else M*1000 + m*100 + p)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def wait_for(done, check_error, *, timeout: float, t0: float, clock=time.monotonic, sleep=time.sleep):
    """Poll ``done()`` (and ``check_error()``, which raises on an NCCL async error) until it is
    true or ``t0 + timeout`` passes. Returns None when done, else the elapsed seconds (expired).
    Sleeps 50 us doubling to 1 ms between polls."""
    deadline = t0 + timeout
    delay = POLL_MIN
    while True:
        if done():
            return None
        check_error()
        now = clock()
        if now >= deadline:
            return now - t0
        sleep(min(delay, max(deadline - now, 0.0)))
        delay = min(delay * 2, POLL_MAX)


def _import_cupy():
    if importlib.util.find_spec("cupy") is None:
        raise CollectiveError("the 'nccl' backend needs CuPy, which is not installed",
                              hint="pip install cupy-cuda12x nvidia-nccl-cu12, or use backend='mpi' or 'ring'")
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001 - ImportError, CUDA library errors
        raise CollectiveError(f"the 'nccl' backend cannot import cupy.cuda.nccl: {e}",
                              hint="install nvidia-nccl-cu12 matching cupy-cuda12x, or use backend='mpi' or 'ring'") from None
    if not getattr(nccl, "available", True):
        raise CollectiveError("CuPy was built without NCCL support (cupy.cuda.nccl.available is False)",
                              hint="pip install nvidia-nccl-cu12")
    return cupy, nccl


def _driver_present() -> bool:
    """An NVIDIA kernel driver is loaded (checked before importing CuPy, which costs ~0.3 s per
    rank on machines that have none)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def gpu_count() -> int:
    """Visible CUDA devices through CuPy (0 without cupy, a driver or a GPU)."""
    if not _driver_present() or importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver / no device
        return 0


def gpu_available() -> bool:
    """True when cupy imports and sees at least one GPU (the ``auto`` backend rule)."""
    return gpu_count() > 0


# ---------------------------------------------------------------------------------------------
# the communicator's creation steps (hpcring.collectives.nccl.NcclBackend.create)
# ---------------------------------------------------------------------------------------------
def _check_one_gpu_per_rank(topology, store, gen: int, cupy, device_id: int, timeout: float) -> None:
    """Every rank publishes its GPU's PCI bus id; each compares with the ranks of its own host
    (from the topology), so the check costs local_size store reads per rank."""
    try:
        bus = str(cupy.cuda.runtime.deviceGetPCIBusId(device_id))
    except Exception:  # noqa: BLE001 - an old driver API: fall back on the visible index
        bus = f"visible device {device_id}"
    store.set(f"nccl/{gen}/gpu/{topology.rank}", bus.encode())
    hosts = list(topology.hosts or ())
    peers = [r for r, h in enumerate(hosts) if h == topology.host] or [topology.rank]
    try:
        values = store.gather([f"nccl/{gen}/gpu/{r}" for r in peers], timeout=timeout)
    except Exception as e:  # noqa: BLE001 - StoreTimeoutError names the missing keys
        raise CollectiveError(f"NCCL communicator {gen}: rank {topology.rank} ({topology.host}) did not hear "
                              f"from the other ranks of its host within {timeout:g} s: {e}") from None
    check_gpu_sharing(topology.rank, {r: v.decode() for r, v in zip(peers, values)}, topology.host)


def _init_rank(nccl, topology, raw: bytes, as_bytes: bool, device_id: int):
    """``NcclCommunicator(size, uid, rank)`` with the unique id in the type this CuPy takes; a
    TypeError about ``commId`` (a CuPy whose version we misjudged) retries with the other type."""
    last = None
    for form in (as_bytes, not as_bytes):
        try:
            return nccl.NcclCommunicator(topology.size, uid_from_bytes(raw, as_bytes=form), topology.rank)
        except TypeError as e:
            if "commId" not in str(e):
                last = e
                break
            last = e
        except Exception as e:  # noqa: BLE001 - NcclError / CUDA errors
            last = e
            break
    raise CollectiveError(f"ncclCommInitRank failed on rank {topology.rank} ({topology.host}, GPU "
                          f"{device_id}): {last}", hint="NCCL_DEBUG=INFO shows why")
