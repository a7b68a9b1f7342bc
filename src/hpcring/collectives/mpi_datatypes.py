"""The MPI backend's datatype maps (pure; unit-tested without MPI): the wire type and MPI op of each
reduction, the float16/bfloat16 upcast, reductions of gathered rows (see :mod:`hpcring.collectives.mpi`)."""
from __future__ import annotations

import numpy as np

from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS
from hpcring.errors import UsageError

_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}

UPCAST_DTYPES = ("float16", "bfloat16")


def _widened(dtype: str, view: str) -> bool:
    """True when the reduction runs on a converted copy (not a view) of the buffer."""
    return dtype in UPCAST_DTYPES or (dtype == "uint8" and view != "uint8")


def _to_wire(buf: np.ndarray, dtype: str, view: str) -> np.ndarray:
    if dtype in UPCAST_DTYPES:
        return to_float32(buf, dtype)
    return buf.astype(view)


def _from_wire(wire: np.ndarray, dst: np.ndarray, dtype: str) -> None:
    if dtype in UPCAST_DTYPES:
        from_float32(wire, dst, dtype)
    else:
        dst[...] = wire.astype(dst.dtype)       # uint32 -> uint8 keeps the value mod 256 (wrap)


def reduce_plan(dtype: str, op: str) -> tuple[str, str, str]:
    """(numpy view dtype of the wire buffer, MPI datatype name, MPI op name) for a reduction.

    The view dtype is what the (possibly upcast) buffer is reinterpreted as before it is handed
    to MPI; the 2-byte floats are upcast to float32 and ``avg`` is SUM then a division."""
    if dtype not in DTYPES:
        raise UsageError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    if op not in OPS:
        raise UsageError(f"unsupported op {op!r}; supported: {', '.join(OPS)}")
    if op == "avg" and dtype not in FLOAT_DTYPES:
        raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
    mop = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX", "avg": "SUM"}[op]
    if dtype in ("float16", "bfloat16", "float32"):
        return "float32", "FLOAT", mop
    if dtype == "float64":
        return "float64", "DOUBLE", mop
    if dtype == "uint8":
        if op in ("sum", "prod"):           # widened: Open MPI 4.1's AVX uint8 SUM saturates
            return "uint32", "UINT32_T", mop
        return "uint8", "UINT8_T", mop
    bits = 32 if dtype == "int32" else 64
    if op in ("sum", "prod"):               # wrap-around, defined on unsigned types
        return f"uint{bits}", f"UINT{bits}_T", mop
    return f"int{bits}", f"INT{bits}_T", mop


def to_float32(buf: np.ndarray, dtype: str) -> np.ndarray:
    """A new float32 copy of a float16 array or of bfloat16 (uint16 storage)."""
    if dtype == "float16":
        return buf.view(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(dtype)


def from_float32(src: np.ndarray, dst: np.ndarray, dtype: str) -> None:
    """Round float32 ``src`` to nearest-even into ``dst`` (float16, or bfloat16 as uint16)."""
    if dtype == "float16":
        dst.view(np.float16)[...] = src.astype(np.float16)
        return
    if dtype != "bfloat16":
        raise ValueError(dtype)
    bits = src.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(src)
    if nan.any():                            # keep NaN a (quiet) NaN: never round into Inf
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    dst.view(np.uint16)[...] = rounded


def reduce_rows(rows: np.ndarray, dst: np.ndarray, dtype: str, op: str) -> None:
    """``dst`` = the reduction of ``rows`` (ranks x elements, storage dtype) over the ranks, in the
    arithmetic of the MPI path (:func:`reduce_plan`): float16/bfloat16 in float32, rounded once;
    integers wrap in their own width; avg = sum, then a division by the number of rows. Rows are
    combined in rank order, so every rank computes the same bits."""
    n = rows.shape[0]
    uf = _UFUNCS[op]
    if dtype in UPCAST_DTYPES:
        acc = uf.reduce(to_float32(rows, dtype), axis=0)
        if op == "avg":
            acc /= np.float32(n)
        from_float32(acc, dst, dtype)
        return
    uf.reduce(rows, axis=0, dtype=dst.dtype, out=dst)
    if op == "avg":
        dst /= dst.dtype.type(n)
