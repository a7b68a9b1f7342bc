"""scripts/horovod_suite.py's own logic, without Horovod's test file: the JUnit merge, the scoring
(a known failure counts only with its message; a rank missing from a test run alone), and the
stand-in ``horovod`` package it writes."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "horovod_suite.py"


@pytest.fixture(scope="module")
def hs():
    spec = importlib.util.spec_from_file_location("horovod_suite", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def junit(folder: Path, rank: int, cases: list[tuple[str, str, str]]) -> None:
    """cases: (name, outcome in passed/failure/error/skipped, message)."""
    rows = []
    for name, outcome, msg in cases:
        inner = "" if outcome == "passed" else f'<{outcome} message="{msg}">{msg}</{outcome}>'
        rows.append(f'<testcase classname="test_torch.TorchTests" name="{name}">{inner}</testcase>')
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.xml").write_text(f'<testsuites><testsuite name="pytest">{"".join(rows)}</testsuite></testsuites>')


def test_a_failure_then_a_teardown_error_keeps_the_failure(hs, tmp_path):
    junit(tmp_path, 0, [("t", "failure", "AssertionError: hvd.x produces incorrect results"),
                        ("t", "error", "StallError: operation names do not match")])
    junit(tmp_path, 1, [("t", "passed", "")])
    table = hs.results(tmp_path, 2)
    assert table["t"][0] == ("failed", "AssertionError: hvd.x produces incorrect results")
    assert table["t"][1] == ("passed", "")


def test_a_known_failure_counts_only_with_its_message(hs):
    known = {"k": "Muon only supports 2D parameters"}
    table = {"k": {0: ("failed", "ValueError: Muon only supports 2D parameters ..."),
                   1: ("failed", "ValueError: Muon only supports 2D parameters ...")},
             "k2": {0: ("failed", "ValueError: Muon only supports 2D parameters ..."), 1: ("passed", "")}}
    counts, bad = hs.score(["k", "k2"], table, 2, {**known, "k2": "Muon"}, [])
    assert counts["known"] == 2 and not bad
    table["k"][1] = ("failed", "RuntimeError: something else")
    counts, bad = hs.score(["k"], table, 2, known, [])
    assert counts == {"passed": 0, "failed": 1, "skipped": 0, "known": 0}
    assert bad[0][0] == "k" and "something else" in bad[0][1]


def test_a_rank_missing_from_a_test_run_alone(hs):
    known = {"half": "produces incorrect results"}
    table = {"half": {0: ("failed", "AssertionError: hvd.reducescatter produces incorrect results"),
                      2: ("failed", "AssertionError: hvd.reducescatter produces incorrect results")}}
    counts, bad = hs.score(["half"], table, 3, known, ["half"])
    assert counts["known"] == 1 and not bad
    # not run alone, or failing otherwise: a rank that did not report is a failure to look at
    counts, bad = hs.score(["half"], table, 3, known, [])
    assert bad == [("half", "ran on ranks [0, 2] of 3")]
    table["half"][0] = ("failed", "StallError: ...")
    counts, bad = hs.score(["half"], table, 3, known, ["half"])
    assert bad and counts["known"] == 0


def test_passed_skipped_and_never_run(hs):
    table = {"p": {0: ("passed", ""), 1: ("skipped", "no GPU")}, "s": {0: ("skipped", "x"), 1: ("skipped", "x")},
             "f": {0: ("failed", "boom"), 1: ("passed", "")}}
    counts, bad = hs.score(["p", "s", "f", "gone"], table, 2, {}, [])
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "known": 0}
    assert [n for n, _ in bad] == ["f", "gone"]


def test_the_stand_in_package_is_hpcring_torch(hs, tmp_path):
    pytest.importorskip("torch")
    shim = hs.shim(tmp_path)
    code = ("import horovod.torch as hvd, hpcring.torch, horovod.runner.util.threads as t; "
            "assert hvd is hpcring.torch; th = t.in_thread(target=lambda: None); th.join(5); print('ok')")
    p = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(shim), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "ok", p.stderr
