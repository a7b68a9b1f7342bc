"""Where a test job's diagnostics land: ``<HPCRING_JOB_DIR>/<job id>/diag`` (one folder per job)."""
from __future__ import annotations

import json
from pathlib import Path


def diag_folder(job_dir: Path) -> Path:
    """The one job's diag folder under ``job_dir`` (the test ran exactly one job there)."""
    found = list(Path(job_dir).glob("*/diag"))
    assert len(found) == 1, found
    return found[0]


def hang_report(job_dir: Path) -> dict:
    return json.loads((diag_folder(job_dir) / "hang-report.json").read_text())


def sinfo_states() -> str | None:
    """The dev cluster's node states (`sinfo -h -o %T`), or None without a working Slurm."""
    import shutil
    import subprocess
    if shutil.which("sinfo") is None:
        return None
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None
    return r.stdout if r.returncode == 0 else None


def cluster_up() -> bool:
    """The dev cluster answers and has usable nodes (tests marked devcluster skip otherwise)."""
    states = sinfo_states() or ""
    return any(w in states for w in ("idle", "mix", "alloc"))
