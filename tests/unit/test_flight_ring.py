"""The flight recorder's ring of records written in C (``hpcring._native.Flight``),
the ring backend's allreduce that records itself in the same native call, and the recorder's
one history over both stores (recorder.py)."""
from __future__ import annotations

import random
import sys
import threading
import types

import numpy as np
import pytest

from helpers.ring import ThreadGroup  # noqa: E402

from hpcring import _native  # noqa: E402
from hpcring.collectives.recorder import FlightRecorder, _SKIP  # noqa: E402
from hpcring.collectives.ring import DTYPE_CODES, OP_CODES  # noqa: E402
from hpcring.errors import CollectiveError  # noqa: E402

FIELDS = ("seq", "op", "dtype", "count", "root", "timeout", "state", "t_queued", "t_started", "t_ended",
          "site", "error")


def row(t) -> dict:
    return dict(zip(FIELDS, t))


# ---------------------------------------------------------------------------------------------
# the C ring alone
# ---------------------------------------------------------------------------------------------
def test_a_record_is_started_then_done_with_its_fields_and_call_site():
    f = _native.Flight(8, ())
    line = sys._getframe().f_lineno + 1
    seq = f.record("allreduce", "float32", 1024, None, 7.5)
    r = row(f.get(seq))
    assert (r["seq"], r["op"], r["dtype"], r["count"], r["root"], r["timeout"], r["state"]) == (
        1, "allreduce", "float32", 1024, None, 7.5, "started")
    assert r["t_queued"] == r["t_started"] and r["t_ended"] is None and r["error"] is None
    assert r["site"] == (__file__, line, "test_a_record_is_started_then_done_with_its_fields_and_call_site")
    assert f.end(seq) is True
    r2 = row(f.get(seq))
    assert r2["state"] == "done" and r2["t_ended"] >= r2["t_started"] and f.seq == 1


def test_the_site_skips_the_given_prefixes():
    def inner(f):                       # this file is "the package": skipped, the caller is the site
        return f.record("barrier", "none", 0, 3, 1.0)
    f = _native.Flight(4, (__file__,))
    seq = inner(f)
    assert row(f.get(seq))["site"][0] != __file__ and row(f.get(seq))["root"] == 3
    assert f.get(0) is None                                                     # nothing at 0
    g = _native.Flight(4, ("",))        # every frame skipped: no site
    assert row(g.get(g.record("x", "y", 1, None, 1.0)))["site"] is None


def test_failed_records_keep_their_error_and_a_stale_end_writes_nothing():
    f = _native.Flight(2, ())
    a = f.record("allreduce", "int64", 3, None, 1.0)
    assert f.end(a, "allreduce#1 recv from rank 1 (node1) timed out") is True
    assert row(f.get(a))["state"] == "failed" and "timed out" in row(f.get(a))["error"]
    f.record("b", "t", 0, None, 1.0)
    f.record("c", "t", 0, None, 1.0)    # capacity 2: slot of a reused
    assert f.get(a) is None and f.end(a) is False
    assert [row(t)["op"] for t in f.snapshot()] == ["b", "c"]


@pytest.mark.parametrize("seed", range(6))
def test_snapshot_is_the_newest_capacity_records_in_order_for_any_mix(seed):
    """Generated: records, ends and numbers taken for Python records, at random; the snapshot
    holds exactly the ring's records among the newest ``capacity`` numbers, oldest first."""
    rnd = random.Random(seed)
    cap = rnd.randint(1, 9)
    f = _native.Flight(cap, ())
    mine, states = [], {}
    for _ in range(rnd.randint(0, 60)):
        if rnd.random() < 0.3:
            f.take()
            continue
        q = f.record(rnd.choice(["allreduce", "broadcast"]), "float32", rnd.randint(0, 9), None, 1.0)
        mine.append(q)
        states[q] = "started"
        if rnd.random() < 0.7:
            err = rnd.choice([None, "boom"])
            f.end(q, err)
            states[q] = "done" if err is None else "failed"
    want = [q for q in mine if q > f.seq - cap]
    snap = [row(t) for t in f.snapshot()]
    assert [r["seq"] for r in snap] == want
    assert all(r["state"] == states[r["seq"]] for r in snap)


def test_bad_arguments_are_refused():
    for cap in (0, -1, 1 << 25):
        with pytest.raises(ValueError, match="capacity"):
            _native.Flight(cap, ())
    with pytest.raises(TypeError):
        _native.Flight(4, ("ok", 3))
    f = _native.Flight(4, ())
    with pytest.raises(ValueError, match="root"):
        f.record("broadcast", "uint8", 1, -2, 1.0)
    with pytest.raises(TypeError):
        f.end(f.record("a", "b", 1, None, 1.0), 42)
    assert f.get(-5) is None and f.get(99) is None


# ---------------------------------------------------------------------------------------------
# the recorder: one history over both stores
# ---------------------------------------------------------------------------------------------
def test_recorder_merges_both_stores_by_sequence_and_keeps_the_capacity():
    rec = FlightRecorder(0, 2, "ring", capacity=5, group="tp", members=(4, 6))
    a = rec.queue("allreduce", "float32", 1, None, 9.0)            # Python store: 1
    s2 = rec.flight.record("allreduce", "float32", 2, None, 9.0)   # C ring: 2
    b = rec.begin("broadcast", "uint8", 3, 1, 9.0)                 # Python: 3
    s4 = rec.flight.record("allreduce", "int32", 4, None, 9.0)     # C: 4
    rec.flight.end(s4)
    assert [r.seq for r in rec.records()] == [1, 2, 3, 4] and rec.seq == 4 and (a.seq, s2, b.seq) == (1, 2, 3)
    merged = rec.records()
    assert merged[1].state == "started" and merged[3].state == "done" and merged[3].count == 4
    assert merged[1].group == ("tp", (4, 6)) and merged[1].to_dict()["members"] == [4, 6]
    assert [r.seq for r in rec.in_flight()] == [1, 2, 3] and rec.last_done() == 4
    for _ in range(6):
        rec.flight.end(rec.flight.record("barrier", "none", 0, None, 1.0))
    assert [r.seq for r in rec.records()] == [6, 7, 8, 9, 10] and len(rec.records(2)) == 2
    assert rec.summary()["seq"] == 10


def test_record_of_a_slot_writes_its_failure_through(tmp_path):
    rec = FlightRecorder(1, 2, "mpi", capacity=4)
    seq = rec.flight.record("allreduce", "float64", 8, None, 2.0)
    copy = rec.record_of(seq)
    assert copy.state == "started" and copy.backend == "mpi" and copy.site.startswith("test_flight_ring.py:")
    FlightRecorder.finish(copy, CollectiveError("allreduce#1 did not complete"))
    assert rec.records()[-1].state == "failed" and rec.records()[-1].error == str(copy.error)
    dumped = rec.dump(tmp_path / "f.json").read_text()
    assert '"failed"' in dumped and "did not complete" in dumped
    assert rec.record_of(999) is None


def test_skip_prefixes_are_the_python_walks():
    """The C walk and recorder._caller skip the same frames: a record made through a helper
    inside the package is sited at the test's line either way."""
    rec = FlightRecorder(0, 1, "ring")
    assert rec.flight.capacity == rec.capacity
    line = sys._getframe().f_lineno + 1
    s = rec.flight.record("allreduce", "float32", 1, None, 1.0)
    assert rec.record_of(s).site == f"test_flight_ring.py:{line} in test_skip_prefixes_are_the_python_walks"
    assert isinstance(_SKIP, tuple) and all(isinstance(p, str) for p in _SKIP)


# ---------------------------------------------------------------------------------------------
# the ring backend's recorded allreduce, and the Communicator's short path over it
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def group():
    g = ThreadGroup(3, timeout=20.0)
    yield g
    g.close()


@pytest.mark.parametrize("store", ["c", "python"])
def test_short_path_records_match_the_general_path(group, store):
    """Both stores (the ring's native call writing the record; the record/end pair around a
    backend without it, as MPI) give the general path's records and results."""
    def run(comm, short):
        comm.short_path = short
        if store == "python":
            comm.backend.allreduce_rec = None
        try:
            x = np.arange(10, dtype=np.float64) + comm.rank
            y = comm.allreduce(x, "max")
            return y, comm.recorder.records(1)[0].to_dict()
        finally:
            comm.short_path = True
            comm.backend.__dict__.pop("allreduce_rec", None)
    short = group.run_ok(lambda c: run(c, True))
    general = group.run_ok(lambda c: run(c, False))
    for (ys, ds), (yg, dg) in zip(short, general):
        assert np.array_equal(ys, yg) and np.array_equal(ys, np.arange(10) + 2.0)
        assert ds["seq"] + 1 == dg["seq"]
        for k in ("op", "dtype", "count", "root", "backend", "timeout", "state", "error", "site"):
            assert ds[k] == dg[k], k


_OTHER_CALLS = {
    "allgather": lambda c, x: c.allgather(x),
    "reduce_scatter": lambda c, x: c.reduce_scatter(x, "max"),
    "broadcast": lambda c, x: c.broadcast(x, 2),
    "alltoall": lambda c, x: c.alltoall(x),
    "barrier": lambda c, x: c.barrier(),
}


@pytest.mark.parametrize("kind", sorted(_OTHER_CALLS))
@pytest.mark.parametrize("store", ["c", "python"])
def test_other_short_paths_record_as_the_general_path(group, store, kind):
    """The other collectives' short path: the ring's fast path writing the record in C (armed
    by a first call), or the record/end pair around the backend (the fast path off, as on MPI),
    give the general path's records (op, dtype, count, root, state, call site) and results."""
    group.run_ok(lambda c: c.barrier())

    def run(comm, short):
        comm.short_path = short
        fast = comm._fast
        if store == "python":
            comm._fast = False
        try:
            assert bool(comm._fast) == (store == "c")
            x = np.arange(12, dtype=np.float64) + 10 * comm.rank
            y = _OTHER_CALLS[kind](comm, x.copy())
            return y, comm.recorder.records(1)[0].to_dict()
        finally:
            comm.short_path = True
            comm._fast = fast
    short = group.run_ok(lambda c: run(c, True))
    general = group.run_ok(lambda c: run(c, False))
    for (ys, ds), (yg, dg) in zip(short, general):
        assert (ys is None and yg is None) or np.array_equal(ys, yg)
        assert ds["seq"] + 1 == dg["seq"] and ds["op"] == kind and ds["state"] == "done"
        for k in ("op", "dtype", "count", "root", "backend", "timeout", "state", "error", "site"):
            assert ds[k] == dg[k], k
        line = _OTHER_CALLS[kind].__code__.co_firstlineno   # the user's line, worked out late
        assert ds["site"] == f"test_flight_ring.py:{line} in <lambda>"


def test_recorded_allreduce_failure_names_its_record():
    g = ThreadGroup(2, timeout=0.5)
    try:
        comm = g.comms[0]
        seen = []
        comm.watchdog = types.SimpleNamespace(on_failure=lambda c, rec, e: seen.append(rec) or e)
        with pytest.raises(CollectiveError) as ei:
            comm.allreduce(np.ones(64, np.float32))      # rank 1 never comes
        rec = comm.recorder.records()[-1]
        assert rec.state == "failed" and rec.error == str(ei.value) and rec.t_ended >= rec.t_started
        assert seen and seen[0].seq == rec.seq == 1 and seen[0].state == "failed"
        assert comm.recorder.in_flight() == []
    finally:
        g.close()


def test_a_second_thread_is_refused_before_anything_is_recorded():
    g = ThreadGroup(2, timeout=5.0)
    try:
        nat, be = g.comms[0].backend._native_comm, g.comms[0].backend
        f = _native.Flight(8, ())
        started = threading.Event()

        def first():
            started.set()
            try:
                be.allreduce_rec(f, np.ones(4, np.float32), np.empty(4, np.float32), "float32", "sum", 2.0)
            except CollectiveError:
                pass                                      # rank 1 never comes: times out
        t = threading.Thread(target=first)
        t.start()
        started.wait()
        for _ in range(200):                              # until the first call holds the lock
            if f.seq == 1:
                break
            threading.Event().wait(0.005)
        with pytest.raises(RuntimeError, match="another thread"):
            _native.Comm.allreduce_rec(nat, f, np.ones(4, np.float32), np.empty(4, np.float32),
                                       DTYPE_CODES["float32"], OP_CODES["sum"], 1.0)
        assert f.seq == 1                                 # the refused call recorded nothing
        t.join(10)
        assert not t.is_alive() and row(f.get(1))["state"] == "failed"
    finally:
        g.close()
