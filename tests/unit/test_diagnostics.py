"""Flight recorder, hang report rules and the pre-collective check (no network beyond socketpairs)."""
from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import pytest

from hpcring.collectives.recorder import DONE, FAILED, STARTED, FlightRecorder, call_site, locate
from hpcring.diagnostics.report import diagnose, parse_link, stuck_seq
from hpcring.ranks import rank_ranges
from hpcring.errors import CollectiveError

HOSTS = ["node1", "node1", "node2", "node2", "node3", "node3"]


def rec(seq, op="allreduce", dtype="float32", count=1024, root=None, state="done", t_started=100.0, timeout=10.0,
        site="train.py:88 in step"):
    return {"seq": seq, "op": op, "dtype": dtype, "count": count, "root": root, "state": state,
            "t_started": t_started, "timeout": timeout, "site": site, "backend": "ring"}


def snap(rank, records, error=None, where="in allreduce at train.py:88 (step)"):
    done = [r["seq"] for r in records if r["state"] == "done"]
    return {"rank": rank, "host": HOSTS[rank], "records": records, "last_done": max(done, default=0),
            "error": error, "where": where}


def healthy(rank, seq=5, **kw):
    return snap(rank, [rec(s) for s in range(1, seq)] + [rec(seq, state="failed", **kw)])


# -- rank ranges ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks, text", [([0, 1, 2, 4], "0-2,4"), ([5], "5"), ([3, 1, 2], "1-3"), ([], ""),
                                         ([0, 2, 4, 5, 6], "0,2,4-6")])
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


# -- report rules -----------------------------------------------------------------------------------
def test_missing_rank_is_named_with_its_location():
    snaps = {r: healthy(r) for r in range(6) if r != 5}
    snaps[5] = snap(5, [rec(s) for s in range(1, 5)], where="in load_batch at data.py:12")
    rep = diagnose(6, HOSTS, snaps)
    assert rep.categories["missing"] == [5]
    assert rep.categories["joined"] == [0, 1, 2, 3, 4]
    assert "rank 5 (node3) never joined" in rep.headline and "allreduce#5" in rep.headline
    assert "load_batch at data.py:12" in rep.details[5] and "last completed #4" in rep.details[5]
    text = rep.text()
    assert "ranks 0-4: in allreduce at train.py:88 (step)" in text
    assert json.loads(json.dumps(rep.to_dict()))["categories"]["missing"] == [5]


def test_different_collective_and_mismatches():
    snaps = {r: healthy(r) for r in range(6)}
    snaps[1] = healthy(1, op="barrier", dtype=None, count=0)
    snaps[2] = healthy(2, count=1000)
    snaps[3] = healthy(3, dtype="float64")
    rep = diagnose(6, HOSTS, snaps)
    assert rep.categories["different"] == [1] and "barrier#5" in rep.details[1]
    assert rep.categories["mismatch"] == [2, 3]
    assert "count=1000 (others 1024)" in rep.details[2]
    assert "dtype=float64 (others float32)" in rep.details[3]
    assert rep.headline == "allreduce#5: ranks 2-3 (node2) called it with different arguments"


def test_root_mismatch():
    snaps = {r: healthy(r, op="broadcast", root=0) for r in range(3)}
    snaps[2] = healthy(2, op="broadcast", root=1)
    rep = diagnose(3, HOSTS[:3], snaps)
    assert rep.categories["mismatch"] == [2] and "root=1 (others 0)" in rep.details[2]


def test_dead_exited_and_unreachable_ranks():
    eof = "allreduce#5 recv from rank 3 (node2) failed: connection closed by peer (EOF), 10/4096 bytes done"
    timeout = "allreduce#5 recv from rank 5 (node3) timed out after 10.0 s, 0/4096 bytes done"
    snaps = {0: healthy(0), 1: healthy(1), 2: snap(2, healthy(2)["records"], error=eof)}
    snaps[4] = snap(4, healthy(4)["records"], error=timeout)
    exits = {1: {"pid": 77, "last_done": 4}}
    del snaps[1]
    rep = diagnose(6, HOSTS, snaps, exits)
    assert rep.categories["dead"] == [3] and "seen by rank 2 (node2)" in rep.details[3]
    assert rep.categories["exited"] == [1] and "after collective #4" in rep.details[1]
    assert rep.categories["unreachable"] == [5]
    assert rep.headline == "allreduce#5: rank 3 (node2) died"
    assert rep.links == []                      # stalls are a consequence here, not the cause


def test_stalled_link_when_everyone_joined():
    err = "allreduce#5 recv from rank 1 (node1) timed out after 10.0 s, 2097152/8388608 bytes done"
    snaps = {r: healthy(r) for r in range(3)}
    snaps[2]["error"] = err
    rep = diagnose(3, HOSTS[:3], snaps, interface="eth0")
    assert rep.links and rep.links[0]["from"] == 1 and rep.links[0]["to"] == 2
    assert "link rank 1 (node1) -> rank 2 (node2) stalled" in rep.headline
    assert "on eth0: 2.0 MiB of 8.0 MiB moved" in rep.text()


def test_slow_rank_joined_late():
    snaps = {r: healthy(r) for r in range(3)}
    snaps[1]["records"][-1]["t_started"] = 100.0 + 6.0        # deadline 10 s: > max(1, 2.5) late
    rep = diagnose(3, HOSTS[:3], snaps)
    assert [s["rank"] for s in rep.slow] == [1]
    assert "joined late" in rep.headline


def test_one_rank_view_says_nothing_about_others():
    trig = {"rank": 2, "error": "allreduce#5 send to rank 3 (node2) timed out", "op": rec(5, state="failed")}
    rep = diagnose(6, HOSTS, {2: healthy(2)}, trigger=trig, side_channel=False)
    assert rep.categories["unreachable"] == [] and rep.categories["joined"] == [2]
    assert "failed on rank 2" in rep.headline
    assert "one rank's view" in rep.text()


def test_stuck_seq_and_parse_link():
    snaps = {0: healthy(0, seq=7), 1: healthy(1, seq=6)}
    assert stuck_seq(snaps, {}) == 6
    ln = parse_link("barrier#3 send to rank 4 (n4) failed: sendmsg(): Connection reset by peer, 5/24 bytes done", 1)
    assert (ln["from"], ln["to"], ln["gone"], ln["timed_out"]) == (1, 4, True, False)
    assert parse_link("something else", 0) is None
    shm = parse_link("allreduce#7 rank 2 (node1) died during the shared-memory allreduce (this node; its "
                     "connection closed without an error report)", 3)
    assert shm["peer"] == 2 and shm["gone"] and not shm["timed_out"] and shm["seen_by"] == 3


# -- recorder ----------------------------------------------------------------------------------------
def test_recorder_states_capacity_and_dump(tmp_path):
    fr = FlightRecorder(3, 8, "ring", capacity=16)
    records = [fr.queue("allreduce", "float32", i, None, 5.0) for i in range(40)]
    assert fr.seq == 40 and len(fr.records()) == 16 and fr.records()[0].seq == 25
    FlightRecorder.start(records[-1])
    assert records[-1].state == STARTED and fr.in_flight()[-1].seq == 40
    FlightRecorder.finish(records[-2])
    FlightRecorder.finish(records[-1], RuntimeError("boom"))
    assert records[-2].state == DONE and records[-1].state == FAILED and records[-1].error == "boom"
    assert fr.last_done() == 39
    data = json.loads(fr.dump(tmp_path / "f.json", {"reason": "test"}).read_text())
    assert data["rank"] == 3 and data["reason"] == "test" and len(data["records"]) == 16
    assert records[0].site.startswith("test_diagnostics.py:")      # the caller outside hpcring


def test_call_site_and_locate_name_user_code():
    assert call_site(1).startswith("test_diagnostics.py:")
    started, release = threading.Event(), threading.Event()

    def load_batch():
        started.set()
        release.wait(10)
    t = threading.Thread(target=load_batch)
    t.start()
    started.wait(5)
    try:
        where = locate(sys._current_frames()[t.ident])
    finally:
        release.set()
        t.join()
    assert where.startswith("in load_batch at test_diagnostics.py:")


# -- pre-collective check on a real (socketpair) ring -------------------------------------------
def test_precheck_fails_at_once_on_every_rank():
    from helpers.ring import ThreadGroup
    g = ThreadGroup(3, timeout=20.0)
    for c in g.comms:
        c.precheck = True
    ok, errs = g.run(lambda c: c.allreduce(np.ones(8, np.float32)))
    assert errs == [None] * 3 and all((r == 3).all() for r in ok)
    t0 = time.monotonic()
    _, errs = g.run(lambda c: c.allreduce(np.ones(8 if c.rank != 1 else 9, np.float32)))
    assert time.monotonic() - t0 < 5.0            # well before the 20 s deadline
    for e in errs:
        assert isinstance(e, CollectiveError)
        assert "ranks 0,2 called allreduce#2(count=8, dtype=float32)" in str(e)
        assert "rank 1 called allreduce#2(count=9, dtype=float32)" in str(e)
