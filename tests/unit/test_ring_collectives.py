"""Ring collectives (native/ + hpcring.collectives): every op x dtype x size x world size against
numpy, bit-identical results on all ranks, property tests, deadlines and failure reporting.

Most cases run the ranks as threads over socketpairs (the native calls release the GIL, so this
exercises the real C code paths at a fraction of the cost of processes); the end-to-end cases
spawn processes that rendezvous through the authenticated store and connect over TCP.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers.ring as H  # noqa: E402

from hpcring import _native  # noqa: E402
from hpcring.collectives import Communicator  # noqa: E402
from hpcring.collectives.ring import RingBackend  # noqa: E402
from hpcring.errors import BootstrapError, CollectiveError, UsageError  # noqa: E402

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
OPS = ["sum", "prod", "min", "max", "avg"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


# ---- data and references -----------------------------------------------------------------------
def bf16_encode(f32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (as the C kernels)."""
    u = f32.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_decode(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def make_input(dtype: str, op: str, count: int, rank: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype in FLOATS:
        vals = rng.uniform(0.5, 1.5, count) if op == "prod" else rng.uniform(-1, 1, count)
        if dtype == "bfloat16":
            return bf16_encode(vals.astype(np.float32))
        return vals.astype(dtype)
    if op == "prod":
        return rng.integers(-3, 4, count).astype(dtype) if dtype != "uint8" else rng.integers(0, 4, count).astype(np.uint8)
    lo, hi = (0, 256) if dtype == "uint8" else (-1000, 1000)
    return rng.integers(lo, hi, count).astype(dtype)


def as_float(dtype: str, a: np.ndarray) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_decode(a).astype(np.float64)
    return a.astype(np.float64)


def reference(dtype: str, op: str, xs: list[np.ndarray]) -> np.ndarray:
    """Exact (float64 or wrapping integer) reduction over ranks."""
    if dtype in FLOATS:
        f = np.stack([as_float(dtype, x) for x in xs])
        return {"sum": f.sum(0), "avg": f.mean(0), "prod": f.prod(0), "min": f.min(0), "max": f.max(0)}[op]
    s = np.stack(xs)
    with np.errstate(over="ignore"):
        return {"sum": lambda: s.sum(0, dtype=dtype), "prod": lambda: s.prod(0, dtype=dtype),
                "min": lambda: s.min(0), "max": lambda: s.max(0)}[op]()


def check_close(dtype: str, op: str, got: np.ndarray, ref: np.ndarray, xs: list[np.ndarray]) -> None:
    if dtype not in FLOATS or op in ("min", "max"):
        if dtype in FLOATS:
            np.testing.assert_array_equal(as_float(dtype, got), ref)
        else:
            np.testing.assert_array_equal(got, ref)
        return
    n = len(xs)
    g = as_float(dtype, got)
    # Stated tolerance: every pairwise combination rounds once in the element type, so the error
    # is at most about n roundings of the running magnitude (sum |x|, or the product itself).
    if op == "prod":
        scale = np.abs(ref)
    else:
        scale = np.sum(np.abs(np.stack([as_float(dtype, x) for x in xs])), 0) / (n if op == "avg" else 1)
    tol = (n + 1) * EPS[dtype] * scale + 1e-300
    bad = np.abs(g - ref) > tol
    assert not bad.any(), f"{dtype} {op}: {bad.sum()} elements off, e.g. got {g[bad][:3]} want {ref[bad][:3]}"


def assert_identical(results: list[np.ndarray]) -> None:
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes(), "ranks disagree bitwise"


# ---- fixtures ----------------------------------------------------------------------------------
_groups: dict[tuple[int, str], H.ThreadGroup] = {}
# "striped": 3 streams per peer, 2 I/O threads, and a stripe every 8 bytes, so that even the small
# sizes below cut their chunks into uneven (some empty) slices on every stream.
# "shm": one host, all through shared memory (4 KiB pieces); "cma": the same, allgather,
# broadcast and alltoall reading the peers' buffers directly (process_vm_readv); "twolevel": 3 hosts x 2 ranks, shared
# memory within a host and striped rings across hosts; "mixed": hosts of different rank counts
# (shared memory only where a host's whole layout allows it).
MODES = {"plain": {}, "striped": {"streams": 3, "threads": 2, "stripe_min": 8},
         "shm": {},                                         # hosts: ("h",) * n
         "cma": {"cma": 1},                                 # hosts: ("h",) * n, direct reads at every size
         "twolevel": {"hosts": ("a", "b", "c", "a", "b", "c"), "streams": 2, "threads": 2, "stripe_min": 8},
         "mixed": {"hosts": ("a", "a", "a", "b", "b")}}


@pytest.fixture(scope="module")
def group():
    def get(n: int, mode: str = "plain") -> H.ThreadGroup:
        if (n, mode) not in _groups:
            kw = dict(MODES[mode], **({"hosts": ("h",) * n} if mode in ("shm", "cma") else {}))
            _groups[n, mode] = H.ThreadGroup(n, **kw)
        return _groups[n, mode]
    yield get
    for g in _groups.values():
        g.close()
    _groups.clear()


SIZES = [0, 1, 7, 1000, 4099]


# ---- allreduce: op x dtype x size x world size x algorithm --------------------------------------
@pytest.mark.parametrize("n,algo,mode", [(n, a, "plain") for n in range(1, 7) for a in ("ring", "rd", "rh")] +
                         [(n, "rh", "plain") for n in (7, 8, 9)] + [(5, "rh", "striped")] +
                         [(n, "direct", "plain") for n in (1, 2, 3)] + [(3, "direct", "striped")] +
                         [(n, "ring", "striped") for n in (2, 3, 5)] +
                         [(4, "ring", "shm"), (3, "ring", "shm"), (6, "ring", "twolevel"), (6, "rd", "twolevel"),
                          (5, "ring", "mixed")])
def test_allreduce_matrix(group, n, algo, mode):
    g = group(n, mode)
    g.set_algo(algo)
    seed = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype not in FLOATS:
                continue
            for count in SIZES:
                seed += 1
                xs = [make_input(dtype, op, count, r, seed) for r in range(n)]
                inplace = count % 2 == 1
                if inplace:
                    bufs = [x.copy() for x in xs]
                    res = g.run_ok(lambda c: c.allreduce(bufs[c.rank], op, out=bufs[c.rank],
                                                         dtype="bfloat16" if dtype == "bfloat16" else None))
                    assert all(r is b for r, b in zip(res, bufs))
                else:
                    res = g.run_ok(lambda c: c.allreduce(xs[c.rank], op,
                                                         dtype="bfloat16" if dtype == "bfloat16" else None))
                assert_identical(res)
                check_close(dtype, op, res[0], reference(dtype, op, xs), xs)
                assert res[0].shape == xs[0].shape


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("mode", ["plain", "striped", "shm"])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float16", "avg"), ("bfloat16", "sum"),
                                      ("int64", "max"), ("float64", "prod"), ("uint8", "sum")])
def test_allreduce_large(group, n, mode, dtype, op):
    g = group(n, mode)
    g.set_algo("default")
    count = (1 << 20) + 3
    xs = [make_input(dtype, op, count, r, 7) for r in range(n)]
    res = g.run_ok(lambda c: c.allreduce(xs[c.rank], op, dtype="bfloat16" if dtype == "bfloat16" else None))
    assert_identical(res)
    check_close(dtype, op, res[0], reference(dtype, op, xs), xs)


# ---- the other collectives ---------------------------------------------------------------------
@pytest.mark.parametrize("n,mode", [(n, "plain") for n in range(1, 7)] + [(2, "striped"), (4, "striped"), (4, "shm"),
                                                                    (3, "shm"), (6, "twolevel"), (5, "mixed"),
                                                                    (2, "cma"), (3, "cma"), (4, "cma")])
def test_allgather_broadcast_alltoall(group, n, mode):
    g = group(n, mode)
    for dtype in DTYPES:
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        for count in SIZES + [1 << 17]:
            xs = [make_input(dtype, "sum", count, r, count) for r in range(n)]
            res = g.run_ok(lambda c: c.allgather(xs[c.rank], **kw))
            assert_identical(res)
            assert res[0].shape == (n, count)
            np.testing.assert_array_equal(res[0], np.stack(xs))
            for root, tree_max in [(0, 0), (n - 1, 1 << 40), (n // 2, 1 << 40), (n // 2, 0)]:
                for c in g.comms:                      # chain (0) or binomial tree (1 << 40)
                    c.backend._comm.bcast_tree_max = tree_max
                bufs = [x.copy() for x in xs]
                g.run_ok(lambda c: c.broadcast(bufs[c.rank], root=root, **kw))
                for b in bufs:
                    np.testing.assert_array_equal(b, xs[root])
            m = (count // n) * n
            if m == 0 and count:
                continue
            ys = [x[:m] for x in xs]
            res = g.run_ok(lambda c: c.alltoall(ys[c.rank], **kw))
            blk = m // n
            for r in range(n):
                want = np.concatenate([ys[i][r * blk:(r + 1) * blk] for i in range(n)]) if m else ys[r]
                np.testing.assert_array_equal(res[r], want)
            bufs = [y.copy() for y in ys]                      # in place
            g.run_ok(lambda c: c.alltoall(bufs[c.rank], out=bufs[c.rank], **kw))
            for r in range(n):
                np.testing.assert_array_equal(bufs[r], res[r])


@pytest.mark.parametrize("n,mode", [(n, "plain") for n in range(1, 7)] + [(3, "striped"), (5, "striped"), (4, "shm"),
                                                                    (3, "shm"), (6, "twolevel")])
def test_reduce_scatter(group, n, mode):
    g = group(n, mode)
    seed = 100
    for dtype in DTYPES:
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        for op in OPS:
            if op == "avg" and dtype not in FLOATS:
                continue
            for count in SIZES + [1 << 16]:
                seed += 1
                xs = [make_input(dtype, op, count, r, seed) for r in range(n)]
                res = g.run_ok(lambda c: c.reduce_scatter(xs[c.rank], op, **kw))
                ref = reference(dtype, op, xs)
                base, extra = divmod(count, n)
                off = 0
                for r in range(n):
                    k = base + (1 if r < extra else 0)
                    assert res[r].size == k
                    check_close(dtype, op, res[r].reshape(-1), ref[off:off + k], [x[off:off + k] for x in xs])
                    off += k


def test_reduce_scatter_shapes(group):
    g = group(3)
    xs = [np.full((6, 2), r + 1, np.float32) for r in range(3)]
    res = g.run_ok(lambda c: c.reduce_scatter(xs[c.rank]))
    for r in range(3):
        assert res[r].shape == (2, 2)
        np.testing.assert_array_equal(res[r], np.full((2, 2), 6, np.float32))


def test_barrier_and_async_order(group):
    g = group(4)
    g.run_ok(lambda c: c.barrier())

    def work(c):
        xs = [np.full(1000, c.rank + i, np.float64) for i in range(5)]
        hs = [c.allreduce_async(x) for x in xs]
        hs.append(c.allgather_async(np.array([c.rank], np.int32)))
        sync = c.allreduce(np.ones(3, np.float32))          # queues behind the async ones
        return [h.wait(30) for h in hs], sync
    res = g.run_ok(work)
    for outs, sync in res:
        for i in range(5):
            np.testing.assert_array_equal(outs[i], np.full(1000, 6 + 4 * i, np.float64))
        np.testing.assert_array_equal(outs[5], np.array([[0], [1], [2], [3]], np.int32))
        np.testing.assert_array_equal(sync, np.full(3, 4, np.float32))


def test_done_callbacks_run_once_with_the_result(group):
    g = group(3)

    def work(c):
        seen, order, done = [], [], threading.Event()
        h = c.allreduce_async(np.full(64, c.rank + 1.0, np.float32))
        h.add_done_callback(lambda hh: (seen.append(hh.result()[0]), order.append("first")))
        h.add_done_callback(lambda hh: (order.append("second"), done.set()))
        assert done.wait(30)
        late = []
        h.add_done_callback(lambda hh: late.append(hh.done()))   # already done: runs at once
        return seen, order, late
    for seen, order, late in g.run_ok(work):
        assert seen == [6.0] and order == ["first", "second"] and late == [True]


def test_done_callback_sees_the_error_and_a_raising_callback_is_contained():
    g = H.ThreadGroup(2, timeout=30)       # its own group: the failure is sticky

    def work(c):
        if c.rank == 1:
            return None
        errs, done = [], threading.Event()
        h = c.allreduce_async(np.ones(8, np.float32), timeout=0.5)    # rank 1 never joins
        h.add_done_callback(lambda hh: 1 / 0)
        h.add_done_callback(lambda hh: (errs.append(hh.exception()), done.set()))
        assert done.wait(30)
        return errs
    try:
        res, _ = g.run(work)
    finally:
        g.close()
    assert "allreduce" in str(res[0][0]) and "0.5" in str(res[0][0])


def test_allreduce_grouped(group):
    g = group(3)

    def work(c):
        arrs = [np.full((2, 3), c.rank, np.float32), np.arange(5, dtype=np.int64) * c.rank,
                np.ones(4, np.float32), np.zeros(0, np.float64)]
        out = c.allreduce_grouped(arrs)
        inp = c.allreduce_grouped(arrs, inplace=True)
        return out, inp, arrs
    for out, inp, arrs in g.run_ok(work):
        np.testing.assert_array_equal(out[0], np.full((2, 3), 3, np.float32))
        np.testing.assert_array_equal(out[1], np.arange(5) * 3)
        np.testing.assert_array_equal(out[2], np.full(4, 3, np.float32))
        assert out[3].shape == (0,)
        assert inp[0] is arrs[0]
        np.testing.assert_array_equal(arrs[1], np.arange(5) * 3)


def test_dlpack_input(group):
    """Any object with __dlpack__ (torch CPU tensors take this path) is used without a copy."""
    g = group(2)

    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()
    bufs = [np.full(10, r + 1.0, np.float32) for r in range(2)]
    g.run_ok(lambda c: c.broadcast(Wrapped(bufs[c.rank]), root=1))
    np.testing.assert_array_equal(bufs[0], np.full(10, 2.0, np.float32))


# ---- property tests ----------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.sampled_from([2, 3, 5]), count=st.integers(0, 3000), root=st.integers(0, 4),
       dtype=st.sampled_from(["float32", "int32", "uint8", "float16"]), algo=st.sampled_from(["ring", "rd", "rh"]))
def test_property_lengths_and_roots(group, n, count, root, dtype, algo):
    g = group(n)
    g.set_algo(algo)
    root %= n
    xs = [make_input(dtype, "max", count, r, count + root) for r in range(n)]
    res = g.run_ok(lambda c: c.allreduce(xs[c.rank], "max"))
    assert_identical(res)
    check_close(dtype, "max", res[0], reference(dtype, "max", xs), xs)
    bufs = [x.copy() for x in xs]
    g.run_ok(lambda c: c.broadcast(bufs[c.rank], root=root))
    for b in bufs:
        np.testing.assert_array_equal(b, xs[root])
    res = g.run_ok(lambda c: c.reduce_scatter(xs[c.rank], "min"))
    ref = reference(dtype, "min", xs)
    np.testing.assert_array_equal(np.concatenate([r.reshape(-1) for r in res]), ref)


# ---- kernels -----------------------------------------------------------------------------------
def test_half_kernels_match_numpy_rounding():
    """float16 reduction = numpy's float32 op rounded to nearest-even float16, incl. specials."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(100000).astype(np.float16)
    b = (rng.standard_normal(100000) * 1e-3).astype(np.float16)
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 6e-8, 65504, 1e-5], np.float16)
    a = np.concatenate([a, special, special[::-1]])
    b = np.concatenate([b, special[::-1], special])
    for op, code in (("sum", 0), ("prod", 1), ("min", 2), ("max", 3)):
        d = a.copy()
        _native.reduce(d.view(np.uint16), b.view(np.uint16), 0, code)
        fa, fb = a.astype(np.float32), b.astype(np.float32)
        with np.errstate(all="ignore"):
            want = {"sum": fa + fb, "prod": fa * fb, "min": np.minimum(fa, fb), "max": np.maximum(fa, fb)}[op].astype(np.float16)
        np.testing.assert_array_equal(d.view(np.uint16)[~np.isnan(want)], want.view(np.uint16)[~np.isnan(want)])
    d = np.array([np.nan, 1.0], np.float16)
    _native.reduce(d.view(np.uint16), np.array([1.0, np.nan], np.float16).view(np.uint16), 0, 2)
    assert np.isnan(d).all()
    f = rng.standard_normal(10000).astype(np.float32)
    x, y = bf16_encode(f), bf16_encode(f[::-1].copy())
    _native.reduce(x, y, 1, 0)
    np.testing.assert_array_equal(x, bf16_encode(bf16_decode(bf16_encode(f)) + bf16_decode(y)))


# ---- usage errors ------------------------------------------------------------------------------
def test_usage_errors(group):
    c = group(1).comms[0]
    with pytest.raises(UsageError, match="unsupported dtype complex128"):
        c.allreduce(np.zeros(3, np.complex128))
    with pytest.raises(UsageError, match="unsupported op"):
        c.allreduce(np.zeros(3, np.float32), op="xor")
    with pytest.raises(UsageError, match="avg.*floating"):
        c.allreduce(np.zeros(3, np.int32), op="avg")
    with pytest.raises(UsageError, match="out has 4 elements"):
        c.allreduce(np.zeros(3, np.float32), out=np.zeros(4, np.float32))
    with pytest.raises(UsageError, match="out has dtype float64"):
        c.allreduce(np.zeros(3, np.float32), out=np.zeros(3, np.float64))
    with pytest.raises(UsageError, match="contiguous"):
        x = np.zeros(6, np.float32)[::2]
        c.allreduce(x, out=x)
    with pytest.raises(UsageError, match="root 3 out of range"):
        c.broadcast(np.zeros(3), root=3)
    with pytest.raises(UsageError, match="timeout must be a finite number > 0"):
        c.barrier(timeout=0)
    with pytest.raises(UsageError, match="expected a numpy array"):
        c.allreduce([1, 2, 3])


def test_mismatched_shapes_are_reported():
    g = H.ThreadGroup(2, timeout=10)
    try:
        _, errs = g.run(lambda c: c.allreduce(np.zeros(10 + c.rank, np.float32)))
        assert all(isinstance(e, CollectiveError) for e in errs)
        assert any("mismatched collective" in str(e) and "count=11" in str(e) for e in errs)
    finally:
        g.close()


def _mismatch_and_missing_rank_are_named(n: int, count: int, every_waiter_names: bool) -> None:
    """A rank with another count is a named mismatch; a rank that never joins is named by those
    that wait for it at the deadline (all of them with ``every_waiter_names``), not waited for."""
    g = H.ThreadGroup(n, timeout=10)
    try:
        _, errs = g.run(lambda c: c.allreduce(np.ones(count + (c.rank == n - 1), np.float32)))
        assert all(isinstance(e, CollectiveError) for e in errs)
        assert any("mismatched collective" in str(e) and f"count={count + 1}" in str(e) for e in errs), errs
    finally:
        g.close()
    g = H.ThreadGroup(n, timeout=10)
    try:
        t0 = time.monotonic()
        _, errs = g.run(lambda c: c.allreduce(np.ones(count, np.float32), timeout=1.0), ranks=range(n - 1))
        assert time.monotonic() - t0 < 5
        assert all(isinstance(errs[r], CollectiveError) for r in range(n - 1))
        named = [r for r in range(n - 1) if f"rank {n - 1} (node{n - 1})" in str(errs[r])]
        assert named and all("timed out after 1.0 s" in str(errs[r]) for r in named), errs
        assert not every_waiter_names or named == list(range(n - 1)), errs
        assert g.comms[0].error is not None                # sticky
    finally:
        g.close()


@pytest.mark.parametrize("n", [5, 8])
def test_recursive_halving_mismatch_and_missing_rank_are_named(n):
    """Recursive halving (the default from 5 ranks for mid-size messages)."""
    assert _native.RH_CHUNK_DEFAULT > (1 << 18) // 8        # 256 KiB: recursive halving at n >= 5
    _mismatch_and_missing_rank_are_named(n, 1 << 16, False)


@pytest.mark.parametrize("n", [2, 3])
def test_direct_exchange_mismatch_missing_rank_and_dead_rank_are_named(n):
    """Direct exchange (the default for small messages on 2-3 ranks): another count or another
    collective is a named mismatch; a rank that never joins is named at the deadline by every
    rank that waits for it (each exchanges with it directly); a dead rank is named."""
    count = 1000                                            # 4 KB: direct exchange
    assert _native.DIRECT_MAX_DEFAULT >= (n - 1) * count * 4
    _mismatch_and_missing_rank_are_named(n, count, True)
    g = H.ThreadGroup(n, timeout=10)
    try:
        _, errs = g.run(lambda c: c.barrier() if c.rank == 0 else c.allreduce(np.ones(count, np.float32)))
        # the rank that sees the mismatch names it and shuts its connections: the others may see that first
        assert all(isinstance(e, CollectiveError) for e in errs), errs
        assert any("mismatched collective" in str(e) and "barrier#1" in str(e) for e in errs), errs
    finally:
        g.close()
    g = H.ThreadGroup(n, timeout=10)
    try:
        g.comms[n - 1].backend._native_comm.abort("rank gone")         # its sockets shut: as if it died
        _, errs = g.run(lambda c: c.allreduce(np.ones(count, np.float32), timeout=5.0), ranks=range(n - 1))
        # a rank that sees the dead one shuts its own connections: a third may see that first
        assert all(isinstance(errs[r], CollectiveError) for r in range(n - 1)), errs
        assert any(f"rank {n - 1} (node{n - 1})" in str(errs[r]) for r in range(n - 1)), errs
    finally:
        g.close()


# ---- deadlines, sticky errors, dead peers, authentication --------------------------------------
def test_timeout_names_peer_and_is_sticky():
    g = H.ThreadGroup(3, timeout=30)
    try:
        t0 = time.monotonic()
        _, errs = g.run(lambda c: c.allreduce(np.ones(1 << 16, np.float32), timeout=1.0), ranks=[0, 1])
        elapsed = time.monotonic() - t0
        assert elapsed < 5
        for r in (0, 1):
            assert isinstance(errs[r], CollectiveError)
        msg0 = str(errs[0])
        assert "allreduce#1" in msg0 and "rank 2 (node2)" in msg0 and "timed out after 1.0 s" in msg0
        assert "bytes done" in msg0
        with pytest.raises(CollectiveError) as again:       # sticky
            g.comms[0].barrier()
        assert str(again.value).splitlines()[0] == msg0.splitlines()[0]
        assert g.comms[0].error == msg0.splitlines()[0]
    finally:
        g.close()


def test_striped_timeout_names_peer_and_stream():
    g = H.ThreadGroup(3, timeout=30, streams=3, threads=2, stripe_min=8)
    try:
        g.set_algo("ring")
        t0 = time.monotonic()
        _, errs = g.run(lambda c: c.allreduce(np.ones(1 << 16, np.float32), timeout=1.0), ranks=[0, 1])
        assert time.monotonic() - t0 < 5
        msg0 = str(errs[0])
        assert isinstance(errs[0], CollectiveError) and isinstance(errs[1], CollectiveError)
        assert "rank 2 (node2) on stream" in msg0 and "of 3 timed out after 1.0 s" in msg0, msg0
        assert "bytes done on that stream" in msg0
        assert g.comms[0].error == msg0.splitlines()[0]      # sticky, one message for all threads
    finally:
        g.close()


def test_wrong_secret_refused_at_connect():
    """A rank with a different secret is refused by its peer before anything is parsed; a raw
    connection sending junk is dropped; the setup fails with messages naming the ranks."""
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    with StoreServer("127.0.0.1", 0, secret=H.SECRET) as server:
        results: dict[int, BaseException | object] = {}

        def rank(r, secret):
            store = StoreClient("127.0.0.1", server.port, H.SECRET, 10)
            try:
                results[r] = RingBackend.create(H.topology(r, 2), store, secret, timeout=3.0)
            except BaseException as e:  # noqa: BLE001
                results[r] = e

        def rogue():
            store = StoreClient("127.0.0.1", server.port, H.SECRET, 10)
            host, _, port = store.get("hpcring/ring/1/addr/0", timeout=5).decode().rpartition(":")
            with socket.create_connection((host, int(port))) as s:
                s.recv(36)
                s.sendall(b"\xff" * 76)
                try:
                    results["rogue"] = s.recv(100)   # closed without an answer
                except ConnectionResetError:
                    results["rogue"] = b""
        ts = [threading.Thread(target=rank, args=(0, H.SECRET)), threading.Thread(target=rogue),
              threading.Thread(target=rank, args=(1, b"not-the-job-secret"))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert results["rogue"] == b""
    assert isinstance(results[1], BootstrapError)
    assert "rank 0 (node0)" in str(results[1]) and "refused" in str(results[1])
    assert isinstance(results[0], BootstrapError)
    assert "no authenticated connection from rank(s) 1 (node1)" in str(results[0])


def test_processes_end_to_end():
    """Spawned ranks rendezvous through the real store and connect over loopback TCP."""
    for n in (2, 4):
        out = H.spawn_ranks(n, H.target_matrix, 5)
        assert sorted(out) == list(range(n)), out
        for r in range(n):
            assert out[r][0] == "ok", out[r]
        for key in out[0][1]:
            if key.startswith("input"):
                continue
            vals = {out[r][1][key] for r in range(n) if not key.startswith("reduce_scatter")}
            assert len(vals) <= 1, key
        count = 1 << 18
        xs = [np.frombuffer(out[r][1][f"input{count}"], np.int64) for r in range(n)]
        np.testing.assert_array_equal(np.frombuffer(out[0][1][f"allreduce{count}"], np.int64), np.sum(xs, 0))
        np.testing.assert_array_equal(np.frombuffer(out[1][1][f"broadcast{count}"], np.int64), xs[n - 1])
        rs = np.concatenate([np.frombuffer(out[r][1][f"reduce_scatter{count}"], np.int64) for r in range(n)])
        np.testing.assert_array_equal(rs, np.max(xs, 0))


def test_killed_peer_fails_others_within_deadline():
    deadline = 20.0
    out = H.spawn_ranks(3, H.target_kill, 2, 64 << 20, 0.3, timeout=deadline)
    assert 2 not in out                       # the victim died without reporting
    for r in (0, 1):
        status, msg, secs = out[r]
        assert status == "error", out[r]
        assert "CollectiveError" in msg and "allreduce#" in msg
        assert secs < deadline
    assert any("rank 2 (node2)" in out[r][1] for r in (0, 1)), out


# ---- shared memory: deadlines, dead peers, no segment left behind -------------------------------
def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("hpcring-")} if os.path.isdir("/dev/shm") else set()


def test_shm_names_differ_per_job_and_array_task():
    """An array's tasks share the secret and may run at once on one host: each has its own
    segment (one leader's unlink of a leftover must never be another task's live segment)."""
    from hpcring.collectives.ring import shm_name
    names = {shm_name(H.SECRET, job, "world/1", "local0") for job in ("7/None", "8/None", "7/0", "7/1", "7_0/0")}
    assert len(names) == 5 and all(n.startswith("/hpcring-") and len(n) == 41 for n in names)
    assert shm_name(H.SECRET, "7/0", "world/1", "local0") == shm_name(H.SECRET, "7/0", "world/1", "local0")
    assert shm_name(H.SECRET, "7/0", "world/1", "local0") != shm_name(H.SECRET, "7/0", "world/1", "local1")
    assert shm_name(H.SECRET, "7/0", "world/1", "local0") != shm_name(H.SECRET, "7/0", "world/2", "local0")


def test_shm_timeout_names_peer_and_is_sticky():
    g = H.ThreadGroup(3, timeout=30, hosts=("h",) * 3)
    try:
        t0 = time.monotonic()
        _, errs = g.run(lambda c: c.allreduce(np.ones(1 << 16, np.float32), timeout=1.0), ranks=[0, 1])
        assert time.monotonic() - t0 < 5
        msg0 = str(errs[0])
        assert isinstance(errs[0], CollectiveError), errs
        assert "allreduce#1" in msg0 and "rank 2 (h)" in msg0 and "timed out after 1.0 s" in msg0, msg0
        with pytest.raises(CollectiveError):                 # sticky
            g.comms[0].barrier()
    finally:
        g.close()


@pytest.mark.parametrize("name", ["alltoall", "barrier"])
def test_shm_alltoall_and_barrier_run_in_shared_memory(name):
    """On one host alltoall and barrier go through the segment: a missing rank is reported from the
    shared-memory wait (not a TCP recv), and a rank in another collective is named."""
    g = H.ThreadGroup(3, timeout=30, hosts=("h",) * 3)
    call = {"alltoall": lambda c: c.alltoall(np.ones(3 << 12, np.float32), timeout=1.0),
            "barrier": lambda c: c.barrier(timeout=1.0)}[name]
    try:
        _, errs = g.run(call, ranks=[0, 1])
        msg = str(errs[0])
        assert isinstance(errs[0], CollectiveError), errs
        assert f"{name}#1" in msg and "rank 2 (h)" in msg and f"(shared memory, {name}) timed out" in msg, msg
    finally:
        g.close()
    g = H.ThreadGroup(2, timeout=30, hosts=("h",) * 2)
    other = {"alltoall": lambda c: c.barrier(timeout=5.0),
             "barrier": lambda c: c.alltoall(np.ones(8, np.float32), timeout=5.0)}[name]
    try:
        _, errs = g.run(lambda c: (call if c.rank == 0 else other)(c))
        assert all(isinstance(e, CollectiveError) for e in errs), errs
        assert any("mismatch" in str(e) or "out of step" in str(e) for e in errs), errs
    finally:
        g.close()


def test_shm_sigkilled_rank_is_named_and_leaves_no_segment():
    before = _segments()
    deadline = 20.0
    out = H.spawn_ranks(3, H.target_sigkill, 2, 8 << 20, 0.3, timeout=deadline, hosts=("h",) * 3)
    assert 2 not in out
    for r in (0, 1):
        status, msg, secs = out[r]
        assert status == "error", out[r]
        assert "allreduce#" in msg and secs < deadline
    assert any("recv from rank 2 (h) failed: connection closed by peer (EOF)" in out[r][1] and "it died during the "
               "shared-memory" in out[r][1] for r in (0, 1)), out
    assert _segments() <= before                          # nothing new left in /dev/shm


@pytest.mark.parametrize("n", [2, 3])
def test_direct_reads_take_two_barriers_where_the_segment_takes_one_per_piece(n):
    """allgather, broadcast and alltoall of 256 KiB per peer with 4 KiB pieces: the segment
    signals once a piece (64+), a direct read (process_vm_readv) twice in all; results exact,
    in place too; below the cut (cma_min, cma_gather_min) the segment runs again."""
    x = [np.arange(1 << 16, dtype=np.float32) + r for r in range(n)]
    phases = {}
    for cma in (None, 1 << 16):
        g = H.ThreadGroup(n, hosts=("h",) * n, cma=cma)
        try:
            calls = {"allgather": lambda c: c.allgather(x[c.rank]),
                     "broadcast": lambda c: c.broadcast(x[c.rank].copy(), root=n - 1),
                     "alltoall": lambda c: c.alltoall(np.tile(x[c.rank], n)),
                     "alltoall in place": lambda c: (lambda b: c.alltoall(b, out=b))(np.tile(x[c.rank], n)),
                     "small allgather": lambda c: c.allgather(x[c.rank][:(1 << 14) - 1])}
            for name, call in calls.items():
                before = [c.backend._comm.shm_phase for c in g.comms]
                res = g.run_ok(call)
                phases[cma, name] = {c.backend._comm.shm_phase - b for c, b in zip(g.comms, before)}
                want = {"allgather": np.stack(x), "broadcast": x[n - 1],
                        "small allgather": np.stack([v[:(1 << 14) - 1] for v in x])}.get(name)
                for r in range(n):
                    np.testing.assert_array_equal(res[r], want if want is not None else np.concatenate(x))
        finally:
            g.close()
    for name in ("allgather", "broadcast", "alltoall", "alltoall in place"):
        assert phases[1 << 16, name] == {2}, (name, phases)
        assert min(phases[None, name]) >= 64 // n, (name, phases)
    assert phases[1 << 16, "small allgather"] == phases[None, "small allgather"] and \
        min(phases[None, "small allgather"]) > 2, phases


def test_direct_reads_need_every_rank_of_the_host(monkeypatch):
    """The host's ranks read each other's memory only when all can and none turned it off: one
    rank's failed probe (or HPCRING_RING_CMA=0) leaves every rank on the segment."""
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    from hpcring.collectives import ring_shm

    class Probe:
        def __init__(self, answer):
            self.answer, self.shm_cma = answer, None

        def shm_cma_probe(self):
            return self.answer

    srv = StoreServer("127.0.0.1", 0, secret=H.SECRET)
    try:
        for answers, env, want in [([(True, 0)] * 3, "1", True), ([(True, 0), (False, 1), (True, 0)], "1", False),
                                   ([(True, 0)] * 3, "0", False), ([(True, 0), (False, 0)], "1", False)]:
            monkeypatch.setenv("HPCRING_RING_CMA", env)
            base = f"w{uuid.uuid4().hex[:6]}"
            comms = [Probe(a) for a in answers]
            got = [None] * len(comms)

            def one(r):
                with StoreClient("127.0.0.1", srv.port, H.SECRET, timeout=10) as st:
                    got[r] = ring_shm._agree_cma(comms[r], st, base, r, list(range(len(comms))), time.monotonic() + 10)
            ts = [threading.Thread(target=one, args=(r,)) for r in range(len(comms))]
            for t in ts:
                t.start()
            for t in ts:
                t.join(15)
            assert got == [want] * len(comms), (answers, env, got)
    finally:
        srv.close()


def test_ranks_of_one_host_read_each_other_directly_and_a_killed_reader_is_named():
    """Processes of one host (RingBackend.create's setup) agree on direct reads, which alltoall
    takes from 512 KiB blocks on at 3 ranks (two barriers; ring_shm.default_cma_alltoall_min),
    allgather from 64 KiB where the host's ranks have a core each (ring_shm.default_cma_allgather_min;
    else the segment, as broadcast: one barrier for one piece); a rank SIGKILLed inside a
    direct-read alltoall is named by its peers within the deadline and leaves no segment behind."""
    from hpcring.collectives.ring_shm import default_cma_allgather_min, default_cma_alltoall_min
    n, count = 3, 1 << 16                                 # 512 KiB a block: 3 ranks' default cut
    out = H.spawn_ranks(n, H.target_direct_reads, count, hosts=("h",) * n)
    assert sorted(out) == list(range(n)) and all(out[r][0] == "ok" for r in range(n)), out
    xs = [np.arange(count, dtype=np.int64) * (r + 1) for r in range(n)]
    direct = default_cma_allgather_min(n)
    for r in range(n):
        res = out[r][1]
        assert res["cma"] is True and res["allgather_min"] == direct, res
        assert res["alltoall_min"] == default_cma_alltoall_min(n) == count * 8, res
        assert res["phases"] == {"allgather": 2 if direct else 1, "broadcast": 1, "alltoall": 2}, res
        np.testing.assert_array_equal(np.frombuffer(res["allgather"], np.int64), np.concatenate(xs))
        np.testing.assert_array_equal(np.frombuffer(res["broadcast"], np.int64), xs[1])
        np.testing.assert_array_equal(np.frombuffer(res["alltoall"], np.int64), np.concatenate(xs))
    before = _segments()
    deadline = 20.0
    out = H.spawn_ranks(3, H.target_sigkill, 2, 12 << 20, 0.3, "alltoall", timeout=deadline, hosts=("h",) * 3)
    assert 2 not in out
    for r in (0, 1):
        status, msg, secs = out[r]
        assert status == "error" and "alltoall#" in msg and "rank 2 (h)" in msg and secs < deadline, out[r]
    assert _segments() <= before


@pytest.mark.parametrize("var,value", [("HPCRING_RING_STREAMS", "many"), ("HPCRING_RING_STREAMS", "0"),
                                       ("HPCRING_RING_THREADS", "17"), ("HPCRING_RING_SHM", "maybe"),
                                       ("HPCRING_RH_CHUNK", "-1"), ("HPCRING_RH_CHUNK", "64k")])
def test_ring_env_is_checked(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(UsageError, match=var):
        RingBackend.create(H.topology(0, 2), None, H.SECRET, 5.0)


def test_default_allgather_direct_reads_where_each_rank_has_a_core():
    from hpcring.collectives.ring_shm import default_cma_allgather_min
    assert default_cma_allgather_min(2, cores=2) == 64 << 10
    assert default_cma_allgather_min(8, cores=64) == 64 << 10
    assert default_cma_allgather_min(3, cores=2) == 0 and default_cma_allgather_min(8, cores=2) == 0


def test_default_alltoall_direct_reads_come_down_with_the_rank_count():
    from hpcring.collectives.ring_shm import default_cma_alltoall_min
    assert [default_cma_alltoall_min(n) for n in (2, 3, 4, 5, 8, 64)] == \
        [1 << 20, 512 << 10, 512 << 10, 128 << 10, 128 << 10, 128 << 10]


def test_cutover_attributes_are_independent_and_refuse_negatives(group):
    """The native Comm's cut-overs (one getter/setter by field offset) each read back what was
    set, leave the others alone, and refuse a negative value."""
    c = group(2).comms[0].backend._comm
    names = ("rd_threshold", "rh_chunk", "bcast_tree_max", "twolevel_min", "cma_min", "cma_gather_min",
             "cma_allgather_min", "direct_max")
    before = {a: getattr(c, a) for a in names}
    try:
        for i, a in enumerate(names):
            setattr(c, a, 1000 + i)
            assert getattr(c, a) == 1000 + i
            assert all(getattr(c, b) == before[b] for b in names[i + 1:])
            with pytest.raises(OverflowError):
                setattr(c, a, -1)
            assert getattr(c, a) == 1000 + i
    finally:
        for a, v in before.items():
            setattr(c, a, v)


# ---- one round of direct exchange for the other collectives (native/direct_others.c) -----------
@pytest.mark.parametrize("n", [2, 3])
def test_direct_exchange_collectives_give_the_ring_results(group, n):
    """allgather, reduce_scatter (every op, chunks uneven and empty), alltoall (in place too) and
    barrier with direct exchange (the default below direct_max on up to 3 ranks) and with the ring
    or pairwise steps (direct_max 0): the same exact results."""
    g = group(n)

    def run_all(direct_max):
        for c in g.comms:
            c.backend.direct_max = direct_max
        out = []
        for count in (0, 1, n - 1, 7, 1000):
            xs = [make_input("int64", "sum", count, r, 40 + count) for r in range(n)]
            out.append(g.run_ok(lambda c: c.allgather(xs[c.rank])))
            for op in ("sum", "prod", "min", "max"):
                out.append(g.run_ok(lambda c: c.reduce_scatter(xs[c.rank], op)))
            ys = [np.repeat(x, n) for x in xs]
            out.append(g.run_ok(lambda c: c.alltoall(ys[c.rank])))
            bufs = [y.copy() for y in ys]
            g.run_ok(lambda c: c.alltoall(bufs[c.rank], out=bufs[c.rank]))
            out.append(bufs)
            out.append(g.run_ok(lambda c: c.barrier()))
        return out
    try:
        direct, stepped = run_all(_native.DIRECT_MAX_DEFAULT), run_all(0)
    finally:
        for c in g.comms:
            c.backend.direct_max = _native.DIRECT_MAX_DEFAULT
    assert len(direct) == len(stepped)
    for a, b in zip(direct, stepped):
        for x, y in zip(a, b):
            if x is None:
                assert y is None
            else:
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("first,second", [("allgather", "alltoall"), ("barrier", "reduce_scatter"),
                                          ("alltoall", "allreduce")])
def test_direct_exchange_names_a_mismatched_collective(first, second):
    """Rank 0 calls one collective, ranks 1-2 another, all in one round of direct exchange: every
    rank fails within the deadline, and the headers' check names the mismatch."""
    g = H.ThreadGroup(3, timeout=5.0)
    calls = {"allgather": lambda c: c.allgather(np.ones(6, np.float32)),
             "alltoall": lambda c: c.alltoall(np.ones(6, np.float32)),
             "barrier": lambda c: c.barrier(),
             "reduce_scatter": lambda c: c.reduce_scatter(np.ones(6, np.float32)),
             "allreduce": lambda c: c.allreduce(np.ones(6, np.float32))}
    try:
        t0 = time.monotonic()
        _, errs = g.run(lambda c: calls[first if c.rank == 0 else second](c))
        assert time.monotonic() - t0 < 5.0 + 3.0
        assert all(isinstance(e, CollectiveError) for e in errs), errs
        assert any("mismatched collective" in str(e) for e in errs), errs
    finally:
        g.close()
