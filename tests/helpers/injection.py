"""A job folder whose name would run commands if any part of hpcring let it reach a shell unquoted."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WEIRD_DIR = "jd space 'single' \"double\" $(touch {marker}) `touch {marker}` ;x"


def submit_hello(tmp_path: Path, site: str, timeout: int) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / "INJECTED"
    jd = tmp_path / WEIRD_DIR.format(marker=marker)
    env = dict(os.environ, HPCRING_JOB_DIR=str(jd), HPCRING_STATE_DIR=str(tmp_path / "state"),
               PYTHONPATH=str(ROOT / "src"))
    env.pop("HPCRING_SITE", None)
    r = subprocess.run([sys.executable, "-m", "hpcring", "submit", str(ROOT / "examples" / "hello.py"),
                        "--site", site, "--nodes", "2", "--wait"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert not marker.exists(), r.stdout + r.stderr
    return r, jd
