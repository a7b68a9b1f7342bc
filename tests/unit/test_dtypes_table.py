"""One table of dtypes and ops (hpcring.collectives.dtypes): every Python user reads it, and it
is checked against the C enums the extension exports, by name, not by position."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hpcring.collectives import dtypes as D

_native = pytest.importorskip("hpcring._native")


def test_table_matches_the_c_enums():
    assert D.native_mismatches(_native.DTYPES, _native.OPS) == []
    assert {d.name: (d.code, d.itemsize) for d in D.TABLE} == _native.DTYPES
    assert {o.name: o.code for o in D.OP_TABLE} == _native.OPS


def test_rows_are_consistent():
    for d in D.TABLE:
        assert D.numpy_dtype(d.name).itemsize == d.itemsize, d
    assert len({d.code for d in D.TABLE}) == len(D.TABLE) and len({o.code for o in D.OP_TABLE}) == len(D.OP_TABLE)
    assert "avg" not in D.ops_for("int32") and "avg" in D.ops_for("bfloat16")
    assert D.ops_for("float32") == D.OPS


@pytest.mark.parametrize("change,named", [
    (lambda dt, ops: dt.update(int32=(5, 4), int64=(4, 8)), "'int32' is code 4, 4 bytes here but code 5"),
    (lambda dt, ops: dt.update(uint8=(6, 2)), "'uint8' is code 6, 1 bytes here but code 6, 2 bytes"),
    (lambda dt, ops: dt.pop("bfloat16"), "'bfloat16' (code 1) is missing"),
    (lambda dt, ops: dt.update(int8=(7, 1)), "enum hr_dtype has 'int8'"),
    (lambda dt, ops: ops.update(min=3, max=2), "op 'min' is code 2 here but 3"),
    (lambda dt, ops: ops.update(band=5), "enum hr_redop has 'band'"),
])
def test_a_mismatch_names_the_entry(change, named):
    dt, ops = dict(_native.DTYPES), dict(_native.OPS)
    change(dt, ops)
    problems = D.native_mismatches(dt, ops)
    assert any(named in p for p in problems), problems


def test_a_mismatched_build_fails_at_import():
    """An extension whose enum differs (a stale build) stops the import with the entry named."""
    code = textwrap.dedent("""
        import sys, types
        fake = types.ModuleType("hpcring._native")
        fake.DTYPES = {"float16": (0, 2), "bfloat16": (1, 2), "float32": (2, 4), "float64": (3, 8),
                       "int32": (5, 4), "int64": (4, 8), "uint8": (6, 1)}
        fake.OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
        sys.modules["hpcring._native"] = fake
        import hpcring
        hpcring._native = fake
        import hpcring.collectives.ring
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "ImportError: hpcring._native does not match hpcring.collectives.dtypes" in p.stderr, p.stderr
    assert "dtype 'int32' is code 4" in p.stderr and "rebuild" in p.stderr, p.stderr


@pytest.mark.parametrize("dtype", D.DTYPES)
@pytest.mark.parametrize("op", D.OPS)
def test_c_kernel_reduces_each_row_by_its_code(dtype, op):
    """The codes mean the same thing to the C core: the local kernel under each (dtype, op) code
    computes what numpy computes on the row's storage (bfloat16: exact small values as bits)."""
    if op not in D.ops_for(dtype):
        return
    from hpcring.bench.data import to_storage
    a, b = np.array([1, 2, 3, 4], np.float64), np.array([2, 1, 3, 1], np.float64)
    dst, src = to_storage(a, dtype), to_storage(b, dtype)
    _native.reduce(dst, src, D.DTYPE_CODES[dtype], D.OP_CODES[op])
    want = {"sum": a + b, "prod": a * b, "min": np.minimum(a, b), "max": np.maximum(a, b), "avg": a + b}[op]
    assert np.array_equal(dst, to_storage(want, dtype)), (dtype, op, dst)


def test_every_python_user_reads_the_table():
    from hpcring.bench import data, options
    from hpcring.collectives import arrays, backends, ring
    assert backends.DTYPES is D.DTYPES and backends.OPS is D.OPS and backends.ITEMSIZE is D.ITEMSIZE
    assert ring.DTYPE_CODES is D.DTYPE_CODES and ring.OP_CODES is D.OP_CODES
    assert options.OPS is D.OPS
    assert {n: (t, np.dtype(s).name) for n, (t, s) in data.DTYPES.items()} == \
        {d.name: (d.nccl_tests, d.storage) for d in D.TABLE}
    assert all(arrays.storage_dtype(d.name) == D.numpy_dtype(d.name) for d in D.TABLE)


def test_torch_users_read_the_table():
    torch = pytest.importorskip("torch")
    from hpcring.distributed import process_group
    from hpcring.torch import entry, executor
    want = tuple(getattr(torch, d.name) for d in D.TABLE)
    assert process_group._REDUCE_DTYPES == want and executor.WIRE == want and entry.DTYPES[:len(want)] == want


def test_backend_code_maps_cover_the_table():
    """NCCL's own codes are a backend fact, but every row of the table must have one."""
    from hpcring.collectives.nccl_lib import NCCL_DTYPE
    assert set(NCCL_DTYPE) == set(D.DTYPES)
