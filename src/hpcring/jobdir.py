"""A job's id and folder, and where its diagnostics go: ``<job folder>/diag/`` (flight records, stacks,
hang reports). A leaf (standard library only): schedulers, ranks and commands all name jobs this way.

The job folder is, in order: the submitit folder of a submitted job (``SUBMITIT_FOLDER`` with
``%j`` resolved, ``<job_dir>/<job id>``); else ``<HPCRING_JOB_DIR>/<job id>`` (HPCRING_JOB_DIR is
the root of job folders, as ``job_dir`` in a site config); else ``./hpcring-diag/<job id>`` for
ranks started by ``hpcring run`` or by hand. Always one folder per job: two jobs never share a
``diag/`` (a later job's report would be read as an earlier one's). Ranks of one job agree on it
because they share the environment.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

JOB_ID_VARS = ("SLURM_JOB_ID", "LSB_JOBID", "SUBMITIT_LOCAL_JOB_ID", "HPCRING_JOB_ID")


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The scheduler's job id (Slurm, LSF, the local backend), else "0"; an array task's is
    ``<array id>_<task>`` (hpcring's 0-based task, also on LSF), as its folder and records are named."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("LSB_JOBID") and env.get("LSB_JOBINDEX", "0") not in ("", "0"):
        return f"{env['LSB_JOBID']}_{array_task(env)}"
    for var in JOB_ID_VARS:
        if env.get(var):
            return env[var]
    return "0"


def array_task(environ: Mapping[str, str] | None = None) -> str | None:
    """This array task's index (hpcring's, 0-based: LSF's LSB_JOBINDEX less one), or None."""
    env = os.environ if environ is None else environ
    if env.get("HPCRING_ARRAY_TASK"):
        return env["HPCRING_ARRAY_TASK"]
    if env.get("SLURM_ARRAY_TASK_ID"):
        return env["SLURM_ARRAY_TASK_ID"]
    index = env.get("LSB_JOBINDEX", "0")
    return str(int(index) - 1) if index.isdigit() and int(index) > 0 else None


def job_folder(environ: Mapping[str, str] | None = None) -> Path:
    """The job's folder (see the module doc); not created here."""
    env = os.environ if environ is None else environ
    if env.get("SUBMITIT_FOLDER"):
        return Path(env["SUBMITIT_FOLDER"].replace("%j", job_id(env)))
    root = Path(env["HPCRING_JOB_DIR"]) if env.get("HPCRING_JOB_DIR") else Path.cwd() / "hpcring-diag"
    return root / job_id(env)


def diag_dir(environ: Mapping[str, str] | None = None, *, create: bool = True) -> Path:
    """``<job folder>/diag``, created on demand (parents too)."""
    path = job_folder(environ) / "diag"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def remove_if_empty(folder: Path) -> None:
    """Remove a job folder and its ``diag/`` when neither holds anything (a run that never hung
    leaves nothing behind); a folder with a report in it stays. Never raises."""
    for path in (folder / "diag", folder):
        try:
            path.rmdir()          # only succeeds when empty
        except OSError:
            pass


def hang_headline(diag: Path, since: float | None = None) -> tuple[str, Path] | None:
    """(headline, text report) of the watchdog's report in the job's ``diag`` folder, if any;
    with ``since`` (a file mtime), only a report written at or after it."""
    path = Path(diag) / "hang-report.json"
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())["headline"], path.with_suffix(".txt")
    except (OSError, ValueError, KeyError, TypeError):
        return None
