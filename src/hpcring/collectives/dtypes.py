"""The one table of element types and reduction ops: every Python user reads it.

Each row says what hpcring calls the type, its code in the C core's ``enum hr_dtype``
(native/hr_internal.h), its size, the numpy dtype of its buffers (bfloat16 travels as uint16
bits), the torch dtype of the same name and nccl-tests' name for it (``hpcring bench``). Ops
carry their ``enum hr_redop`` code and whether they apply to floating-point types only.

The codes are the C extension's ABI. The extension exports its enums by name (``_native.DTYPES``,
``_native.OPS``) and this module compares them at import: a stale or edited build fails with an
error naming the entry instead of reducing int32 buffers as float32.
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    from hpcring import _native
except ImportError:       # not built: the ring backend says so when it is asked for
    _native = None


@dataclass(frozen=True)
class DType:
    name: str           # hpcring's name, also the numpy/torch dtype's name
    code: int           # enum hr_dtype
    itemsize: int       # bytes per element
    storage: str        # numpy dtype of a buffer of this type
    nccl_tests: str     # nccl-tests' type name (bench tables)
    is_float: bool


@dataclass(frozen=True)
class Op:
    name: str
    code: int           # enum hr_redop
    floats_only: bool   # avg divides by the world size: meaningless on integers


TABLE: tuple[DType, ...] = (
    DType("float16", 0, 2, "float16", "half", True),
    DType("bfloat16", 1, 2, "uint16", "bfloat16", True),
    DType("float32", 2, 4, "float32", "float", True),
    DType("float64", 3, 8, "float64", "double", True),
    DType("int32", 4, 4, "int32", "int32", False),
    DType("int64", 5, 8, "int64", "int64", False),
    DType("uint8", 6, 1, "uint8", "uint8", False),
)
OP_TABLE: tuple[Op, ...] = (
    Op("sum", 0, False), Op("prod", 1, False), Op("min", 2, False), Op("max", 3, False), Op("avg", 4, True),
)

BY_NAME = {d.name: d for d in TABLE}
DTYPES = tuple(d.name for d in TABLE)
FLOAT_DTYPES = tuple(d.name for d in TABLE if d.is_float)
ITEMSIZE = {d.name: d.itemsize for d in TABLE}
DTYPE_CODES = {d.name: d.code for d in TABLE}
OPS = tuple(o.name for o in OP_TABLE)
OP_CODES = {o.name: o.code for o in OP_TABLE}


def ops_for(dtype: str) -> tuple[str, ...]:
    """The ops that reduce ``dtype`` (a name of :data:`DTYPES`)."""
    is_float = BY_NAME[dtype].is_float
    return tuple(o.name for o in OP_TABLE if is_float or not o.floats_only)


def numpy_dtype(dtype: str):
    """numpy dtype of a buffer of ``dtype`` (bfloat16: uint16)."""
    import numpy as np
    return np.dtype(BY_NAME[dtype].storage)


def torch_dtypes(torch) -> tuple:
    """The torch dtypes hpcring's kernels reduce, in table order (``torch`` passed in: this module
    must not import it)."""
    return tuple(getattr(torch, d.name) for d in TABLE)


def native_mismatches(native_dtypes: dict, native_ops: dict) -> list[str]:
    """What differs between this table and the C enums as the extension exports them
    (``{name: (code, itemsize)}``, ``{name: code}``): one line per entry, empty when they agree."""
    problems = []
    for d in TABLE:
        theirs = native_dtypes.get(d.name)
        if theirs is None:
            problems.append(f"dtype {d.name!r} (code {d.code}) is missing from enum hr_dtype")
        elif tuple(theirs) != (d.code, d.itemsize):
            problems.append(f"dtype {d.name!r} is code {d.code}, {d.itemsize} bytes here but code {theirs[0]}, "
                            f"{theirs[1]} bytes in enum hr_dtype")
    problems += [f"enum hr_dtype has {n!r} (code {v[0]}), which this table lacks"
                 for n, v in native_dtypes.items() if n not in BY_NAME]
    for o in OP_TABLE:
        if native_ops.get(o.name) != o.code:
            problems.append(f"op {o.name!r} is code {o.code} here but {native_ops.get(o.name)} in enum hr_redop")
    problems += [f"enum hr_redop has {n!r} (code {v}), which this table lacks"
                 for n, v in native_ops.items() if n not in OP_CODES]
    return problems


def _check_native() -> None:
    if _native is None:
        return
    problems = native_mismatches(getattr(_native, "DTYPES", {}), getattr(_native, "OPS", {}))
    if problems:
        raise ImportError("hpcring._native does not match hpcring.collectives.dtypes: " + "; ".join(problems)
                          + " (rebuild it: python setup.py build_ext --inplace; after editing an enum, "
                            "edit the table too)")


_check_native()
