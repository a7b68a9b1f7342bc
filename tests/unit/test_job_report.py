"""``hpcring report``: the flight recorder's totals (every collective, overwritten ones included),
the ranks' time summaries (writer, reader, corrupt files), the split of a rank's time (it adds up;
waiting exact over the summaries' tail, estimated beyond it), the JSON schema, the HTML page, and
the command's errors on bad input (what, where, a hint, exit 1, no traceback)."""
from __future__ import annotations

import json
import random
import time
import types
from pathlib import Path

import jsonschema
import pytest

from hpcring import _native, jobreport
from hpcring.collectives.recorder import FlightRecorder, Totals
from hpcring.diagnostics import rank_summary
from hpcring.jobreport_html import render

from helpers.summaries import make_summaries, valid_summary

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())


# ---------------------------------------------------------------------------------------------
# totals: every collective ended since the start, in O(1)
# ---------------------------------------------------------------------------------------------
def test_the_c_ring_counts_every_record_it_ended_overwritten_ones_included():
    f = _native.Flight(4, ())
    truth = []
    for i in range(11):
        seq = f.record("allreduce", "float32", 8, None, 5.0)
        f.end(seq, "boom" if i == 7 else None)
        _, *_, t_started, t_ended, _, _ = f.get(seq)
        truth.append((t_started, t_ended, i == 7))
    f.end(seq)                                    # a second end rewrites the slot, never counts twice
    t = f.totals()
    done = [(a, e) for a, e, bad in truth if not bad]
    assert (t["done"], t["failed"]) == (10, 1)
    assert t["base"] == truth[0][0] == t["first_started"] and t["last_ended"] == max(e for _, e, _ in truth)
    assert t["sum_inside"] == pytest.approx(sum(e - a for a, e in done), abs=1e-9)
    assert t["sum_started"] == pytest.approx(sum(a - t["base"] for a, _ in done), abs=1e-9)
    assert t["sum_failed"] == pytest.approx(truth[7][1] - truth[7][0], abs=1e-9)


def test_the_recorder_totals_both_stores_and_what_its_deque_dropped():
    rec = FlightRecorder(0, 2, "ring", capacity=3)
    truth = []
    for i in range(8):                             # the general path: Records in a deque of 3
        r = rec.queue("allgather", "float32", 4, None, 5.0)
        FlightRecorder.start(r)
        time.sleep(0.001)
        FlightRecorder.finish(r, "x" if i == 2 else None)
        truth.append((r.t_started, r.t_ended, i == 2))
    for _ in range(5):                             # the short path: slots of the C ring of 3
        seq = rec.flight.record("allreduce", "float32", 4, None, 5.0)
        rec.flight.end(seq)
        t = rec.flight.get(seq)
        truth.append((t[8], t[9], False))
    rec.queue("barrier", None, 0, None, 5.0)       # still queued: not counted
    tot = rec.totals()
    done = [(a, e) for a, e, bad in truth if not bad]
    assert (tot.done, tot.failed) == (12, 1) and len(rec.records()) == 3
    assert tot.first_started == min(a for a, _, _ in truth) and tot.last_ended == max(e for _, e, _ in truth)
    assert tot.sum_inside == pytest.approx(sum(e - a for a, e in done), abs=1e-9)
    assert tot.sum_started + tot.done * tot.base == pytest.approx(sum(a for a, _ in done), rel=1e-15)


def test_merged_totals_keep_microseconds_of_epoch_times():
    a, b = Totals(), Totals()
    inside = 0.0
    for i in range(1000):
        for tot, start, d in ((a, 1.8e9 + i + 0.25, 1e-5), (b, 1.8e9 + 5000 + i + 0.5, 2e-5)):
            end = start + d
            tot.add(types.SimpleNamespace(t_started=start, t_ended=end, state="done"))
            inside += end - start
    m = b.merged(a)
    assert m.done == 2000 and m.base == 1.8e9 + 0.25
    assert m.sum_inside == pytest.approx(inside, rel=1e-12)
    # relative to the earlier base: 1000 starts at i and 1000 at 5000.25 + i, to the microsecond
    assert m.sum_started == pytest.approx(sum(range(1000)) * 2 + 5000.25 * 1000, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# summaries: writer and reader
# ---------------------------------------------------------------------------------------------
def _comm(rec):
    return types.SimpleNamespace(recorder=rec)


def test_a_summary_is_written_read_back_and_bounded(tmp_path):
    rec = FlightRecorder(1, 2, "ring", capacity=2048)
    for _ in range(rank_summary.TAIL + 40):
        rec.flight.end(rec.flight.record("allreduce", "float32", 4, None, 5.0))
    path = rank_summary.write(tmp_path / "diag", 1, 2, "node1", [_comm(rec)], "exit")
    assert path.name == "summary-rank1.json" and path.stat().st_size < 16384
    got, problems = rank_summary.read_dir(tmp_path / "diag")
    assert problems == [] and list(got) == [1]
    c = got[1]["comms"][0]
    assert c["name"] == "ring" and c["totals"]["done"] == rank_summary.TAIL + 40
    assert len(c["tail"]["seq"]) == rank_summary.TAIL and c["tail"]["seq"][-1] == rank_summary.TAIL + 40
    assert c["tail"]["bytes"] == [16] * rank_summary.TAIL        # 4 float32 each (older tails have none)


def test_a_summary_written_inside_a_collective_records_its_start(tmp_path):
    rec = FlightRecorder(0, 2, "ring", capacity=64)
    rec.flight.end(rec.flight.record("allreduce", "float32", 4, None, 5.0))
    stuck = rec.begin("allreduce", "float32", 4, None, 5.0)     # a dump's rank is stuck in one
    path = rank_summary.write(tmp_path / "diag", 0, 2, "node1", [_comm(rec)], "dump: hang")
    c = rank_summary.check(json.loads(path.read_text()))["comms"][0]
    assert c["totals"]["done"] == 1 and c["totals"]["failed"] == 0
    assert c["in_flight"] == [pytest.approx(stuck.t_started, abs=1e-5)]


@pytest.mark.parametrize("text,what", [
    ("{", "not JSON"), ("[]", "not an object"), ('{"version": 2}', "version 2"),
    ("\xff\xfe", "not text"),
])
def test_a_corrupt_summary_is_a_problem_naming_the_file(tmp_path, text, what):
    d = tmp_path / "diag"
    d.mkdir()
    (d / "summary-rank0.json").write_bytes(text.encode("latin-1"))
    got, problems = rank_summary.read_dir(d)
    assert got == {} and len(problems) == 1
    assert str(d / "summary-rank0.json") in problems[0] and what in problems[0], problems


@pytest.mark.parametrize("field,value,what", [
    ("rank", -1, "negative"), ("rank", True, "not a whole number"), ("written", float("nan"), "not a number"),
    ("host", None, "host is missing"), ("comms", {}, "comms is missing"),
])
def test_check_names_the_bad_field(field, value, what):
    with pytest.raises(rank_summary.Bad, match=what):
        rank_summary.check(valid_summary(**{field: value}))


@pytest.mark.parametrize("value,what", [
    ("1.0", "not a list"), ([1.0] * (rank_summary.TAIL + 1), "at most"), ([-1.0], "holds -1.0"),
    ([True], "holds true"), ([None], "holds null"),
])
def test_check_refuses_a_bad_in_flight(value, what):
    s = valid_summary()
    s["comms"][0]["in_flight"] = value
    with pytest.raises(rank_summary.Bad, match=rf"comms\[0\]\.in_flight .*{what}"):
        rank_summary.check(s)


def test_check_refuses_a_tail_of_unequal_lists_and_bad_totals():
    s = valid_summary()
    s["comms"][0]["tail"]["ended"].append(2.0)
    with pytest.raises(rank_summary.Bad, match="differ in length"):
        rank_summary.check(s)
    s = valid_summary()
    s["comms"][0]["totals"]["sum_inside"] = "0.5"
    with pytest.raises(rank_summary.Bad, match=r"comms\[0\]\.totals\.sum_inside"):
        rank_summary.check(s)


# ---------------------------------------------------------------------------------------------
# the split
# ---------------------------------------------------------------------------------------------
def _members(summaries):
    return {r: s["comms"][0] for r, s in summaries.items()}


def test_a_straggler_beyond_the_tail_is_estimated_exactly():
    n = rank_summary.TAIL * 3
    arrivals = {r: [k * 0.1 + (0.05 if r == 1 else 0.001 * r) for k in range(n)] for r in range(3)}
    _, summaries, truth = make_summaries(arrivals)
    wait, method, why = jobreport._waiting(_members(summaries))
    assert method == "estimated" and why is None
    for r in range(3):
        assert wait[r] == pytest.approx(truth[r], abs=1e-4)
    assert wait[1] == pytest.approx(0.0, abs=1e-6) and wait[0] == pytest.approx(n * 0.05, rel=1e-6)


def test_jitter_beyond_the_tail_is_estimated_from_the_tail():
    rng = random.Random(7)
    n = rank_summary.TAIL * 8
    arrivals = {r: [k * 0.1 + rng.uniform(0, 0.02) for k in range(n)] for r in range(4)}
    _, summaries, truth = make_summaries(arrivals)
    wait, method, _ = jobreport._waiting(_members(summaries))
    assert method == "estimated"
    for r in range(4):       # no rank is always last: the sums alone would say almost no waiting
        assert wait[r] == pytest.approx(truth[r], rel=0.1)


def test_within_the_tail_the_waiting_is_exact():
    rng = random.Random(3)
    arrivals = {r: [k * 0.1 + rng.uniform(0, 0.02) for k in range(50)] for r in range(3)}
    _, summaries, truth = make_summaries(arrivals)
    wait, method, _ = jobreport._waiting(_members(summaries))
    assert method == "exact" and all(wait[r] == pytest.approx(truth[r], abs=1e-6) for r in range(3))


def test_uneven_counts_are_matched_on_what_every_rank_completed_or_not_split():
    arrivals = {r: [k * 0.1 + (0.03 if r == 0 else 0.0) for k in range(10)] for r in range(2)}
    _, summaries, _ = make_summaries(arrivals)
    c1 = summaries[1]["comms"][0]                  # rank 1 completed one more (a failed run)
    c1["totals"]["done"] += 1
    for k, v in (("seq", 11), ("started", c1["tail"]["started"][-1] + 0.1), ("ended", c1["tail"]["ended"][-1] + 0.1)):
        c1["tail"][k].append(v)
    wait, method, why = jobreport._waiting(_members(summaries))
    assert method == "partial" and why is None and wait[1] == pytest.approx(10 * 0.03, abs=1e-6)
    c1["totals"]["done"] += 1000                   # more than the tails hold: no split
    wait, method, why = jobreport._waiting(_members(summaries))
    assert method is None and "rank 0: 10, rank 1: 1011" in why


def test_the_split_adds_up_to_each_rank_wall_time():
    arrivals = {r: [0.5 + k * 0.2 + (0.08 if r == 2 else 0.0) for k in range(30)] for r in range(3)}
    statuses, summaries, truth = make_summaries(arrivals)
    att = jobreport.split_attempt(statuses, summaries, 3)
    for e in att["ranks"]:
        parts = sum(e[f"{p}_s"] for p in jobreport.PARTS)
        assert parts == pytest.approx(e["wall_s"], rel=1e-9)
        assert e["wall_s"] == pytest.approx(statuses[e["rank"]]["ended"] - statuses[e["rank"]]["started"])
        assert e["waiting_s"] == pytest.approx(truth[e["rank"]], abs=1e-6)
        assert e["startup_s"] == pytest.approx(1.5 + (0.08 if e["rank"] == 2 else 0.0), abs=1e-6)
    slow, fast = att["ranks"][2], att["ranks"][0]
    assert slow["compute_s"] > fast["compute_s"] + 29 * 0.07 and fast["waiting_s"] > 29 * 0.079
    assert att["time_to_first_step_s"] == pytest.approx(1.58, abs=1e-6)


@pytest.mark.parametrize("ended", [True, False])
def test_a_rank_stuck_in_a_collective_at_its_dump_waits_in_it_to_its_end(ended):
    arrivals = {r: [0.5 + k * 0.2 for k in range(10)] for r in range(2)}   # together: no waiting
    statuses, summaries, _ = make_summaries(arrivals)
    t0 = 1.8e9
    stuck_at, dumped, end = t0 + 2.6, t0 + 5.6, t0 + 7.0       # its 11th never ended; killed at `end`
    summaries[0]["comms"][0]["in_flight"] = [stuck_at]
    summaries[0]["why"], summaries[0]["written"] = "dump: hang", dumped
    if not ended:                  # a live dump (SIGRTMIN+7): the rank may yet finish it
        statuses[0]["ended"] = None
    else:
        statuses[0]["ended"] = end
    att = jobreport.split_attempt(statuses, summaries, 2)
    e, other = att["ranks"]
    assert e["failed_collectives"] == (1 if ended else 0) and other["failed_collectives"] == 0
    assert e["waiting_s"] == pytest.approx((end if ended else dumped) - stuck_at, abs=1e-6)
    assert sum(e[f"{p}_s"] for p in jobreport.PARTS) == pytest.approx(e["wall_s"], rel=1e-9)
    assert e["collectives"] == 10 and other["waiting_s"] == pytest.approx(0.0, abs=1e-6)


def test_a_rank_without_summary_is_named_and_the_others_still_split():
    arrivals = {r: [k * 0.1 for k in range(5)] for r in range(2)}
    statuses, summaries, _ = make_summaries(arrivals)
    del summaries[1]
    att = jobreport.split_attempt(statuses, summaries, 3, finished=True)
    assert att["ranks"][0]["compute_s"] is not None
    assert att["ranks"][1]["compute_s"] is None and "no time summary" in att["ranks"][1]["notes"][0]
    assert att["ranks"][2]["wall_s"] is None and att["time_to_first_step_s"] is None


# ---------------------------------------------------------------------------------------------
# a job folder on disk, the schema, the HTML
# ---------------------------------------------------------------------------------------------
def write_job(folder: Path, job_id="7", ranks=3, slow=2, steps=20):
    arrivals = {r: [0.5 + k * 0.2 + (0.08 if r == slow else 0.0) for k in range(steps)] for r in range(ranks)}
    statuses, summaries, _ = make_summaries(arrivals)
    (folder / "diag").mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        (folder / f"{job_id}_{r}_status.json").write_text(json.dumps({**statuses[r], "size": ranks}))
        (folder / "diag" / f"summary-rank{r}.json").write_text(json.dumps(summaries[r]))
    return folder


def test_a_folder_report_follows_the_schema_and_its_text_names_every_rank(tmp_path):
    folder = write_job(tmp_path / "7")
    doc = jobreport.build(folder=folder, now=2e9)
    jsonschema.validate(doc, SCHEMA)
    assert doc["job"]["id"] == "7" and doc["job"]["ranks"] == 3 and len(doc["ranks"]) == 3
    assert doc["effective_ratio"] == pytest.approx(doc["productive_rank_s"] / doc["allocated_rank_s"], abs=1e-5)
    text = jobreport.text(doc)
    for r in range(3):
        assert f"\n     {r}  n{r} " in text
    assert "startup" in text and "waiting" in text and "(exact)" in text


def test_the_html_page_is_self_contained_and_shows_every_rank(tmp_path):
    folder = write_job(tmp_path / "7", ranks=4)
    doc = jobreport.build(folder=folder, now=2e9)
    doc["ranks"][1]["host"] = doc["attempts"][-1]["ranks"][1]["host"] = "<b>&odd</b>"
    page = render(doc)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for forbidden in ("http:", "https:", "<script", "src=", "url(", "@import", "<link"):
        assert forbidden not in page, forbidden
    assert "<b>&odd</b>" not in page and "&lt;b&gt;&amp;odd&lt;/b&gt;" in page
    for r in range(4):
        assert f'data-rank="{r}"' in page and f"<td class=\"l\">rank {r}</td>" in page


# ---------------------------------------------------------------------------------------------
# the command: bad input is one message (what, where, hint), exit 1 or 2, no traceback
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def env(tmp_path, monkeypatch):
    for k in ("HPCRING_JOB_DIR", "HPCRING_SITE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


@pytest.fixture(scope="session")
def report(cli):
    """`hpcring report ARGV` in this process; it must end without a traceback."""
    return lambda *argv: cli("report", *argv, no_traceback=True)


def save_record(tmp_path, folder, job_id="7", ntasks=3, array=None):
    from hpcring.schedulers.base import new_record
    return new_record(job_id, "local", "local", str(folder), ntasks, "train", "train.py", array=array)


def one_error(r, code, *words):
    errors = [ln for ln in r.output.splitlines() if ln.startswith(("error:", "Error:"))] + \
        (["box"] if "\u2500 Error \u2500" in r.output else [])
    assert r.exit_code == code and len(errors) == 1, r.output
    for w in words:
        assert w in r.output, (w, r.output)


def test_a_job_that_does_not_exist(report, env):
    one_error(report("12345"), 1, "job 12345 was not submitted through hpcring", "hint:")


def test_a_folder_that_does_not_exist(report, env):
    one_error(report(str(env / "nope" / "7")), 1, "does not exist", "hint:")


def test_a_folder_with_nothing_to_report(report, env):
    (env / "empty").mkdir()
    one_error(report(str(env / "empty")), 1, "nothing to report", "hint:")


def test_a_job_whose_folder_was_deleted(report, env):
    save_record(env, env / "jobs" / "7")
    one_error(report("7"), 1, f"{env / 'jobs' / '7'} does not exist", "hint:")


@pytest.mark.parametrize("which", ["summary", "status", "chain"])
def test_a_corrupt_record_is_named(report, env, which):
    folder = write_job(env / "jobs" / "7")
    save_record(env, folder)
    path = {"summary": folder / "diag" / "summary-rank1.json", "status": folder / "7_2_status.json",
            "chain": folder / "restarts.json"}[which]
    path.write_text('{"version": 1, "rank": ')
    one_error(report("7"), 1, str(path), "hint:")


def test_a_missing_summary_is_a_note_not_an_error(report, env):
    folder = write_job(env / "jobs" / "7")
    save_record(env, folder)
    (folder / "diag" / "summary-rank1.json").unlink()
    r = report("7", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["ranks"][1]["compute_s"] is None and doc["ranks"][0]["compute_s"] is not None
    assert any("no time summary of rank 1" in p for p in doc["problems"])


def test_an_array_job_asks_for_one_task(report, env):
    save_record(env, env / "jobs" / "7", array=[0, 1])
    one_error(report("7"), 2, "array", "hpcring report 7_0")


def test_html_into_a_folder_that_does_not_exist_is_refused_before_reading(report, env):
    one_error(report("12345", "--html", str(env / "no" / "r.html")), 2, "--html", "does not exist")


def test_json_and_html_of_a_job(report, env):
    folder = write_job(env / "jobs" / "7")
    save_record(env, folder)
    out = env / "r.html"
    r = report("7", "--json", "--html", str(out))
    assert r.exit_code == 0, r.output
    jsonschema.validate(json.loads(r.stdout), SCHEMA)
    assert out.read_text().count('class="rank"') == 3


# ---------------------------------------------------------------------------------------------
# who writes a summary at exit
# ---------------------------------------------------------------------------------------------
def test_only_a_submitted_job_rank_writes_its_summary_at_exit(tmp_path, monkeypatch):
    from hpcring.diagnostics.watchdog import Watchdog
    written = []
    fake = types.SimpleNamespace(_raised=None, write_summary=lambda folder, why: written.append((folder, why)))
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRING_JOB_ID", "run9")
    (tmp_path / "run9" / "diag").mkdir(parents=True)       # hpcring run's folder (a stacks hook made it)
    Watchdog._exit_summary(fake)
    assert written == []                                  # it must stay removable when empty
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path / "%j"))
    fake._raised = {"error": "ValueError: x"}
    Watchdog._exit_summary(fake)
    assert written == [(tmp_path / "run9" / "diag", "exit: raised ValueError: x")]


def test_checkpoint_saved_is_noted_for_the_summary(monkeypatch):
    import hpcring
    import hpcring.preempt as preempt
    monkeypatch.setattr(preempt, "_checkpoints", {})
    assert rank_summary.checkpoints() is None
    hpcring.checkpoint_saved(10, seconds=1.5)
    hpcring.checkpoint_saved(20, seconds=0.5)
    got = rank_summary.checkpoints()
    assert got["count"] == 2 and got["last_step"] == 20 and got["seconds"] == 2.0 and got["last_at"] > 0


def test_a_summary_of_an_earlier_run_is_left_out():
    arrivals = {r: [k * 0.1 for k in range(5)] for r in range(2)}
    statuses, summaries, _ = make_summaries(arrivals)
    summaries[1]["written"] = statuses[1]["started"] - 60      # requeued: rank 1 died before writing again
    att = jobreport.split_attempt(statuses, summaries, 2, finished=True)
    assert att["ranks"][1]["compute_s"] is None and "earlier run" in att["ranks"][1]["notes"][0]
    assert att["ranks"][0]["compute_s"] is not None
