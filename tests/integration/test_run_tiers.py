"""scripts/run-tiers.sh, which scripts/test.sh runs the three tiers with: stand-in tiers of real
pytest runs. A tier past its deadline says which test it sits in (its stack, through py-spy) and
is stopped the way Ctrl-C stops pytest (SIGTERM, tests/conftest.py), so the run ends with a named
test instead of at CI's limit; a failing first tier stops the others at once; the exit status is
the first failing tier's."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIERS = {
    "fast": "def test_ok():\n    assert 1 + 1 == 2\n",
    "slow": "import time\n\ndef test_sits_in_a_wait():\n    time.sleep(300)\n",
    "bad": "def test_fails():\n    assert 1 + 1 == 3\n",
}


def _run(tmp_path: Path, *names: str, deadline: int = 600) -> tuple[subprocess.CompletedProcess, float]:
    tests = tmp_path / "tests"
    for name, body in TIERS.items():
        (tests / name).mkdir(parents=True, exist_ok=True)
        (tests / name / f"test_{name}.py").write_text(body)
    # the suite's own conftest (its SIGTERM handling) above the tiers, as the real ones have it
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "pytest.ini").write_text("[pytest]\n")     # the rootdir, as pyproject.toml is the suite's
    env = dict(os.environ, HPCRING_TESTS_DIR=str(tests), HPCRING_TIER_DEADLINE=str(deadline))
    env.pop("HPCRING_TEST_WORKERS", None)
    t0 = time.monotonic()
    r = subprocess.run(["bash", "scripts/run-tiers.sh", str(tmp_path / "tmp"), *names], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    return r, time.monotonic() - t0


def test_a_tier_past_its_deadline_names_its_test_and_is_stopped(tmp_path):
    r, took = _run(tmp_path, "fast", "slow", deadline=4)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out                      # slow's pytest: interrupted
    assert "[slow] run-tiers.sh: the slow tier ran past 4s; what it is doing:" in out, out
    assert "[slow]     test_sits_in_a_wait (test_slow.py:4)" in out, out     # py-spy: the test's frame
    assert "[slow] " in out and "KeyboardInterrupt" in out and "signal 15" in out, out
    assert "[fast] 1 passed" in out and "run-tiers.sh: fast tier" in out, out
    assert took < 60, took                             # not the test's 300 s
    assert (tmp_path / "tmp.fast.rc").read_text().strip() == "0"


def test_a_failing_first_tier_stops_the_others_and_its_status_is_the_runs(tmp_path):
    r, took = _run(tmp_path, "bad", "slow")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "run-tiers.sh: the bad tier failed: stopping the others" in out, out
    assert "[bad] FAILED" in out and "[bad] 1 failed" in out, out
    assert took < 60, took
    assert (tmp_path / "tmp.slow.rc").read_text().strip() != "0"


def test_tiers_that_pass_exit_0(tmp_path):
    r, _ = _run(tmp_path, "fast")
    assert r.returncode == 0 and "run-tiers.sh: the tiers side by side" in r.stdout, r.stdout + r.stderr
