"""Ranks inside the CI image on this machine (no dev cluster): `hpcring run` outside an allocation
and `hpcring submit` on the local backend, each rank through Charliecloud's ch-run with the
checkout's venv bound in (tests/helpers/container.py; the dev-cluster versions are in
test_container_devcluster.py)."""
from __future__ import annotations

import functools
import json
import os
import pwd
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from helpers.container import ci_image, mounts  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "container_worker.py"


@pytest.fixture
def site(tmp_path) -> Path:
    jobs = tmp_path / "jobs"
    image = ci_image(str(tmp_path))
    text = (ROOT / "site_configs" / "local.yaml").read_text().replace("name: local", "name: local-ch")
    text = text.replace("job_dir: ~/hpcring-jobs", f"job_dir: {json.dumps(str(jobs))}")
    text += ("container:\n  runtime: charliecloud\n"
             f"  image: {json.dumps(str(image))}\n  mounts: {json.dumps(mounts(str(tmp_path)))}\n")
    p = tmp_path / "local-ch.yaml"
    p.write_text(text)
    return p


@pytest.fixture
def ch_hpcring(hpcring, tmp_path):
    """The conftest runner with this test's job records, $USER set (ch-run refuses to start without
    it) and a 240 s bound (an image's ranks start slower)."""
    env = {"HPCRING_STATE_DIR": str(tmp_path / "state"), "USER": pwd.getpwuid(os.getuid()).pw_name}
    return functools.partial(hpcring, env=env, timeout=240)


def _ranks(stdout: str) -> list[dict]:
    return sorted((json.loads(line.split("CONTAINER_RANK ", 1)[1]) for line in stdout.splitlines()
                   if "<stdout>:CONTAINER_RANK " in line), key=lambda d: d["rank"])


def test_hpcring_run_outside_an_allocation(ch_hpcring, site, tmp_path):
    r = ch_hpcring("run", "--site", str(site), "-N", "2", "--tasks-per-node", "1", "--", sys.executable, str(WORKER))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    ranks = _ranks(r.stdout)
    assert [d["rank"] for d in ranks] == [0, 1], r.stdout
    assert all(d["in_image"] and d["exact"] and d["secret_ok"] and d["cwd"] == str(ROOT) for d in ranks), ranks
    # and --no-container runs the same ranks on the host (no image marker there)
    r = ch_hpcring("run", "--site", str(site), "-N", "2", "--tasks-per-node", "1", "--no-container", "--",
                   sys.executable, str(WORKER))
    assert r.returncode == 0 and not any(d["in_image"] for d in _ranks(r.stdout)), r.stdout + r.stderr


def test_submit_on_the_local_backend(ch_hpcring, site, tmp_path):
    r = ch_hpcring("submit", str(WORKER), "--site", str(site), "-N", "2", "--wait")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    ranks = _ranks(r.stdout)
    assert [d["rank"] for d in ranks] == [0, 1], r.stdout
    for d in ranks:
        assert d["in_image"] and d["exact"] and d["allgather"] == [0, 1] and d["secret_ok"], d
        assert d["secret_file"].startswith(str(tmp_path / "jobs")), d
