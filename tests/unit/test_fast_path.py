"""The fast path (fastpath.py ``_fast_try``: the ring's whole short path in one C call,
``Comm.short``) against the general path (``short_path = False``): taken for the common call,
the same results and flight records; every odd call (generated over each argument) left to
Python with the general path's outcome and no sequence number spent; a failure reported as the
general path reports it. Ring ranks are threads over socketpairs (tests/helpers/ring.py), two
over TCP and three sharing memory."""
from __future__ import annotations

import itertools
import re
import threading
import types

import numpy as np
import pytest

from helpers.ring import ThreadGroup

from hpcring.collectives.backends import FLOAT_DTYPES, OPS
from hpcring.errors import CollectiveError, UsageError

NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "int32": np.int32,
      "int64": np.int64, "uint8": np.uint8}
SAME = ("op", "dtype", "count", "root", "backend", "timeout", "site", "state", "error")
KINDS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "barrier")


@pytest.fixture(scope="module", params=["tcp2", "shm3"])
def group(request):
    g = (ThreadGroup(2, timeout=20.0) if request.param == "tcp2"
         else ThreadGroup(3, timeout=20.0, hosts=("node0",) * 3))
    g.run_ok(lambda c: c.barrier())             # the first call arms the fast path
    assert all(c._fast for c in g.comms)
    yield g
    g.close()


class NoPython:
    """Every Python short path and the general path fail loudly on these communicators: proves
    the C call did the work."""

    def __init__(self, comms):
        self.comms = comms

    def __enter__(self):
        def boom(*a, **k):
            raise AssertionError("a Python path ran")
        for c in self.comms:
            c._short_host = c._allreduce_host = c._allreduce = c._allgather = c._reduce_scatter = boom
            c._broadcast = c._alltoall = c._barrier = boom
        return self

    def __exit__(self, *exc):
        for c in self.comms:
            for name in ("_short_host", "_allreduce_host", "_allreduce", "_allgather", "_reduce_scatter",
                         "_broadcast", "_alltoall", "_barrier"):
                c.__dict__.pop(name, None)


def values(tag: str, rank: int, shape) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n) * 3 + rank) % 7 + 1).astype(NP[tag]).reshape(shape)


def invoke(comm, kind: str, x, out="none", op="sum", root=None):
    """One call site for both paths (the records' site is this line)."""
    if kind == "barrier":
        return comm.barrier()
    if kind == "broadcast":
        return comm.broadcast(x, root=comm.size - 1 if root is None else root)
    kw = {} if isinstance(out, str) and out == "none" else {"out": out}
    if kind in ("allreduce", "reduce_scatter"):
        return getattr(comm, kind)(x, op, **kw)
    return getattr(comm, kind)(x, **kw)


def n_out(kind: str, x, n: int) -> int:
    return {"allgather": x.size * n, "reduce_scatter": x.size // n}.get(kind, x.size)


def outcome(comm, fn):
    """(result copy or None, the newest record's fields) or the error's type and text."""
    seq = comm.recorder.seq
    try:
        r = fn(comm)
    except Exception as e:                      # noqa: BLE001 - compared as data
        return ("error", type(e).__name__, re.sub(r"#\d+", "#N", str(e)), comm.recorder.seq - seq)
    d = comm.recorder.records(1)[0].to_dict() if comm.recorder.seq > seq else None
    return ("ok", digest(r), None if d is None else {k: d[k] for k in SAME}, comm.recorder.seq - seq)


def digest(r):
    if isinstance(r, list):
        return [digest(v) for v in r]
    return None if r is None else (type(r).__name__, r.shape, r.dtype.str, r.tobytes())


def both_paths(g, fn):
    """fn on every rank through the general path, then through the armed short path."""
    def phase(short):
        def run(comm):
            comm.short_path = short
            try:
                return outcome(comm, fn)
            finally:
                comm.short_path = True
        return run
    return g.run_ok(phase(False)), g.run_ok(phase(True))


CASES = [(k, m) for k in KINDS for m in ("new", "out", "outflat", "inplace")
         if (m == "new" or k not in ("broadcast", "barrier")) and (m != "inplace" or k in ("allreduce", "alltoall"))]


@pytest.mark.parametrize("kind,mode", CASES)
@pytest.mark.parametrize("tag", list(NP))
def test_the_common_call_is_one_c_call_with_the_general_paths_result_and_record(group, kind, mode, tag):
    n = group.n
    shape = (6 * n, 4)

    def fn(comm):
        x = values(tag, comm.rank, shape)
        if mode == "out":
            out = np.full(n_out(kind, x, n), 99, x.dtype).reshape(-1, 4)
        elif mode == "outflat":
            out = np.full(n_out(kind, x, n), 99, x.dtype)
        else:
            out = x if mode == "inplace" else "none"
        ops = [o for o in OPS if o != "avg" or tag in FLOAT_DTYPES] if kind in ("allreduce", "reduce_scatter") else [None]
        res = []
        for op in ops:
            y = x.copy()
            o = y if mode == "inplace" else out
            r = invoke(comm, kind, y, o, op)
            if kind == "barrier":
                assert r is None
            elif mode == "inplace" or kind == "broadcast":
                assert r is y
            elif mode in ("out", "outflat"):
                assert r is out
            else:
                assert r is not y and r.dtype == y.dtype
            res.append(None if r is None else r.copy())
        return res
    general, _ = both_paths(group, fn)
    with NoPython(group.comms):
        short = group.run_ok(lambda c: outcome(c, fn))
    assert short == general
    assert all(o[0] == "ok" and o[3] >= 1 for o in short)


def odd_cases():
    """Every argument of the fast call made odd in turn: (name, kind, build(comm) -> kwargs of
    :func:`invoke`). Each must leave the C call with nothing done and end as the general path
    ends (a result, or its error)."""
    f32 = lambda c, n=24: values("float32", c.rank, (n,))      # noqa: E731
    ro = lambda a: (a.setflags(write=False), a)[1]             # noqa: E731

    class Sub(np.ndarray):
        pass
    xs = {
        "strided": lambda c: f32(c, 48)[::2],
        "fortran": lambda c: np.asfortranarray(values("float32", c.rank, (6, 4))),
        "subclass": lambda c: f32(c).view(Sub),
        "list": lambda c: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        "complex": lambda c: f32(c).astype(np.complex64),
        "bool": lambda c: f32(c) > 3,
        "byteswapped": lambda c: f32(c).astype(">f4"),
        "readonly": lambda c: ro(f32(c)),
        "zero-d": lambda c: np.float32(c.rank + 1) * np.ones((), np.float32),
        "empty": lambda c: np.zeros(0, np.float32),
        "uneven": lambda c: f32(c, 7),
    }
    outs = {
        "wrong-dtype": lambda c, k, x: np.zeros(n_out(k, x, c.size), np.float64),
        "wrong-size": lambda c, k, x: np.zeros(n_out(k, x, c.size) + 1, np.float32),
        "strided-out": lambda c, k, x: np.zeros(2 * n_out(k, x, c.size), np.float32)[::2],
        "readonly-out": lambda c, k, x: ro(np.zeros(n_out(k, x, c.size), np.float32)),
        "list-out": lambda c, k, x: [0.0] * n_out(k, x, c.size),
        "sub-out": lambda c, k, x: np.zeros(n_out(k, x, c.size), np.float32).view(Sub),
        "x-itself": lambda c, k, x: x,
    }
    for (name, mk), kind in itertools.product(xs.items(), KINDS[:5]):
        yield f"x={name}", kind, (lambda mk: lambda c: {"x": mk(c)})(mk)
    for (name, mk), kind in itertools.product(outs.items(), ("allreduce", "allgather", "reduce_scatter", "alltoall")):
        yield f"out={name}", kind, (lambda mk, kind: lambda c: (lambda x: {"x": x, "out": mk(c, kind, x)})(f32(c)))(mk, kind)
    for op, kind in itertools.product(("avg-int", "xor", 1, None, "SUM"), ("allreduce", "reduce_scatter")):
        if op == "avg-int":
            yield f"op={op}", kind, lambda c: {"x": values("int32", c.rank, (24,)), "op": "avg"}
        else:
            yield f"op={op}", kind, (lambda op: lambda c: {"x": f32(c), "op": op})(op)
    for root in (True, -1, 3, np.int64(0), 0.0, "0"):
        yield f"root={root!r}", "broadcast", (lambda root: lambda c: {"x": f32(c), "root": root})(root)


ODD = list(odd_cases())


@pytest.mark.parametrize("name,kind,build", ODD, ids=[f"{k}-{n}" for n, k, _ in ODD])
def test_an_odd_call_leaves_the_c_call_and_ends_as_the_general_path_ends(group, name, kind, build):
    general, short = both_paths(group, lambda c: invoke(c, kind, **build(c)))
    assert short == general


def test_a_failure_on_the_fast_path_is_reported_as_on_the_general_path():
    """Armed by a first call; rank 0 then calls each collective that rank 1 never joins."""
    def hang(kind: str, short: bool):
        g = ThreadGroup(2, timeout=0.6)
        seen = []
        comm = g.comms[0]
        try:
            g.run_ok(lambda c: c.barrier())
            comm.short_path = short
            comm.watchdog = types.SimpleNamespace(
                on_failure=lambda c, rec, e: seen.append((rec.op, rec.seq, rec.state)) or e)
            x = np.ones(1000, np.float32)
            with pytest.raises(CollectiveError) as ei:
                if short:
                    with NoPython([comm]):
                        invoke(comm, kind, x)
                else:
                    invoke(comm, kind, x)
            with pytest.raises(CollectiveError) as after:
                invoke(comm, "allreduce", x)                  # the communicator stays failed
            d = comm.recorder.records()[-2].to_dict()
        finally:
            g.close()
        mask = lambda s: re.sub(r"\d+\.\d+", "N", s)          # noqa: E731 - waited times differ
        return mask(str(ei.value)), {k: d[k] for k in SAME}, seen, mask(str(after.value))
    for kind in KINDS:
        short, general = hang(kind, True), hang(kind, False)
        assert f"{kind}#2" in short[0] and "deadline" in short[0], short
        assert short[1]["state"] == "failed" and short[1]["error"] and short[1]["op"] == kind
        assert short[2][0] == (kind, 2, "failed")
        assert short == general


def test_a_closed_communicator_and_a_second_thread_end_as_on_the_python_short_path():
    g = ThreadGroup(2, timeout=3.0)
    comm = g.comms[0]
    try:
        g.run_ok(lambda c: c.barrier())
        assert comm._fast
        started = threading.Event()
        errs = {}

        def first():
            started.set()
            try:
                comm.allgather(np.ones(4, np.float32))        # rank 1 never comes: times out
            except CollectiveError:
                pass
        t = threading.Thread(target=first)
        t.start()
        started.wait(5)
        for _ in range(200):                                  # until the first call holds the comm
            seq = comm.recorder.seq
            try:
                comm.barrier()
            except RuntimeError as e:
                errs["fast"] = (str(e), comm.recorder.seq - seq, comm.recorder.records(1)[0].state)
                break
        fast, comm._fast = comm._fast, False                  # the Python short path, the same way
        for _ in range(200):
            seq = comm.recorder.seq
            try:
                comm.barrier()
            except RuntimeError as e:
                errs["python"] = (str(e), comm.recorder.seq - seq, comm.recorder.records(1)[0].state)
                break
        comm._fast = fast
        t.join(10)
        assert not t.is_alive()
        assert errs["fast"] == errs["python"]
        assert "already running" in errs["fast"][0] and errs["fast"][1:] == (1, "failed")
    finally:
        g.close()
    closed = {}
    for how, fast in (("fast", comm._fast), ("python", False)):
        comm._fast = fast
        with pytest.raises(Exception) as ei:
            comm.allreduce(np.ones(4, np.float32))
        closed[how] = (type(ei.value).__name__, str(ei.value))
    assert closed["fast"] == closed["python"], closed


def test_a_timeout_is_taken_by_the_c_call_and_a_bad_one_refused_before_a_record(group):
    with NoPython(group.comms):
        res = group.run_ok(lambda c: (c.allgather(values("float32", c.rank, (8,)), timeout=7.5),
                                      c.recorder.records(1)[0].timeout))
    assert all(t == 7.5 for _, t in res)
    comm = group.comms[0]
    seq = comm.recorder.seq
    for bad in (0, -1.0, float("nan"), "soon"):
        with pytest.raises(UsageError, match="timeout"):
            comm.barrier(timeout=bad)
    assert comm.recorder.seq == seq
