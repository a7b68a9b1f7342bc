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
