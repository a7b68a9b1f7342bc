import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """Isolate hpcring's job registry and local job counter per test."""
    d = tmp_path / "state"
    monkeypatch.setenv("HPCRING_STATE_DIR", str(d))
    return d


@pytest.fixture
def local_env(tmp_path, monkeypatch):
    """The environment without the developer's HPCRING_* variables, on the local site, with job
    records, job folders and a working folder of the test's own: {"state", "jobs", "cwd"}."""
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    dirs = {k: tmp_path / k for k in ("state", "jobs", "cwd")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(dirs["state"]))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(dirs["jobs"]))
    monkeypatch.setenv("HPCRING_SITE", "local")
    return dirs


@pytest.fixture
def site_file(tmp_path):
    """Write a site YAML and return its path."""
    def write(text: str, name: str = "site.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p
    return write
