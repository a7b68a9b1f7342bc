"""``hpcring report --plots DIR`` (hpcring.jobreport_plots) with the real matplotlib: each picture
written as PNG and SVG from synthetic job folders, the ranks named in the SVG, what is missing said
in the title, bad --plots folders refused before anything is read or written, matplotlib missing
as one clear usage error; and the time summary tail's message sizes (``bytes``), old tails without
them still read."""
from __future__ import annotations

import builtins
import html
import json
import os
import re
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hpcring import jobreport, jobreport_plots as plots
from hpcring.collectives.recorder import FlightRecorder
from hpcring.diagnostics import rank_summary
from hpcring.errors import UsageError

pytest.importorskip("matplotlib")          # the test extra installs it (pyproject.toml)

from helpers.summaries import make_summaries, valid_summary

PNG = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"


def write_job(folder: Path, job_id="7", ranks=3, slow=1, steps=20, sizes=True, windows=True, verdict=True) -> Path:
    """A finished job's folder: status records, summaries (their tails with message sizes unless
    ``sizes`` is False: an older hpcring's), windows.jsonl and a straggler verdict on ``slow``."""
    arrivals = {r: [0.5 + k * 0.2 + (0.08 if r == slow else 0.0) for k in range(steps)] for r in range(ranks)}
    statuses, summaries, _ = make_summaries(arrivals)
    diag = folder / "diag"
    diag.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        if sizes:
            tail = summaries[r]["comms"][0]["tail"]
            tail["bytes"] = [4 << (k % 12) for k in range(len(tail["seq"]))]
        (folder / f"{job_id}_{r}_status.json").write_text(json.dumps({**statuses[r], "size": ranks}))
        (diag / f"summary-rank{r}.json").write_text(json.dumps(summaries[r]))
    t0 = statuses[0]["started"]
    if windows:
        with open(diag / "windows.jsonl", "w") as f:
            for k in range(5):
                f.write(json.dumps({"at": t0 + 1 + k, "first": 10 * k, "ops": 10, "ops_per_s": 4.5 + 0.1 * k,
                                    "max_lateness_ms": 80.0}) + "\n")
    if verdict:
        v = {"kind": "rank", "ranks": [slow], "host": f"n{slow}", "share": 1.0, "median_ms": 80.0,
             "compute_ratio": 2.0, "ops": 10, "op_names": "allreduce", "line": "straggler: ..."}
        (diag / "stragglers.jsonl").write_text(json.dumps({"at": t0 + 2.5, "first": 10, "ops": 10,
                                                           "line": "straggler: rank 1", "verdict": v}) + "\n")
    return folder


def svg_text(path: Path) -> str:
    root = ET.parse(path).getroot()            # parses as XML, or raises
    assert root.tag == SVG_NS + "svg"
    return " ".join(t for el in root.iter() for t in (el.text,) if t)


def check_pair(out: Path, name: str) -> str:
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 2000
    return svg_text(svg)


# ---------------------------------------------------------------------------------------------
# the pictures
# ---------------------------------------------------------------------------------------------
def test_the_three_pictures_are_written_and_name_every_rank(tmp_path):
    doc = jobreport.build(folder=write_job(tmp_path / "7"), now=2e9)
    drawn = plots.write_all(doc, tmp_path / "plots")
    assert [d.name for d in drawn] == list(plots.NAMES) and all(d.missing == [] for d in drawn), drawn
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        f"{n}.{f}" for n in plots.NAMES for f in plots.FORMATS)
    text = check_pair(tmp_path / "plots", "split")
    for r in range(3):
        assert f"rank {r} (n{r})" in text
    assert "straggler" in text and all(p in text for p in jobreport.PARTS)
    assert "collective rate over the run" in check_pair(tmp_path / "plots", "rate")
    bw = check_pair(tmp_path / "plots", "bandwidth")
    assert "rank 0 (n0)" in bw and "median" in bw


def test_the_split_uses_the_html_page_colors(tmp_path):
    doc = jobreport.build(folder=write_job(tmp_path / "7"), now=2e9)
    plots.split(doc, tmp_path / "p")
    svg = (tmp_path / "p" / "split.svg").read_text().lower()
    for color in plots.COLORS.values():
        assert color.lower() in svg


def test_no_windows_is_said_in_the_title_not_a_failure(tmp_path):
    doc = jobreport.build(folder=write_job(tmp_path / "7", windows=False, verdict=False), now=2e9)
    d = plots.rate(doc, tmp_path / "p")
    assert d.files == [tmp_path / "p" / "rate.png", tmp_path / "p" / "rate.svg"]
    assert "no diag/windows.jsonl" in d.missing[0]
    assert "no diag/windows.jsonl" in check_pair(tmp_path / "p", "rate")


def test_a_bad_windows_line_is_left_out_and_named(tmp_path):
    folder = write_job(tmp_path / "7")
    with open(folder / "diag" / "windows.jsonl", "a") as f:
        f.write('{"at": "soon"}\n{"at": 1.8e9\n')
    lines, problems = plots.read_windows(folder)
    assert len(lines) == 5 and len(problems) == 2 and ":6: not a window line" in problems[0]
    d = plots.rate(jobreport.build(folder=folder, now=2e9), tmp_path / "p")
    assert len(d.files) == 2 and d.missing == problems


def test_windows_of_every_attempt_are_read(tmp_path):
    a0, a1 = write_job(tmp_path / "7"), write_job(tmp_path / "8", verdict=False)
    doc = jobreport.build(folder=a1, now=2e9)
    d = plots.rate(doc, tmp_path / "p", folders=[a0, a1, tmp_path / "gone"])
    assert d.missing == ["1 of 3 attempts have no diag/windows.jsonl"]


def test_summaries_without_sizes_still_draw_the_others(tmp_path):
    doc = jobreport.build(folder=write_job(tmp_path / "7", sizes=False), now=2e9)
    drawn = {d.name: d for d in plots.write_all(doc, tmp_path / "p")}
    assert drawn["split"].missing == [] and drawn["rate"].missing == []
    assert "no message sizes" in drawn["bandwidth"].missing[0]
    assert "older hpcring" in check_pair(tmp_path / "p", "bandwidth")


def test_a_job_without_summaries_gets_every_picture_saying_what_is_missing(tmp_path):
    folder = write_job(tmp_path / "7", windows=False, verdict=False)
    for f in (folder / "diag").glob("summary-rank*.json"):
        f.unlink()
    doc = jobreport.build(folder=folder, now=2e9)
    drawn = {d.name: d for d in plots.write_all(doc, tmp_path / "p")}
    assert "no rank has a time split" in drawn["split"].missing[0]
    assert "no diag/windows.jsonl" in drawn["rate"].missing[0]
    assert "no time summaries" in drawn["bandwidth"].missing[0]
    text = check_pair(tmp_path / "p", "split")
    assert all(f"rank {r} (n{r})" in text for r in range(3)) and "no time split" in text
    check_pair(tmp_path / "p", "bandwidth")


def test_many_ranks_label_a_subset_and_every_straggler(tmp_path):
    doc = jobreport.build(folder=write_job(tmp_path / "7", ranks=300, slow=257, steps=3), now=2e9)
    plots.split(doc, tmp_path / "p")
    text = check_pair(tmp_path / "p", "split")
    assert "rank 0 (n0)" in text and "rank 257 (n257)" in text and "rank 1 (n1)" not in text


def test_after_the_last_arrival_is_the_communication_alone(tmp_path):
    folder = write_job(tmp_path / "7")                 # every collective ends 1 ms after the last arrival
    got, _ = rank_summary.read_dir(folder / "diag")
    pts = plots.after_last_arrival(got)
    assert len(pts) == 20 and all(t == pytest.approx(0.001, abs=2e-6) for _, t in pts)
    del got[2]["comms"][0]["tail"]["bytes"]            # a rank of an older hpcring: no sizes to join
    assert plots.after_last_arrival(got) == []


def test_marked_names_straggler_and_link_ranks():
    doc = {"stragglers": [{"at": 1, "verdict": {"kind": "link", "ranks": [2, 3]}},
                          {"at": 2, "verdict": {"kind": "node", "ranks": [3, 4]}},
                          {"at": 3, "verdict": None}]}
    assert plots.marked(doc) == {2: "slow link", 3: "straggler", 4: "straggler"}


# ---------------------------------------------------------------------------------------------
# the command
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


def test_the_command_writes_six_files_and_says_so(report, env):
    folder = write_job(env / "jobs" / "7")
    out = env / "new" / "plots"
    r = report(str(folder), "--json", "--plots", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["job"]["id"] == "7"          # stdout stays the JSON
    assert len(list(out.iterdir())) == 6 and "split.svg" in r.stderr and "missing:" not in r.stderr
    r = report(str(write_job(env / "jobs" / "8", windows=False)), "--plots", str(out))
    assert r.exit_code == 0 and "rate.svg; missing: no diag/windows.jsonl" in r.stderr, r.output


@pytest.mark.parametrize("case", ["file", "under_a_file", "unwritable", "unwritable_parent"])
def test_a_bad_plots_folder_is_refused_before_anything_is_written(report, env, case, monkeypatch):
    folder = write_job(env / "jobs" / "7")
    (env / "f").write_text("x")
    locked = env / "locked"
    locked.mkdir()
    real = os.access           # root may write anywhere: the permission check is what is tested
    monkeypatch.setattr(plots.os, "access", lambda p, mode: Path(p) != locked and real(p, mode))
    target = {"file": env / "f", "under_a_file": env / "f" / "plots", "unwritable": locked,
              "unwritable_parent": locked / "a" / "plots"}[case]
    before = sorted(p.name for p in env.rglob("*"))
    r = report(str(folder), "--plots", str(target))
    assert r.exit_code == 2 and r.stdout == "" and "--plots" in r.output and "hint:" in r.output, r.output
    assert {"file": "is a file, not a folder", "under_a_file": "is a file", "unwritable": "is not writable",
            "unwritable_parent": "cannot be made"}[case] in " ".join(r.output.split())
    assert sorted(p.name for p in env.rglob("*")) == before


def test_a_bad_plots_folder_is_refused_before_the_job_is_read(report, env):
    (env / "f").write_text("x")
    r = report("12345", "--plots", str(env / "f"))
    assert r.exit_code == 2 and "--plots" in r.output and "not submitted" not in r.output


def _no_matplotlib(monkeypatch):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", fake)


def test_without_matplotlib_the_usage_error_names_the_extra(report, env, monkeypatch):
    folder = write_job(env / "jobs" / "7")
    _no_matplotlib(monkeypatch)
    with pytest.raises(UsageError, match="--plots needs matplotlib") as exc:
        plots.require_matplotlib()
    assert "pip install 'hpcring[plots]'" in exc.value.hint
    r = report(str(folder), "--plots", str(env / "p"))
    assert r.exit_code == 2 and "pip install 'hpcring[plots]'" in r.output and r.stdout == ""
    assert not (env / "p").exists()


# ---------------------------------------------------------------------------------------------
# the pictures inside --html
# ---------------------------------------------------------------------------------------------
def test_html_holds_the_rate_and_bandwidth_pictures_inline_with_ids_of_their_own(report, env):
    folder = write_job(env / "jobs" / "7")
    page_path = env / "r.html"
    r = report(str(folder), "--html", str(page_path))
    assert r.exit_code == 0, r.output
    page = page_path.read_text()
    assert page.count("<svg") == 3 and page.count('<figure class="plot">') == 2      # the split, rate, bandwidth
    assert all(html.escape(plots.TITLES[k]) in page for k in ("rate", "bandwidth"))
    for outside in ("http:", "https:", "<?xml", "<!DOCTYPE svg", "<metadata", "xmlns"):
        assert outside not in page, outside
    assert all(ref.startswith("#") for ref in re.findall(r"url\(([^)]*)\)", page))
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert ids and len(ids) == len(set(ids))                     # no two pictures share an id
    refs = set(re.findall(r'url\(#([^)]+)\)', page)) | set(re.findall(r'href="#([^"]+)"', page))
    assert refs and refs <= set(ids)                             # every reference still finds its target
    assert not (env / "plots").exists() and not list(env.glob("hpcring-report-*"))


def test_for_html_prefixes_every_id_and_reference_and_drops_the_prolog():
    svg = ('<?xml version="1.0"?>\n<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" "http://x">\n'
           '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" width="1">'
           '<metadata><rdf>http://purl.org</rdf></metadata><defs><clipPath id="p1"><rect/></clipPath>'
           '<path id="m1"/><path id="m10"/></defs><g clip-path="url(#p1)"><use xlink:href="#m1"/>'
           '<use xlink:href="#m10"/></g></svg>')
    out = plots.for_html(svg, "fig-a")
    assert out.startswith("<svg width=") and "http" not in out and "metadata" not in out
    assert 'id="fig-a-p1"' in out and "url(#fig-a-p1)" in out
    assert 'href="#fig-a-m1"' in out and 'href="#fig-a-m10"' in out and 'id="fig-a-m10"' in out
    assert "fig-a-fig-a" not in out


def test_html_without_matplotlib_is_written_and_says_how_to_get_the_pictures(report, env, monkeypatch):
    folder = write_job(env / "jobs" / "7")
    _no_matplotlib(monkeypatch)
    r = report(str(folder), "--html", str(env / "r.html"))
    assert r.exit_code == 0, r.output
    page = (env / "r.html").read_text()
    assert page.count("<svg") == 1 and "pip install &#x27;hpcring[plots]&#x27;" in page


def test_the_plots_extra_is_declared_and_in_the_test_extra():
    import tomllib
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras[plots.EXTRA])
    assert any(d.startswith("matplotlib") for d in extras["test"])


# ---------------------------------------------------------------------------------------------
# the summary tail's message sizes
# ---------------------------------------------------------------------------------------------
def test_the_summary_tail_holds_each_collective_bytes(tmp_path):
    rec = FlightRecorder(0, 2, "ring", capacity=64)
    for dtype, count in (("float32", 1000), ("float16", 8), ("int64", 3), ("uint8", 5)):
        rec.flight.end(rec.flight.record("allreduce", dtype, count, None, 5.0))
    r = rec.queue("barrier", None, 0, None, 5.0)
    FlightRecorder.start(r)
    FlightRecorder.finish(r, None)
    rank_summary.write(tmp_path / "diag", 0, 2, "n0", [types.SimpleNamespace(recorder=rec)], "exit")
    got, problems = rank_summary.read_dir(tmp_path / "diag")
    assert problems == []
    tail = got[0]["comms"][0]["tail"]
    assert tail["bytes"] == [4000, 16, 24, 5, 0] and len(tail["bytes"]) == len(tail["seq"])


def test_message_bytes_of_an_unknown_dtype_is_none():
    assert rank_summary.message_bytes(types.SimpleNamespace(dtype="complex64", count=4)) is None
    assert rank_summary.message_bytes(types.SimpleNamespace(dtype=None, count=0)) == 0
    assert rank_summary.message_bytes(types.SimpleNamespace(dtype="bfloat16", count=7)) == 14


def test_a_tail_without_bytes_is_still_read_and_split(tmp_path):
    folder = write_job(tmp_path / "7", sizes=False)
    got, problems = rank_summary.read_dir(folder / "diag")
    assert problems == [] and all("bytes" not in s["comms"][0]["tail"] for s in got.values())
    doc = jobreport.build(folder=folder, now=2e9)
    assert all(e["compute_s"] is not None for e in doc["ranks"])
    pts, sized = plots.tail_points(got)
    assert pts == {} and sized is False


@pytest.mark.parametrize("sizes,what", [([1], "as long as"), ([1, -2], "holds -2"), ([1, 2.5], "holds 2.5"),
                                        ("12", "as long as"), ([True, 1], "holds true")])
def test_a_bad_bytes_list_is_named(sizes, what):
    s = valid_summary()
    s["comms"][0]["tail"]["bytes"] = sizes
    with pytest.raises(rank_summary.Bad, match=what):
        rank_summary.check(s)


def test_null_bytes_are_accepted_and_left_out_of_the_bandwidth():
    s = rank_summary.check({**valid_summary(), "comms": valid_summary()["comms"]})
    s["comms"][0]["tail"]["bytes"] = [None, 64]
    rank_summary.check(s)
    pts, sized = plots.tail_points({0: s})
    assert sized and pts == {0: [(64, pytest.approx(0.3))]}
