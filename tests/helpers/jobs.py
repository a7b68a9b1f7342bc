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


def run_local(worker: str, tmp_path, *args, ranks: int, env=None, timeout: float = 300):
    """``hpcring run`` of ``worker`` (a Python script) with ``args`` on ``ranks`` local ranks;
    the CompletedProcess (bounded by ``timeout``)."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    e = {**os.environ, "PYTHONPATH": str(root / "src"), "HPCRING_JOB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
         **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks),
                           "--", sys.executable, "-W", "ignore", worker, *args], env=e, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, stdin=subprocess.DEVNULL)


def run_mpirun(worker: str, tmp_path, *args, ranks: int, timeout: float = 300):
    """A plain ``mpirun -np ranks`` of ``worker`` (the session picks the MPI backend)."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[2]
    extra = {"HPCRING_SECRET": "0123456789abcdef0123456789abcdef", "HPCRING_MASTER_ADDR": "127.0.0.1",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root / "src"), "OMPI_MCA_mpi_yield_when_idle": "1",
             "HPCRING_JOB_DIR": str(tmp_path)}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = ["mpirun", "-np", str(ranks), "--allow-run-as-root", "--oversubscribe"]
    for k in extra:
        cmd += ["-x", k]
    return subprocess.run([*cmd, sys.executable, "-W", "ignore", worker, *args], env={**env, **extra},
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path, stdin=subprocess.DEVNULL)


def local_env_for(tmp_path, **more) -> dict:
    """Variables for a local job with its own records and job folders under ``tmp_path``."""
    return {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_JOB_DIR": str(tmp_path / "jobs"),
            "HPCRING_SITE": "local", **more}


def job_id_of(r) -> str:
    """The id in ``Submitted job ID`` of a finished ``hpcring submit``."""
    return r.stderr.split("Submitted job ")[1].split()[0]


def sacct_state(job: str) -> str:
    """The Slurm job's final state from sacct (RUNNING etc. if it did not end within about 30 s)."""
    import subprocess
    import time
    for _ in range(30):
        r = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True,
                           timeout=30)
        state = r.stdout.strip()
        if state and state not in ("RUNNING", "COMPLETING", "PENDING"):
            return state
        time.sleep(1)
    return state
