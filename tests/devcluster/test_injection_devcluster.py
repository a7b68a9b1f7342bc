"""A job folder named to inject commands runs hello.py on the dev cluster and injects nothing."""
from __future__ import annotations

import os
from pathlib import Path

from helpers.injection import submit_hello


def test_job_dir_with_spaces_and_quotes_runs_on_the_dev_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dc")
    if not str(tmp).startswith("/srv/hpcring/"):   # the nodes share /srv/hpcring only
        tmp = Path(os.path.realpath("/srv/hpcring")) / "pytest-injection" / tmp.name
        tmp.mkdir(parents=True, exist_ok=True)
    r, jd = submit_hello(tmp, "devcluster", 300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("HELLO") == 2, r.stdout + r.stderr
