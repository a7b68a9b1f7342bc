"""MPI backend (mpi4py, non-blocking collectives polled against the deadline) under mpirun.

Each test starts ``mpirun -np N --allow-run-as-root --oversubscribe python tests/workers/mpi_worker.py``
as a subprocess; the pure mapping helpers are tested in-process. Skipped without mpi4py/mpirun.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcring.collectives.backends import DTYPES, OPS
from hpcring.collectives.mpi import (from_float32, mismatch_message, reduce_plan, reduce_rows, signature,
                                     to_float32)
from hpcring.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "mpi_worker.py"
HAVE_MPI = importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py or mpirun is not installed")


def mpirun(np_: int, *args: str, env_extra: dict | None = None, timeout: float = 90.0):
    env = dict(os.environ)
    env.update({"OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl_tcp_if_include": "eth0",
                "OMPI_MCA_oob_tcp_if_include": "eth0", "OMPI_MCA_orte_base_help_aggregate": "0",
                "PYTHONPATH": str(ROOT / "src")})
    env.pop("HPCRING_MPI_ABORT_ON_TIMEOUT", None)
    env.update(env_extra or {})
    cmd = ["mpirun", "-np", str(np_), "--allow-run-as-root", "--oversubscribe"]
    for k in (env_extra or {}):
        cmd += ["-x", k]
    cmd += [sys.executable, str(WORKER), *args]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return r, time.monotonic() - t0


# -- pure parts ---------------------------------------------------------------------------------
def test_reduce_plan_covers_every_dtype_and_op():
    for dt in DTYPES:
        for op in OPS:
            if op == "avg" and dt not in ("float16", "bfloat16", "float32", "float64"):
                with pytest.raises(UsageError, match="avg"):
                    reduce_plan(dt, op)
                continue
            view, mtype, mop = reduce_plan(dt, op)
            assert mop == ("SUM" if op == "avg" else op.upper())
    assert reduce_plan("float16", "sum") == ("float32", "FLOAT", "SUM")        # upcast
    assert reduce_plan("bfloat16", "max") == ("float32", "FLOAT", "MAX")
    assert reduce_plan("int32", "sum") == ("uint32", "UINT32_T", "SUM")       # defined wrap-around
    assert reduce_plan("int64", "min") == ("int64", "INT64_T", "MIN")
    assert reduce_plan("uint8", "sum") == ("uint32", "UINT32_T", "SUM")       # Open MPI AVX saturates
    assert reduce_plan("uint8", "max") == ("uint8", "UINT8_T", "MAX")
    with pytest.raises(UsageError, match="unsupported op"):
        reduce_plan("float32", "xor")


def test_bfloat16_round_trip_and_rounding():
    vals = np.array([1.0, -2.5, 3.140625, 65280.0, np.inf, -np.inf, 0.0], np.float32)
    out = np.empty(vals.size, np.uint16)
    from_float32(vals, out, "bfloat16")
    assert np.array_equal(to_float32(out, "bfloat16"), vals)                  # exactly representable
    # 1 + 2^-8 is halfway between bf16 1.0 and 1+2^-7: ties to even -> 1.0; 1 + 3*2^-8 -> 1 + 2^-6
    out2 = np.empty(3, np.uint16)
    from_float32(np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, np.nan], np.float32), out2, "bfloat16")
    back = to_float32(out2, "bfloat16")
    assert back[0] == 1.0 and back[1] == 1 + 2 ** -6 and np.isnan(back[2])
    h = np.array([1.5, -3.0], np.float16)
    dst = np.empty(2, np.float16)
    from_float32(to_float32(h, "float16"), dst, "float16")
    assert np.array_equal(dst, h)


def test_mismatch_message_names_the_first_other_rank_in_the_rings_words():
    a = signature("allreduce", 5, 65536, "float32", "sum")
    b = signature("allreduce", 5, 32768, "float32", "sum")
    table = np.stack([a, b, a])
    assert mismatch_message(np.stack([a, a, a]), 0) is None
    assert mismatch_message(table, 0, ("node1", "node2", "node3")) == (
        "allreduce#5 mismatched collective: rank 1 (node2) called allreduce#5(count=32768, dtype=float32, "
        "op=sum, root=-1) but this rank (0) called allreduce#5(count=65536, dtype=float32, op=sum, root=-1)")
    assert mismatch_message(table, 1).startswith("allreduce#5 mismatched collective: rank 0 called allreduce#5(count=65536")
    bar = signature("barrier", 5)
    assert "rank 2 called barrier#5(count=0, dtype=none, op=none, root=-1)" in mismatch_message(np.stack([a, a, bar]), 0)
    assert "root=2" in mismatch_message(np.stack([signature("broadcast", 1, 4, "uint8", root=2),
                                                  signature("broadcast", 1, 4, "uint8", root=0)]), 1)


# -- under mpirun -------------------------------------------------------------------------------
def test_reduce_rows_has_the_mpi_paths_arithmetic():
    """The folded small calls reduce locally: integers wrap in their width (uint8 too, where Open
    MPI's AVX sum saturates), 2-byte floats are summed in float32 and rounded once, avg divides."""
    big = np.array([[250, 3], [10, 255], [1, 1]], np.uint8)
    out = np.empty(2, np.uint8)
    reduce_rows(big, out, "uint8", "sum")
    assert out.tolist() == [(250 + 10 + 1) % 256, (3 + 255 + 1) % 256]
    i32 = np.array([[2 ** 31 - 1], [1]], np.int32)
    o32 = np.empty(1, np.int32)
    reduce_rows(i32, o32, "int32", "sum")
    assert o32[0] == -2 ** 31
    reduce_rows(i32, o32, "int32", "min")
    assert o32[0] == 1
    # 1 + 2^-11 + 2^-11: in float16 each addition ties back to 1.0; in float32 then one rounding
    # it is 1 + 2^-10 (float16's spacing at 1)
    h = np.array([[1.0], [2 ** -11], [2 ** -11]], np.float16)
    oh = np.empty(1, np.float16)
    reduce_rows(h, oh, "float16", "sum")
    assert oh[0] == np.float16(1 + 2 ** -10) and ((h[0] + h[1]) + h[2])[0] == 1.0
    reduce_rows(np.full((3, 1), 1.5, np.float16), oh, "float16", "avg")
    assert oh[0] == 1.5
    bf = np.empty((2, 1), np.uint16)
    from_float32(np.array([1.0, 2.0], np.float32), bf.reshape(-1), "bfloat16")
    ob = np.empty(1, np.uint16)
    reduce_rows(bf, ob, "bfloat16", "prod")
    assert to_float32(ob, "bfloat16")[0] == 2.0
    f = np.array([[1.0, 4.0], [3.0, -2.0]], np.float64)
    of = np.empty(2, np.float64)
    reduce_rows(f, of, "float64", "avg")
    assert of.tolist() == [2.0, 1.0]
    reduce_rows(f, of, "float64", "max")
    assert of.tolist() == [3.0, 4.0]


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nranks,nofold", [(2, False), (3, False), (3, True)])
def test_every_op_dtype_size_matches_numpy(nranks, nofold):
    """Small calls ride in the check's slot (folded) unless MPI_WORKER_NOFOLD: both paths."""
    r, _ = mpirun(nranks, "ops", env_extra={"MPI_WORKER_NOFOLD": "1"} if nofold else None)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    results = re.findall(r"RESULT rank=(\d+) ok=(\d+) failed=(\d+)", r.stdout)
    assert sorted(int(x[0]) for x in results) == list(range(nranks)), out[-4000:]
    assert all(int(ok) > 450 and failed == "0" for _, ok, failed in results), results


# mpirun forwards each rank's output as it arrives: two ranks' lines can end up on one line
_CAUGHT = r"CAUGHT rank=(\d+) elapsed=([\d.]+) msg=(.*?)(?=CAUGHT rank=|\n|$)"


@needs_mpi
@pytest.mark.mpi
def test_skipped_collective_raises_collective_error_within_deadline():
    deadline = 1.5
    r, _ = mpirun(3, "skip", str(deadline), env_extra={"HPCRING_MPI_ABORT_ON_TIMEOUT": "0"})
    caught = re.findall(_CAUGHT, r.stdout)
    assert sorted(int(c[0]) for c in caught) == [0, 1], r.stdout + r.stderr[-3000:]
    for _, elapsed, msg in caught:
        assert deadline - 0.01 <= float(elapsed) < deadline + 3.0   # slack for a loaded 2-core host
        assert "allreduce#2" in msg and "count=1000" in msg and "1.5 s deadline" in msg
    # one line can hold two ranks' lines (as for _CAUGHT): each message ends where the next begins
    sticky = re.findall(r"STICKY rank=\d+ msg=(.*?)(?=STICKY rank=|CAUGHT rank=|RECORD rank=|\n|$)", r.stdout)
    assert len(sticky) == 2 and all("allreduce#2" in m for m in sticky)   # the communicator stays failed
    # the flight record of the failed call (the short path's slot) says so, with the error raised
    assert sorted(re.findall(r"RECORD rank=(\d) allreduce#2 failed error=True", r.stdout)) == ["0", "1"], r.stdout


@needs_mpi
@pytest.mark.mpi
def test_skipped_collective_aborts_the_job_by_default():
    r, elapsed = mpirun(3, "skip", "1.5")
    assert r.returncode == 124, (r.returncode, r.stdout, r.stderr[-3000:])       # MPI_Abort(124)
    assert elapsed < 15, elapsed                                                  # promptly, not at the straggler's leisure
    assert "hpcring: CollectiveError: allreduce#2(count=1000" in r.stderr
    assert "CAUGHT" not in r.stdout and "SKIPPED" not in r.stdout


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("mode,nofold", [("mismatch", False), ("different", False), ("larger", False),
                                         ("mismatch", True), ("different", True), ("larger", True)])
def test_mismatched_call_is_named_on_every_rank_before_mpi_sees_it(mode, nofold):
    """Without the signature check Open MPI truncates (small counts), corrupts its heap (large
    ones) or hangs: here every rank raises at once, in the ring's words, naming the odd rank.
    Folded (the check is the slot allgather that carries small calls' data) and not (the
    (signature, -signature) allreduce of larger communicators); "larger": the odd rank's call is
    past the slot (its data would go in its own MPI call) while the others' fits."""
    r, _ = mpirun(3, mode, env_extra={"MPI_WORKER_NOFOLD": "1"} if nofold else None)
    caught = {int(c[0]): (float(c[1]), c[2]) for c in re.findall(_CAUGHT, r.stdout)}
    assert sorted(caught) == [0, 1, 2] and r.returncode == 0, r.stdout + r.stderr[-3000:]
    victim = {"mismatch": "allreduce#2(count=500, dtype=float32", "larger": "allreduce#2(count=2000, dtype=float32",
              "different": "barrier#2(count=0"}[mode]
    for rank in (0, 1):
        elapsed, msg = caught[rank]
        assert msg.startswith(f"allreduce#2 mismatched collective: rank 2 called {victim}"), msg
        assert msg.endswith(f"but this rank ({rank}) called allreduce#2(count=1000, dtype=float32, op=sum, root=-1)")
        assert elapsed < 5.0                 # at once, not at the 30 s deadline
    assert caught[2][1].startswith(f"{victim.split('(')[0]} mismatched collective: rank 0 called allreduce#2(count=1000")


@needs_mpi
@pytest.mark.mpi
def test_signature_check_can_be_turned_off():
    r, _ = mpirun(3, "mismatch", env_extra={"HPCRING_MPI_CHECK_SIGNATURES": "0", "HPCRING_MPI_ABORT_ON_TIMEOUT": "0"},
                  timeout=60)
    assert "mismatched collective" not in r.stdout + r.stderr
