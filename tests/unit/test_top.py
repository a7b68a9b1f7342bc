"""``hpcring top``: frames built from live views (a few ranks, one row each; many, one row per node;
more nodes than fit), drawn as plain text and with rich; every bad ``live.json`` (missing keys,
wrong types, truncated, random bytes) one clean LiveError; the command's errors (no such job, no
live view yet and why, a corrupt file, a finished job) one message each, exit != 0, no traceback."""
from __future__ import annotations

import copy
import io
import json
import statistics
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcring.diagnostics import liveview as lv

NOW = 1_700_000_000.0


def live_doc(n=4, hosts_per=2, late=None, named=None, written=NOW - 1.5, rate=40.0):
    """A live view as rank 0's watcher writes it: rank r on host node<r // hosts_per>."""
    late = late or {}
    ranks = [{"rank": r, "host": f"node{r // hosts_per}", "lateness_ms": late.get(r, -0.1 * (r % 3)),
              "inside_s": round(0.1 + 0.01 * r, 6), "compute_s": 1.0 + (0.5 if r in late else 0.0),
              "ops_per_s": rate - (10.0 if r in late else 0.0)} for r in range(n)]
    verdict = None
    if named is not None:
        verdict = {"kind": "rank", "ranks": [named], "host": f"node{named // hosts_per}", "share": 0.9,
                   "median_ms": 12.5, "compute_ratio": 1.5, "ops": 10, "op_names": "allreduces",
                   "line": f"straggler: rank {named} (node{named // hosts_per}) arrived last in 90% of the last "
                           "10 allreduces, median +12.5 ms behind the median rank"}
    return {"written": written, "first": 101, "ops": 10, "size": n, "last_op": "allreduce", "ranks": ranks,
            "verdict": verdict}


def frame_of(doc, **kw):
    kw.setdefault("job", "38")
    kw.setdefault("now", NOW)
    return lv.build_frame(lv.parse_live(json.dumps(doc)), **kw)


# ------------------------------------------------------------------------------------ frames
def test_a_few_ranks_one_row_each_with_the_straggler_marked():
    f = frame_of(live_doc(4, late={3: 12.5}, named=3), state="RUNNING", name="train")
    assert f.header == ("job 38 (train), RUNNING, 4 ranks, last op allreduce, window #101-#110 (10 ops) 1.5 s ago")
    assert f.verdict.startswith("straggler: rank 3 (node1) arrived last in 90%")
    assert not f.by_node and f.columns[:6] == ("rank", "host", "ops/s", "lateness ms", "compute s", "inside s")
    assert [r[0] for r in f.rows] == ["0", "1", "2", "3"] and f.marked == [False, False, False, True]
    assert f.rows[3] == ("3", "node1", "30.0", "12.50", "1.500", "0.130", lv.STRAGGLER)
    assert f.rows[0][6] == "" and f.more is None and not f.final


def test_ranks_are_shown_in_rank_order_and_missing_figures_as_a_dash():
    doc = live_doc(3)
    doc["ranks"].reverse()
    doc["ranks"][0]["ops_per_s"] = None
    doc["ranks"][1]["lateness_ms"] = float("nan")
    f = frame_of(doc)
    assert [r[0] for r in f.rows] == ["0", "1", "2"]
    assert f.rows[2][2] == "-" and f.rows[1][3] == "-"
    assert "state unknown" in f.header


def test_more_ranks_than_rows_become_one_row_per_node():
    doc = live_doc(64, hosts_per=8, late={21: 30.0, 22: 9.0}, named=21)
    f = frame_of(doc, max_rows=20)
    assert f.by_node and f.columns[0] == "host" and len(f.rows) == 8 and f.more is None
    by_host = {r[0]: r for r in f.rows}
    node2 = by_host["node2"]                               # ranks 16-23
    assert node2[1] == "8 (16-23)" and node2[2] == "30.0"                       # its slowest rate
    assert node2[5] == "30.00" and node2[6] == "21"                               # max lateness, and who
    lates = [-0.1 * (r % 3) for r in range(16, 24) if r not in (21, 22)] + [30.0, 9.0]
    assert node2[3] == f"{min(lates):.2f}" and float(node2[4]) == pytest.approx(statistics.median(lates), abs=0.006)
    assert f.marked == [h == "node2" for h in by_host] and node2[7] == lv.STRAGGLER
    assert [r[0] for r in f.rows] == [f"node{i}" for i in range(8)]              # in rank order
    assert frame_of(doc, max_rows=64).by_node is False                           # they fit: one row each


def test_more_nodes_than_rows_keep_the_latest_and_say_how_many_are_left_out():
    doc = live_doc(40, hosts_per=1, late={7: 50.0, 30: 20.0})
    f = frame_of(doc, max_rows=5)
    assert f.by_node and len(f.rows) == 4 and [r[0] for r in f.rows[:2]] == ["node7", "node30"]
    assert f.more.startswith("... 36 more nodes not shown (40 in all")


def test_a_link_verdict_marks_both_ends_as_the_slow_link():
    doc = live_doc(4)
    doc["verdict"] = {"kind": "link", "ranks": [1, 2], "host": "node0->node1", "share": 0.4, "median_ms": 0.0,
                      "compute_ratio": None, "ops": 10, "op_names": "allreduces",
                      "line": "straggler: the link node0->node1 (rank 1 to rank 2) is the slow part: ..."}
    f = frame_of(doc)
    assert f.verdict.startswith("straggler: the link") and f.marked == [False, True, True, False]
    assert [r[6] for r in f.rows] == ["", lv.SLOW_LINK, lv.SLOW_LINK, ""]


def test_a_finished_job_frame_is_marked_final():
    f = frame_of(live_doc(2), state="COMPLETED", final=True)
    assert f.final and f.header.startswith("FINAL (the job has ended): job 38, COMPLETED")
    assert "FINAL" in lv.frame_text(f).splitlines()[0]


@pytest.mark.parametrize("seconds,text", [(0.04, "0.0 s"), (3.26, "3.3 s"), (42, "42 s"), (600, "10 min"),
                                          (9000, "2.5 h"), (-3, "0.0 s")])
def test_the_window_age(seconds, text):
    assert lv.age_text(seconds) == text


def test_plain_text_has_no_colour_no_box_and_no_trailing_spaces():
    text = lv.frame_text(frame_of(live_doc(6, late={5: 12.5}, named=5), state="RUNNING"))
    lines = text.splitlines()
    assert "\x1b" not in text and "─" not in text and all(ln == ln.rstrip() for ln in lines)
    assert lines[0].startswith("job 38, RUNNING, 6 ranks") and lines[1].startswith("straggler: rank 5")
    rows = [ln.split() for ln in lines[3:]]
    assert [r[0] for r in rows] == [str(r) for r in range(6)] and rows[5][-2:] == ["<-", "straggler"]


def test_rich_draws_host_names_as_text_never_as_markup():
    from rich.console import Console
    doc = live_doc(2)
    doc["ranks"][0]["host"] = "[bold red]evil[/]"
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=True, color_system="standard").print(lv.render(frame_of(doc)))
    assert "[bold red]evil[/]" in buf.getvalue()


def test_a_frame_of_4096_ranks_is_quick():
    doc = live_doc(4096, hosts_per=8, late={1234: 20.0}, named=1234)
    raw = json.dumps(doc)
    t0 = time.perf_counter()
    f = lv.build_frame(lv.parse_live(raw), job="1", now=NOW, max_rows=40)
    lv.frame_text(f)
    assert time.perf_counter() - t0 < 2.0 and f.by_node and len(f.rows) == 39 and f.rows[0][6] == "1234"


# ------------------------------------------------------------------------------- bad live views
REQUIRED = ("written", "first", "ops", "size", "last_op", "ranks", "verdict")
WRONG = {"written": ["1", None, True, [], {}], "first": [-1, 1.5, "1", None, True], "ops": [0, "10", 2.5, None],
         "size": [0, -4, "4", 4.0, None, False], "last_op": [3, [], {}, "a\x1b[2Jb"], "ranks": [None, {}, "x", [], 7],
         "verdict": [1, "rank", [], {"kind": "rank"}, {"kind": "", "ranks": [1], "host": "h", "line": "l"},
                     {"kind": "rank", "ranks": [9], "host": "h", "line": "l"},
                     {"kind": "rank", "ranks": [True], "host": "h", "line": "l"},
                     {"kind": "rank", "ranks": [1], "host": 5, "line": "l"}]}
RANK_WRONG = {"rank": [None, "0", -1, 4, 1.0, True], "host": [None, 3, "", "a\nb"],
              "lateness_ms": ["1", True, [1]], "inside_s": ["x", {}], "compute_s": [False], "ops_per_s": ["fast"]}


def bad_docs():
    """(label, text) of generated bad live views."""
    good = live_doc(4, named=1)
    for key in REQUIRED:
        if key == "verdict":
            continue                                     # an absent verdict is no verdict
        d = copy.deepcopy(good)
        del d[key]
        yield f"no {key}", json.dumps(d)
    for key, values in WRONG.items():
        for v in values:
            d = copy.deepcopy(good)
            d[key] = v
            yield f"{key}={v!r}", json.dumps(d)
    for key, values in RANK_WRONG.items():
        for v in values:
            d = copy.deepcopy(good)
            d["ranks"][2][key] = v
            yield f"ranks[2].{key}={v!r}", json.dumps(d)
    for key in ("rank", "host"):
        d = copy.deepcopy(good)
        del d["ranks"][1][key]
        yield f"ranks[1] without {key}", json.dumps(d)
    d = copy.deepcopy(good)
    d["ranks"][3]["rank"] = 0
    yield "a rank twice", json.dumps(d)
    d = copy.deepcopy(good)
    d["size"] = 2
    yield "more ranks than the size", json.dumps(d)
    d = copy.deepcopy(good)
    d["ranks"][0] = [0, "node0"]
    yield "a rank that is no object", json.dumps(d)
    text = json.dumps(good)
    for cut in (0, 1, 10, len(text) // 3, len(text) // 2, len(text) - 1):
        yield f"truncated at {cut}", text[:cut]
    for label, raw in (("array", "[1, 2]"), ("string", '"live"'), ("number", "4"), ("null", "null"),
                       ("blank", "  \n"), ("deep", "[" * 100000), ("NaN written", text.replace(str(NOW - 1.5), "NaN"))):
        yield label, raw


BAD = list(bad_docs())


@pytest.mark.parametrize("label,raw", BAD, ids=[b[0] for b in BAD])
def test_a_bad_live_view_is_one_clean_error(label, raw):
    with pytest.raises(lv.LiveError) as exc:
        lv.parse_live(raw, "/jobs/38/live.json")
    msg = str(exc.value)
    assert msg.startswith("the live view /jobs/38/live.json is corrupt: ") and "hint:" in msg
    assert len(msg) < 1000 and "\x1b" not in msg and "\n  hint" in msg and msg.count("\n") == 1


def test_bytes_that_are_not_utf8_or_too_large():
    with pytest.raises(lv.LiveError, match="not UTF-8"):
        lv.parse_live(b'{"a": "\xff"}')
    with pytest.raises(lv.LiveError, match="larger than"):
        lv.parse_live(b" " * (lv.MAX_BYTES + 1))


def test_an_absent_verdict_and_extra_keys_are_accepted():
    d = live_doc(3)
    del d["verdict"]
    d["future_field"] = {"x": 1}
    d["ranks"][0]["gpu_util"] = 0.9
    assert lv.parse_live(json.dumps(d))["verdict"] is None


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300),
                 st.recursive(st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=6),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(
                                  st.sampled_from(REQUIRED + ("rank", "host", "kind", "line")), c, max_size=8),
                              max_leaves=30).map(lambda v: json.dumps(v).encode())))
def test_random_contents_parse_or_give_a_live_error(raw):
    try:
        live = lv.parse_live(raw)
    except lv.LiveError as exc:
        assert "corrupt" in str(exc)
        return
    lv.frame_text(lv.build_frame(live, job="1", now=NOW, max_rows=3))      # what parses, draws


def test_a_folder_in_place_of_the_file(tmp_path):
    (tmp_path / "live.json").mkdir()
    with pytest.raises(lv.LiveError, match="is a folder"):
        lv.read_live(tmp_path / "live.json")
    assert lv.read_live(tmp_path / "nothing.json") is None


# ---------------------------------------------------------------------------------- the command
@pytest.fixture
def env(tmp_path, monkeypatch):
    for k in ("HPCRING_JOB_DIR", "HPCRING_SITE", "LINES", "COLUMNS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


def job(tmp_path, state="RUNNING", ntasks=4, live=None, job_id="7", array=None) -> Path:
    """A local job's record and folder, its state file saying ``state``, and ``live`` (a dict, or
    text) as its live.json."""
    from hpcring.schedulers.base import new_record
    folder = tmp_path / "jobs" / job_id
    folder.mkdir(parents=True)
    (folder / f"{job_id}_local.json").write_text(json.dumps({"state": state}))
    new_record(job_id, "local", "local", str(folder), ntasks, "train", "train.py", array=array)
    if live is not None:
        (folder / "live.json").write_text(live if isinstance(live, str) else json.dumps(live))
    return folder


@pytest.fixture(scope="session")
def top(cli):
    """`hpcring top ARGV` in this process; it must end without a traceback."""
    return lambda *argv: cli("top", *argv, no_traceback=True)


def one_error(r, code, *words):
    errors = [ln for ln in r.output.splitlines() if ln.startswith(("error:", "Error:"))] + \
        (["box"] if "\u2500 Error \u2500" in r.output else [])
    assert r.exit_code == code and len(errors) == 1, r.output
    for w in words:
        assert w in r.output, (w, r.output)


def test_once_prints_one_plain_frame_of_a_running_job(top, env):
    job(env, live=live_doc(4, late={2: 12.5}, named=2, written=time.time() - 1))
    r = top("7", "--once")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("job 7 (train), RUNNING, 4 ranks, last op allreduce, window #101-#110 (10 ops)")
    assert lines[1].startswith("straggler: rank 2 (node1)")
    assert [ln.split()[0] for ln in lines[3:]] == ["0", "1", "2", "3"] and lines[5].endswith("<- straggler")


def test_once_in_a_short_terminal_shows_nodes(top, env, monkeypatch):
    monkeypatch.setenv("LINES", "14")                  # 9 rows: 8 nodes fit, 32 ranks do not
    job(env, ntasks=32, live=live_doc(32, hosts_per=4, written=time.time()))
    r = top("7", "--once")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[1].startswith("host") and r.stdout.count("4 (") == 8 and "-0.00" not in r.stdout


def test_a_job_that_does_not_exist(top, env):
    one_error(top("12345", "--once"), 1, "job 12345 was not submitted through hpcring", "hint:")
    one_error(top("12345"), 1, "job 12345 was not submitted through hpcring")


@pytest.mark.parametrize("value", ["a\nb", "\x1b[2J", "1" * 5000, "/nonexistent/folder", "*"])
def test_a_bad_job_argument(top, env, value):
    r = top("--once", "--", value)
    assert r.exit_code in (1, 2) and "error:" in r.output and "Traceback" not in r.output, r.output


def test_an_array_asks_for_one_task(top, env):
    job(env, array=[0, 1])
    one_error(top("7", "--once"), 2, "array", "hpcring top 7_0")


def test_no_live_view_yet_says_why(top, env):
    job(env)
    r = top("7", "--once")
    one_error(r, 1, "job 7 (RUNNING) has no live view yet", "live.json", "HPCRING_STRAGGLERS=0",
              "first window", "HPCRING_JOB_DIR")


def test_no_live_view_of_a_job_not_started(top, env):
    job(env, state="PENDING")
    one_error(top("7"), 1, "job 7 has not started yet (PENDING)", "hint:")


def test_no_live_view_of_a_single_rank_job(top, env):
    job(env, ntasks=1)
    one_error(top("7", "--once"), 1, "single rank", "2 or more")


def test_a_corrupt_live_view(top, env):
    folder = job(env, live='{"written": 1700000000.0, "first": 1, "ops": 10, "siz')
    one_error(top("7", "--once"), 1, f"the live view {folder / 'live.json'} is corrupt", "not JSON", "hint:")
    (folder / "live.json").write_text(json.dumps({**live_doc(2), "ranks": "all"}))
    one_error(top("7"), 1, "`ranks` is a string, not an array")


def test_a_finished_job_points_to_the_report(top, env):
    job(env, state="COMPLETED", live=live_doc(4, named=1))
    r = top("7")
    one_error(r, 1, "job 7 has finished (COMPLETED)", "hpcring report 7", "--once")
    assert r.stdout == ""


def test_once_on_a_finished_job_prints_the_last_frame_marked_final(top, env):
    job(env, state="FAILED", live=live_doc(4, named=1))
    r = top("7", "--once")
    one_error(r, 1, "job 7 has finished (FAILED)", "hpcring report 7")
    assert r.stdout.startswith("FINAL (the job has ended): job 7 (train), FAILED, 4 ranks")
    assert r.stdout.count("\n") == 7


def test_a_finished_job_without_a_live_view(top, env):
    job(env, state="COMPLETED")
    one_error(top("7", "--once"), 1, "has finished (COMPLETED) and left no live view", "hpcring report 7")


def test_a_job_folder_works_too(top, env):
    folder = env / "run" / "55"
    folder.mkdir(parents=True)
    (folder / "live.json").write_text(json.dumps(live_doc(2, written=time.time())))
    r = top(str(folder), "--once")
    assert r.exit_code == 0 and r.stdout.startswith(f"job {folder}, state unknown, 2 ranks"), r.output
    one_error(top(str(env / "run" / "56"), "--once"), 1, "does not exist")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e400", "x", "0.01", "99999"])
def test_a_bad_interval_is_refused(top, env, value):
    job(env, live=live_doc(2))
    r = top("7", "--interval", value)
    assert r.exit_code == 2 and "--interval" in r.output and "Traceback" not in r.output, r.output


def test_the_live_view_redraws_until_the_job_ends(top, env, monkeypatch):
    """Without --once: rich's Live draws the frame; the job's end (its state file) ends the view, exit 0."""
    from hpcring.cli import top_cmd
    folder = job(env, live=live_doc(3, written=time.time()))
    monkeypatch.setattr(top_cmd, "STATE_EVERY", 0.0)
    calls = {"n": 0}
    real_sleep = time.sleep

    def sleep(s):
        calls["n"] += 1
        if calls["n"] == 2:
            (folder / "live.json").write_text(json.dumps(live_doc(3, named=2, written=time.time())))
        if calls["n"] == 3:
            (folder / "7_local.json").write_text(json.dumps({"state": "COMPLETED"}))
        real_sleep(0.01)
    monkeypatch.setattr(top_cmd.time, "sleep", sleep)
    r = top("7", "--interval", "0.1")
    assert r.exit_code == 0, r.output
    assert "straggler: rank 2 (node1)" in r.output and "FINAL (the job has ended)" in r.output
    assert "job 7 has ended (COMPLETED); `hpcring report 7`" in r.output
