"""Elastic training's pure parts: who is in the next round (membership.decide), the coordinator
and a worker's side over a real in-process store, ElasticSampler's partition across a changed
world, the State contract with a plain broadcast, hvd.elastic.run without the driver, the
driver's arguments."""
from __future__ import annotations

import threading
import time

import pytest

from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.elastic import protocol as P
from hpcring.elastic.coordinator import Coordinator
from hpcring.elastic.member import ElasticJobError, Member
from hpcring.elastic.membership import ADDED, DEAD, LEFT, NO_UPDATE, Worker, decide

SECRET = b"s" * 32


def workers(*specs) -> dict[str, Worker]:
    """``("w0", waiting, status, reason)`` -> the coordinator's table (seq = order given)."""
    out = {}
    for i, spec in enumerate(specs):
        wid, waiting, status, reason = (list(spec) + [False, "alive", "start"][len(spec) - 1:])[:4]
        out[wid] = Worker(wid, i, "h", status=status, waiting=waiting, reason=reason)
    return out


def d(ws, round_no=1, members=(), *, start_np=2, min_np=1, max_np=3, resets=0, reset_limit=None, waited=0.0,
      timeout=10.0):
    return decide(ws, round_no, list(members), start_np=start_np, min_np=min_np, max_np=max_np, resets=resets,
                  reset_limit=reset_limit, waited_s=waited, timeout_s=timeout)


# -- membership.decide ---------------------------------------------------------------------------
def test_first_round_waits_for_np_then_takes_the_oldest_up_to_max_np():
    assert d(workers(("a", True)), 0).action == "wait"
    r = d(workers(("a", True), ("b", True), ("c", True), ("e", True)), 0, max_np=3)
    assert (r.action, r.members) == ("form", ["a", "b", "c"])
    late = d(workers(("a", True)), 0, waited=11.0)
    assert late.action == "error" and "only 1 of 2 workers" in late.message


def test_a_steady_round_announces_newcomers_only_with_room():
    ws = workers(("a",), ("b",), ("n", True))
    assert d(ws, 1, ["a", "b"], max_np=3).notify == ADDED
    assert d(ws, 1, ["a", "b"], max_np=2).notify == NO_UPDATE
    assert d(workers(("a",), ("b",)), 1, ["a", "b"]).action == "wait"


def test_a_lost_member_aborts_the_round_and_the_survivors_form_the_next_in_their_order():
    ws = workers(("a",), ("b", False, DEAD), ("c",))
    r = d(ws, 1, ["c", "b", "a"])
    assert (r.action, r.abort) == ("wait", True)
    ws["a"].waiting, ws["a"].reason = True, "error"
    assert d(ws, 1, ["c", "b", "a"]).action == "wait"          # c has not come back yet
    ws["c"].waiting, ws["c"].reason = True, "error"
    r = d(ws, 1, ["c", "b", "a"])
    assert (r.action, r.members) == ("form", ["c", "a"])          # old rank order, oldest first


def test_newcomers_come_after_the_old_members_up_to_max_np():
    ws = workers(("n1", True), ("a", True, "alive", "interrupt"), ("b", True, "alive", "interrupt"), ("n2", True))
    r = d(ws, 1, ["b", "a"], max_np=3)
    assert (r.action, r.members, r.abort) == ("form", ["b", "a", "n1"], False)


def test_interrupted_members_coming_back_do_not_abort_the_others():
    ws = workers(("a", True, "alive", "interrupt"), ("b",))
    assert (d(ws, 1, ["a", "b"]).action, d(ws, 1, ["a", "b"]).abort) == ("wait", False)
    ws["a"].reason = "error"
    assert d(ws, 1, ["a", "b"]).abort is True


def test_fewer_than_min_np_waits_for_newcomers_then_fails():
    ws = workers(("a", True, "alive", "error"), ("b", False, DEAD))
    assert d(ws, 1, ["a", "b"], min_np=2).action == "wait"
    r = d(ws, 1, ["a", "b"], min_np=2, waited=11.0)
    assert r.action == "error" and "fewer than min_np 2" in r.message
    ws["n"] = Worker("n", 5, "h", waiting=True)
    assert d(ws, 1, ["a", "b"], min_np=2).members == ["a", "n"]


def test_the_reset_limit_counts_rounds_after_the_first():
    ws = workers(("a", True, "alive", "interrupt"))
    assert d(ws, 1, ["a"], resets=0, reset_limit=1).action == "form"
    r = d(ws, 2, ["a"], resets=1, reset_limit=1)
    assert r.action == "error" and "reset limit 1" in r.message


def test_members_that_all_finished_turn_late_newcomers_away():
    ws = workers(("a", False, LEFT), ("n", True))
    assert d(ws, 1, ["a"]).action == "finished"
    assert d(workers(("a", False, LEFT)), 1, ["a"]).action == "wait"
    lost = d(workers(("a", False, DEAD), ("n", True)), 1, ["a"])
    assert lost.action == "error" and "no worker holds the committed state" in lost.message


# -- coordinator and members over a real store ------------------------------------------------------
@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, secret=SECRET)
    yield server
    server.close()


def test_members_join_rounds_hear_aborts_and_a_silent_worker_counts_dead(store):
    said = []
    coord = Coordinator(StoreClient("127.0.0.1", store.port, SECRET), start_np=2, min_np=1, max_np=3,
                        dead_after_s=1.0, say=said.append).start()
    addr = f"127.0.0.1:{store.port}"
    a, b = Member(addr, SECRET, wid="a"), Member(addr, SECRET, wid="b")
    try:
        got = {}
        ts = [threading.Thread(target=lambda m=m: got.__setitem__(m.wid, m.join(timeout=10))) for m in (a, b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
        assert {w: (r.number, r.size) for w, r in got.items()} == {"a": (1, 2), "b": (1, 2)}
        assert sorted(r.rank for r in got.values()) == [0, 1]
        aborted = threading.Event()
        a.on_abort(1, lambda msg: aborted.set())
        b._stop.set()                                   # b goes silent (frozen, cut off)
        assert aborted.wait(10), said                    # counted dead after 1 s: round 1 aborted
        assert any("worker b lost (no heartbeat" in s for s in said), said
        r2 = a.join("error", timeout=10)
        assert (r2.number, r2.members, r2.rank) == (2, ("a",), 0)
        with pytest.raises(ElasticJobError, match="counted dead"):
            b.join("error", timeout=5)
        # a newcomer: the member hears the notification; the next round takes it after a's reset
        heard = []
        a.listeners = lambda stamp, res: heard.append((stamp, res))
        c = Member(addr, SECRET, wid="c")
        t = threading.Thread(target=lambda: got.__setitem__("c", c.join(timeout=10)))
        t.start()
        end = time.monotonic() + 10
        while not heard and time.monotonic() < end:
            time.sleep(0.05)
        assert heard and heard[0][1] == ADDED
        r3 = a.join("interrupt", timeout=10)
        t.join(10)
        assert r3.members == ("a", "c") and got["c"].rank == 1 and r3.updated == heard[0][0]
        c.leave()
    finally:
        a.leave()
        coord.stop()


def test_the_driver_reports_an_exit_at_once(store):
    coord = Coordinator(StoreClient("127.0.0.1", store.port, SECRET), start_np=2, min_np=1, max_np=2,
                        dead_after_s=100.0, say=lambda s: None)
    client = StoreClient("127.0.0.1", store.port, SECRET)
    for wid in ("w0", "w1"):
        client.set(P.req(client.add(P.NREQ, 1)), P.dumps({"wid": wid, "host": "h", "after": 0, "reason": "start"}))
    coord.tick(time.monotonic())
    assert (coord.round_no, coord.members) == (1, ["w0", "w1"])
    coord.report("w0", DEAD, "killed by signal 9")
    coord.tick(time.monotonic())
    assert coord.workers["w0"].status == DEAD and client.check(P.expelled("w0")) == b"killed by signal 9"
    assert client.check(P.ABORT) == b"1"                 # w1 breaks out of round 1's collectives
    client.set(P.req(client.add(P.NREQ, 1)), P.dumps({"wid": "w1", "host": "h", "after": 1, "reason": "error"}))
    coord.tick(time.monotonic())
    assert P.loads(client.check(P.round_key(2)))["members"] == ["w1"]


# -- ElasticSampler -------------------------------------------------------------------------------
class World:
    def __init__(self, monkeypatch, size: int, rank: int = 0) -> None:
        import hpcring.torch as hvd
        self.size, self.rank = size, rank
        monkeypatch.setattr(hvd, "size", lambda: self.size)
        monkeypatch.setattr(hvd, "rank", lambda: self.rank)


def test_sampler_deals_the_rest_of_the_epoch_over_a_shrunk_world(monkeypatch):
    pytest.importorskip("torch")
    from hpcring.torch.elastic.sampler import ElasticSampler
    world = World(monkeypatch, 3)
    data = list(range(30))
    seen = []
    samplers = []
    for r in range(3):
        world.rank = r
        samplers.append(ElasticSampler(data, shuffle=True, seed=7))
    shares = [list(s) for s in samplers]
    assert sorted(i for sh in shares for i in sh) == data         # a partition, no padding
    for step in range(2):                                         # two batches of 2 on 3 ranks
        for r, s in enumerate(samplers):
            seen += shares[r][step * 2:step * 2 + 2]
            s.record_batch(step, 2)
    assert samplers[0].processed_num == 12
    state = samplers[0].state_dict()
    world.size = 2
    rest = []
    for r in range(2):
        world.rank = r
        s = ElasticSampler(data, shuffle=True, seed=7)
        s.load_state_dict(state)
        assert len(s) == 9
        rest += list(s)
    assert sorted(seen + rest) == data                             # every sample once across the shrink
    s.set_epoch(1)
    assert s.processed_num == 0 and len(s) == 15 and list(s) != rest


def test_sampler_pads_an_uneven_share_like_distributed_sampler(monkeypatch):
    pytest.importorskip("torch")
    from hpcring.torch.elastic.sampler import ElasticSampler
    world = World(monkeypatch, 4)
    got = []
    for r in range(4):
        world.rank = r
        s = ElasticSampler(list(range(10)), shuffle=False)
        got.append(list(s))
    assert [len(g) for g in got] == [3, 3, 3, 3] and got[0] == [0, 4, 8] and got[3] == [3, 7, 1]


# -- State / ObjectState with a plain broadcast ------------------------------------------------------
def test_object_state_commit_restore_sync_and_host_updates():
    pytest.importorskip("torch")
    from hpcring.torch import HostsUpdatedInterrupt
    from hpcring.torch.elastic import ObjectState
    root = {}
    st = ObjectState(lambda obj: root.setdefault("v", obj), lambda: 1, epoch=3, batch=[1])
    st.epoch = 4
    st.restore()
    assert st.epoch == 3
    st.epoch = 5
    st.save()
    st.epoch = 6
    st.restore()
    assert st.epoch == 5
    root["v"] = {"epoch": 9, "batch": [2]}                       # rank 0's saved state
    st.sync()
    assert (st.epoch, st.batch) == (9, [2])
    bcast = ObjectState(lambda obj: obj, lambda: 0, x=1)
    bcast.check_host_updates()
    bcast.on_hosts_updated(2, 2)
    bcast.on_hosts_updated(3, 1)                                  # both newer than the last: folded
    bcast.on_hosts_updated(1, 1)                                  # older than 3 by then: skipped
    with pytest.raises(HostsUpdatedInterrupt) as e:
        bcast.commit()
    assert e.value.skip_sync is False                             # added and removed: sync
    bcast.check_host_updates()                                    # answered
    bcast.on_hosts_updated(3, 2)                                  # not newer: nothing
    bcast.check_host_updates()
    bcast.on_hosts_updated(4, 1)
    with pytest.raises(HostsUpdatedInterrupt) as e:
        bcast.check_host_updates()
    assert e.value.skip_sync is True                              # removed only


def test_on_reset_runs_reset_then_the_callbacks_in_order():
    pytest.importorskip("torch")
    from hpcring.torch.elastic import ObjectState
    order = []

    class S(ObjectState):
        def reset(self):
            order.append("reset")
    st = S(lambda o: o, lambda: 0, x=1)
    st.register_reset_callbacks([lambda: order.append("a")])
    st.register_reset_callbacks([lambda: order.append("b")])
    st.on_hosts_updated(1, 2)
    st.on_reset()
    assert order == ["reset", "a", "b"]


def test_run_without_the_elastic_driver_restores_then_lets_the_failure_through(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("HPCRING_ELASTIC_STORE", raising=False)
    import hpcring.torch as hvd
    calls = []

    class St(hvd.elastic.ObjectState):
        def sync(self):
            calls.append("sync")

        def restore(self):
            calls.append("restore")

    @hvd.elastic.run
    def train(state):
        calls.append("train")
        raise hvd.HorovodInternalError("a peer died")
    with pytest.raises(hvd.HorovodInternalError, match="a peer died"):
        train(St(lambda o: o, lambda: 0, x=1))
    assert calls == ["sync", "train", "restore"]


# -- the driver's arguments --------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--np", "2", "--min-np", "3", "--", "x"], "--min-np (3) <= --np (2)"),
    (["--np", "3", "--max-np", "2", "--", "x"], "--np (3) <= --max-np (2)"),
    (["--np", "2"], "give the command after --, or --serve"),
    (["--np", "2", "--reset-limit", "-1", "--", "x"], "--reset-limit must be >= 0"),
])
def test_driver_refuses_bad_arguments(argv, message, capsys):
    from hpcring.elastic.driver import parse
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_driver_defaults_min_and_max_to_np():
    from hpcring.elastic.driver import parse
    a = parse(["--np", "3", "--", "python", "t.py"])
    assert (a.min_np, a.max_np, a.command) == (3, 3, ["python", "t.py"])


def test_a_request_numbered_but_not_yet_written_is_read_later_not_dropped(store):
    coord = Coordinator(StoreClient("127.0.0.1", store.port, SECRET), start_np=1, min_np=1, max_np=1,
                        say=lambda s: None)
    client = StoreClient("127.0.0.1", store.port, SECRET)
    n = client.add(P.NREQ, 1)                      # a worker stalled between its add and its set
    t0 = time.monotonic()
    coord.tick(t0)
    coord.tick(t0 + 5.0)
    assert coord.round_no == 0 and coord._seen == 0
    client.set(P.req(n), P.dumps({"wid": "w0", "host": "h", "after": 0, "reason": "start"}))
    coord.tick(t0 + 6.0)
    assert coord.round_no == 1 and coord.members == ["w0"]
    rec = P.loads(client.check(P.round_key(1)))
    assert rec["sync"] is True                      # a newcomer: every rank syncs
