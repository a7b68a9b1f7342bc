"""Deterministic per-rank data, the expected result of every collective for every rank, and the
exact #wrong count (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hpcring.collectives.dtypes import FLOAT_DTYPES, TABLE
from hpcring.config.text import shown
from hpcring.errors import UsageError


# name -> (nccl-tests type name, numpy storage dtype), from the one table
DTYPES = {d.name: (d.nccl_tests, np.dtype(d.storage).type) for d in TABLE}
DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
                 "int": "int32", "fp32": "float32", "fp64": "float64", "fp16": "float16"}
PERIOD = 1021          # the data pattern's period in elements (prime: no block size lines up with it)
ENV_TABLE = "HPCRING_BENCH_TABLE"   # set by the standalone parent: rank 0 writes its lines there


def normalize_dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UsageError(f"unknown --dtype {shown(name)}; choose one of {', '.join(DTYPES)}")
    return name


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded[nan] = 0x7FC0
    return rounded


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float64/int64 values -> the dtype's storage (bfloat16 as uint16 bits; integers wrap)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(values.astype(np.float32))
    if is_float(dtype):
        return values.astype(DTYPES[dtype][1])
    return values.astype(np.int64).astype(DTYPES[dtype][1])    # wraps like the integer arithmetic


def as_values(storage: np.ndarray, dtype: str) -> np.ndarray:
    """Storage -> float64 (floats) or int64 (integers) values."""
    if dtype == "bfloat16":
        return bf16_bits_to_f32(storage).astype(np.float64)
    return storage.astype(np.float64 if is_float(dtype) else np.int64)


def rank_pattern(rank: int, dtype: str, op: str = "sum", seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input pattern (PERIOD elements, storage dtype). Small integers: sums of up to
    thousands of ranks stay exact in float16/bfloat16; for prod only -1, 1 and 2 (exact powers of 2)."""
    rng = np.random.default_rng([seed, rank, 0xBE7C])
    if op == "prod":
        vals = rng.choice(np.array([-1, 1, 1, 2]), PERIOD)
    else:
        vals = rng.integers(-4, 5, PERIOD)
    if dtype == "uint8" and op != "prod":
        vals = vals + 4                        # 0..8 keeps min/max meaningful without wrapping
    return to_storage(vals.astype(np.float64 if is_float(dtype) else np.int64), dtype)


def reduce_patterns(patterns: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """The expected elementwise reduction of the ranks' patterns, in storage dtype."""
    if not is_float(dtype):                    # integer arithmetic in the dtype itself: wraps like the backend
        acc = patterns[0].copy()
        for p in patterns[1:]:
            if op == "sum":
                acc = acc + p
            elif op == "prod":
                acc = acc * p
            elif op == "min":
                acc = np.minimum(acc, p)
            elif op == "max":
                acc = np.maximum(acc, p)
            else:
                raise UsageError(f"op {op} is not defined for {dtype}")
        return acc.astype(patterns[0].dtype)
    vals = np.stack([as_values(p, dtype) for p in patterns])
    red = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}[op](vals, axis=0)
    return to_storage(red, dtype)


def tile(pattern: np.ndarray, offset: int, length: int) -> np.ndarray:
    """Elements ``[offset, offset + length)`` of the infinite periodic repetition of ``pattern``."""
    if length <= 0:
        return pattern[:0].copy()
    return np.resize(np.roll(pattern, -(offset % len(pattern))), length)


def count_wrong(got: np.ndarray, want: np.ndarray, dtype: str, op: str = "sum") -> int:
    """Elements of ``got`` that differ from ``want`` (storage arrays of the same length). Exact, except
    ``avg`` which may be off by one rounding of the dtype (the backend divides in its own precision)."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.size != want.size:
        raise ValueError(f"size mismatch: got {got.size} elements, want {want.size}")
    if op == "avg" and is_float(dtype):
        g, w = as_values(got, dtype), as_values(want, dtype)
        eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}[dtype]
        bad = ~np.isclose(g, w, rtol=2 * eps, atol=0) & ~(np.isnan(g) & np.isnan(w))
        return int(np.count_nonzero(bad))
    if is_float(dtype) and dtype != "bfloat16":
        return int(np.count_nonzero((got != want) & ~(np.isnan(got) & np.isnan(want))))
    return int(np.count_nonzero(got != want))


@dataclass
class Case:
    """One benchmark point on one rank: ``run()`` is timed, ``check()`` returns this rank's #wrong."""
    run: Callable[[], object]
    check: Callable[[], int]
    buffers: list = field(default_factory=list)


def _sentinel(shape, dtype: str) -> np.ndarray:
    st = DTYPES[dtype][1]
    if dtype == "bfloat16":
        return np.full(shape, 0x7FC0, np.uint16)            # NaN
    if is_float(dtype):
        return np.full(shape, np.nan, st)
    return np.full(shape, 77, st)
