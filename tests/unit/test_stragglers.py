"""Straggler verdicts: the rules on generated windows, the rows on the wire, and the watcher's rounds
over a real store with real flight recorders."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.collectives.recorder import FlightRecorder
from hpcring.diagnostics import stragglers as sg
from hpcring.diagnostics.straggler_watch import StragglerWatch
from hpcring.jobreport import read_stragglers

SECRET = b"s" * 32


def rows_for(rng, n, w=50, late=None, noise_ms=3.0, transfer_ms=1.0, compute_ms=20.0, slow_compute=None):
    """Rows of a window in which rank r arrives ``late[r]`` ms after the others (plus noise): the
    others wait that long inside each collective, so their time inside grows by it."""
    late = late or {}
    arrive = rng.exponential(noise_ms, size=(n, w))
    for r, ms in late.items():
        arrive[r] += ms
    last = arrive.max(axis=0)
    inside = (last - arrive + transfer_ms) / 1e3
    out = []
    for r in range(n):
        c = (slow_compute or {}).get(r, 1.0) * compute_ms * w / 1e3
        out.append(sg.Row(r, 100, inside[r], c))
    return out


HOSTS6 = ("node1", "node1", "node2", "node2", "node3", "node3")


def test_a_late_rank_is_named_with_its_host_share_lateness_and_compute():
    rng = np.random.default_rng(1)
    v = sg.judge(rows_for(rng, 6, late={4: 6.0}, slow_compute={4: 1.3}), HOSTS6, op_names="allreduces")
    assert v is not None and v.kind == "rank" and v.ranks == [4] and v.host == "node3"
    assert v.share > 0.5 and v.figures["behind_share"] > 0.95 and 4.0 < v.median_ms < 9.0 and v.compute_ratio == pytest.approx(1.3, rel=0.01)
    line = v.line()
    assert line.startswith("straggler: rank 4 (node3) arrived last in ") and "of the last 50 allreduces" in line
    assert "1.30x the others'" in line


def test_a_slow_node_whose_ranks_take_turns_is_named_as_the_node():
    rng = np.random.default_rng(2)
    v = sg.judge(rows_for(rng, 6, late={2: 8.0, 3: 8.0}), HOSTS6)
    assert v is not None and v.kind == "node" and v.host == "node2" and v.ranks == [2, 3]
    assert v.line().startswith("straggler: node node2 (ranks 2-3) arrived last")


@pytest.mark.parametrize("n", [2, 3, 6, 8])
@pytest.mark.parametrize("noise_ms", [0.3, 3.0, 30.0])
def test_uniform_noise_gives_no_verdict_in_500_windows(n, noise_ms):
    rng = np.random.default_rng(n * 100 + int(noise_ms * 10))
    hosts = tuple(f"node{r // 2}" for r in range(n))
    found = [sg.judge(rows_for(rng, n, noise_ms=noise_ms), hosts) for _ in range(500)]
    assert [v.line() for v in found if v] == []


def test_lateness_below_the_floor_is_not_named():
    rng = np.random.default_rng(3)
    rows = rows_for(rng, 4, late={1: 1.0}, noise_ms=0.05)
    assert sg.judge(rows, ("a",) * 4) is None                            # 1 ms < min_ms 2 ms
    assert sg.judge(rows, ("a",) * 4, sg.Rules(min_ms=0.5, min_frac=0)).ranks == [1]


def test_the_floor_grows_with_the_time_between_collectives():
    rng = np.random.default_rng(4)
    rows = rows_for(rng, 4, late={1: 6.0}, noise_ms=0.05, compute_ms=1000.0)   # 6 ms late in 1 s steps
    assert sg.judge(rows, ("a",) * 4) is None                            # under 5% of the gap
    assert sg.judge(rows, ("a",) * 4, sg.Rules(min_frac=0.001)).ranks == [1]


def test_windows_with_records_missing_on_a_rank_are_not_judged():
    rng = np.random.default_rng(5)
    rows = rows_for(rng, 3, late={0: 10.0})
    rows[2].inside[:45] = np.nan                  # only 5 collectives kept by every rank
    assert sg.judge(rows, ("a", "b", "c")) is None
    assert sg.judge(rows[:1], ("a",)) is None


def test_a_row_survives_the_wire_and_foreign_values_are_refused():
    row = sg.Row(7, 1234, np.array([0.001, 0.5, 2.0]), 3.25)
    back = sg.Row.decode(row.encode())
    assert (back.rank, back.first, back.compute) == (7, 1234, 3.25)
    assert np.allclose(back.inside, row.inside, rtol=1e-6)
    blob = row.encode()
    for bad in (b"", b"HRS1", b"XXXX" + blob[4:], blob[:-1], blob + b"\0"):
        assert sg.Row.decode(bad) is None


class Rec:
    def __init__(self, seq, start, end, state="done", op="allreduce"):
        self.seq, self.t_started, self.t_ended, self.state, self.op = seq, start, end, state, op


def test_window_of_takes_exactly_the_window_and_counts_overlap_once():
    recs = [Rec(10, 0.0, 1.0), Rec(11, 0.5, 2.0), Rec(12, 3.0, 3.5), Rec(9, -5, -4), Rec(13, 9, 10)]
    row = sg.window_of(recs, 10, 3, rank=2)
    assert row.rank == 2 and row.first == 10 and list(row.inside) == [1.0, 1.5, 0.5]
    assert row.compute == pytest.approx(1.0)      # 0..3.5 less the union [0,2] and [3,3.5]
    assert sg.window_of(recs[:2], 10, 3, 0) is None                   # one not kept
    assert sg.window_of([Rec(10, 0, 1), Rec(11, 1, 2, "failed"), Rec(12, 2, 3)], 10, 3, 0) is None


# ---------------------------------------------------------------------------- the watcher's rounds

class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size
        self.recorder = FlightRecorder(rank, size, "ring", capacity=256)


def run_ops(comms, count, t0, late=None, compute=0.02):
    """``count`` allreduces on every rank's recorder, rank r arriving ``late[r]`` s after the others."""
    late = late or {}
    for k in range(count):
        start = t0 + k * (compute + 0.005)
        end = start + 0.005 + max(late.values(), default=0)
        for c in comms:
            rec = c.recorder.begin("allreduce", "float32", 4, None, 10.0)
            c.recorder.finish(rec)
            rec.t_started, rec.t_ended = start + late.get(c.rank, 0.0), end
    return t0 + count * (compute + 0.005)


def watchers(tmp_path, n=4, window=20, hosts=None, **group):
    """``group``: a group watcher's ``name``, ``members``, ``group`` and ``tag``."""
    server = StoreServer("127.0.0.1", 0, secret=SECRET)
    comms = [FakeComm(r, n) for r in range(n)]
    out = io.StringIO()
    hosts = hosts or tuple(f"node{r // 2 + 1}" for r in range(n))
    ws = [StragglerWatch(c, StoreClient("127.0.0.1", server.port, SECRET, timeout=5.0), hosts, window=window,
                         period=0.1, folder=str(tmp_path) if c.rank == 0 else None, out=out, **group) for c in comms]
    return server, comms, ws, out


def round_(ws):
    ws[0].tick()
    for w in ws[1:]:
        w.tick()
    ws[0].tick()


def test_rank_0_names_the_straggler_once_records_it_and_says_when_it_clears(tmp_path):
    server, comms, ws, out = watchers(tmp_path)
    try:
        t = run_ops(comms, 3, 1000.0)
        ws[0].tick()                                   # names the window starting at seq 4
        assert ws[0]._want == (4, 20)
        t = run_ops(comms, 20, t, late={3: 0.008})
        for w in ws[1:]:
            w.tick()
        ws[0].tick()
        assert out.getvalue().count("straggler:") == 1 and "rank 3 (node2)" in out.getvalue()
        for _ in range(2):                             # the same verdict: not printed again
            t = run_ops(comms, 20, t, late={3: 0.008})
            round_(ws)
        assert out.getvalue().count("straggler:") == 1
        assert ws[0].windows >= 2
        t = run_ops(comms, 60, t)                      # nobody late any more
        round_(ws)
        round_(ws)
        text = out.getvalue()
        assert text.count("straggler:") == 2 and "none in the last 20 collectives (rank 3 (node2)" in text
        entries, problems = read_stragglers(tmp_path)
        assert problems == [] and [e["verdict"] and e["verdict"]["ranks"] for e in entries] == [[3], None]
        live = json.loads((tmp_path / "live.json").read_text())
        assert [r["rank"] for r in live["ranks"]] == [0, 1, 2, 3] and live["last_op"] == "allreduce"
        logged = [json.loads(ln) for ln in (tmp_path / "diag" / "windows.jsonl").read_text().splitlines()]
        assert len(logged) == 1 and logged[0]["ops"] == 20 and logged[0]["ops_per_s"] > 0   # at most one per 5 s
    finally:
        for w in ws:
            w.store.close()
        server.close()


def test_a_window_a_rank_never_finishes_is_given_up_and_the_next_is_named(tmp_path):
    server, comms, ws, out = watchers(tmp_path, n=3, window=10)
    try:
        ws[0].tick()
        first, _ = ws[0]._want
        t = run_ops(comms[:2], 12, 2000.0)            # rank 2 never gets there
        ws[1].tick()
        ws[0].tick()
        assert ws[0]._want == (first, 10) and ws[0].windows == 0
        ws[0]._ready_at -= 60                          # 30 periods after rank 0 ended it
        ws[0].tick()
        assert ws[0]._want[0] > first and ws[0].windows == 0 and out.getvalue() == ""
        del t
    finally:
        for w in ws:
            w.store.close()
        server.close()


def test_report_reader_keeps_good_lines_and_names_bad_ones(tmp_path):
    (tmp_path / "diag").mkdir()
    good = {"at": 5.0, "line": "straggler: rank 1 (a) ...", "verdict": {"kind": "rank"}}
    (tmp_path / "diag" / "stragglers.jsonl").write_text(json.dumps(good) + "\n{oops\n" + json.dumps({"at": 1}) + "\n")
    entries, problems = read_stragglers(tmp_path)
    assert entries == [{"at": 5.0, "line": good["line"], "verdict": {"kind": "rank"}}]
    assert len(problems) == 2 and "stragglers.jsonl:2" in problems[0] and "stragglers.jsonl:3" in problems[1]
    assert read_stragglers(tmp_path / "nothing") == ([], [])


def test_a_group_watcher_names_global_ranks_and_its_group_in_a_file_of_its_own(tmp_path):
    """A group of global ranks 1, 3, 5, 7 (group ranks 0-3); its rank 2 (global 5) is late."""
    members, name = (1, 3, 5, 7), "group 4 of ranks 1,3,5,7"
    server, comms, ws, out = watchers(tmp_path, hosts=("node1", "node2", "node3", "node4"),   # by group rank
                                      name="pg/4/ring", members=members, group=name, tag="group4-ring")
    try:
        t = run_ops(comms, 3, 1000.0)
        ws[0].tick()
        t = run_ops(comms, 20, t, late={2: 0.008})
        round_(ws)
        text = out.getvalue()
        assert text.count("straggler:") == 1 and "rank 5 (node3)" in text and f"allreduces of {name}" in text, text
        assert ws[0].current.ranks == [5] and ws[0].current.group == name
        t = run_ops(comms, 60, t)
        round_(ws)
        round_(ws)
        assert out.getvalue().count("straggler:") == 2 and out.getvalue().rstrip().endswith(f"({name})")
        assert (tmp_path / "diag" / "stragglers-group4-ring.jsonl").exists()
        assert not (tmp_path / "diag" / "stragglers.jsonl").exists() and not (tmp_path / "live.json").exists()
        entries, problems = read_stragglers(tmp_path)
        assert problems == [] and entries[0]["verdict"]["ranks"] == [5] and entries[0]["verdict"]["group"] == name
    finally:
        for w in ws:
            w.store.close()
        server.close()


def test_the_report_merges_the_job_and_group_verdicts_oldest_first(tmp_path):
    (tmp_path / "diag").mkdir()
    world = [{"at": 1.0, "line": "a", "verdict": None}, {"at": 9.0, "line": "d", "verdict": None}]
    group = [{"at": 2.0, "line": "b", "verdict": {"kind": "rank", "group": "g"}}, {"at": 3.0, "line": "c", "verdict": None}]
    (tmp_path / "diag" / "stragglers.jsonl").write_text("".join(json.dumps(e) + "\n" for e in world))
    (tmp_path / "diag" / "stragglers-group2-ring.jsonl").write_text("".join(json.dumps(e) + "\n" for e in group)
                                                                    + "{bad\n")
    entries, problems = read_stragglers(tmp_path)
    assert [e["line"] for e in entries] == ["a", "b", "c", "d"]
    assert len(problems) == 1 and "stragglers-group2-ring.jsonl:3" in problems[0]


def test_a_link_whose_sends_wait_is_named_when_nobody_is_late():
    rng = np.random.default_rng(6)
    rows = rows_for(rng, 6, noise_ms=1.0)
    for r in rows:
        r.peer, r.send_share = (r.rank + 1) % 6, rng.uniform(0.0, 0.03)
    rows[3].send_share = 0.45                                          # node2 -> node3
    v = sg.judge(rows, HOSTS6, op_names="allreduces")
    assert v is not None and v.kind == "link" and v.ranks == [3, 4] and v.host == "node2 -> node3"
    assert v.line().startswith("straggler: the link node2 -> node3 (rank 3 to rank 4) is the slow part: "
                               "rank 3's sends on it waited 45% of the time")
    rows[3].send_share = 0.1                                           # under link_share
    assert sg.judge(rows, HOSTS6) is None
    for r in rows:                                                     # everyone waits alike: not one link
        r.send_share = 0.4 + rng.uniform(0, 0.05)
    assert sg.judge(rows, HOSTS6) is None
    rows = rows_for(rng, 6, late={1: 8.0})                            # a late rank wins over a link
    rows[3].peer, rows[3].send_share = 4, 0.9
    assert sg.judge(rows, HOSTS6).ranks == [1]


def test_link_fields_survive_the_wire():
    row = sg.Row(2, 10, np.array([0.5]), 1.0, peer=5, send_share=0.375)
    back = sg.Row.decode(row.encode())
    assert (back.peer, back.send_share) == (5, 0.375)


def test_a_window_rank_0_itself_takes_long_to_end_is_waited_for(tmp_path, monkeypatch):
    """Slow steps (a throttled link: 0.3 s each) make a window last longer than the give-up time:
    rank 0 waits for its own end of the window, however long, and then judges it."""
    import hpcring.diagnostics.straggler_watch as swm
    server, comms, ws, out = watchers(tmp_path, n=3, window=10)
    try:
        ws[0].tick()
        first, _ = ws[0]._want
        t = run_ops(comms, 5, 3000.0)
        real = swm.time.monotonic
        monkeypatch.setattr(swm.time, "monotonic", lambda: real() + 1000.0)   # long past 30 periods
        for w in ws:
            w.tick()
        assert ws[0]._want == (first, 10) and ws[0].windows == 0
        run_ops(comms, 6, t)
        round_(ws)
        assert ws[0].windows == 1 and ws[0]._want[0] > first
    finally:
        for w in ws:
            w.store.close()
        server.close()


def test_binomial_tail_matches_exact_counts():
    import math
    for m in (1, 8, 17, 50):
        t = sg.binomial_tail(m)
        for k in range(m + 1):
            exact = sum(math.comb(m, i) for i in range(k, m + 1)) / 2 ** m
            assert t[k] == pytest.approx(exact, rel=1e-9, abs=1e-15)
    assert sg.binomial_tail(2000)[1500] < 1e-100 and sg.binomial_tail(2000)[0] == pytest.approx(1.0)


def test_a_rank_late_only_for_the_first_collective_of_each_step_is_named():
    """Horovod-style steps: a negotiation and the reductions back to back after the compute. The
    slow rank is late for the first of every three only; the others find everyone there."""
    rng = np.random.default_rng(7)
    w = 60
    rows = rows_for(rng, 4, w=w, noise_ms=0.2)
    for k in range(0, w, 3):                           # the first collective of each step
        for r in rows:
            r.inside[k] += 0.010 if r.rank != 2 else 0.0   # the others wait 10 ms for rank 2
    v = sg.judge(rows, ("a", "a", "b", "b"), op_names="collectives")
    assert v is not None and v.ranks == [2] and v.figures["told"] == 20, v
    assert "arrived last in 100% of the 20 of the last 60 collectives someone was late for" in v.line()


def test_a_few_late_collectives_are_not_enough_to_name_anyone():
    rng = np.random.default_rng(8)
    rows = rows_for(rng, 2, w=50, noise_ms=0.05)
    for k in range(6):                                  # 6 < 8 collectives anyone was late for
        rows[1].inside[k] += 0.01
    assert sg.judge(rows, ("a", "b")) is None
