"""A job folder named to inject commands (quotes, $(...), backticks, ;) runs hello.py on the local
backend and injects nothing (the rendered words are checked in tests/unit/test_injection.py)."""
from __future__ import annotations

from helpers.injection import submit_hello


def test_job_dir_with_spaces_and_quotes_runs_on_the_local_backend(tmp_path):
    r, jd = submit_hello(tmp_path, "local", 120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("HELLO") == 2 and "COMPLETED" in r.stdout + r.stderr, r.stdout + r.stderr
    assert len(list(jd.glob("*/*_1_status.json"))) == 1
