"""MPI backend on the real dev cluster: srun --mpi=pmix -N3 --ntasks-per-node=2, hpcring.init(backend="mpi")."""
from __future__ import annotations

import importlib.util
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed"),
]


def test_init_backend_mpi_across_six_ranks(tmp_path):
    folder = Path("/srv/hpcring")
    secret = folder / f"mpi-devcluster-secret-{os.getpid()}"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env = dict(os.environ, HPCRING_SECRET_FILE=str(secret), PYTHONPATH=str(ROOT / "src"),
               OMPI_MCA_btl_tcp_if_include="eth0", OMPI_MCA_oob_tcp_if_include="eth0",
               OMPI_MCA_mpi_yield_when_idle="1")
    env.pop("HPCRING_BACKEND", None)
    try:
        r = subprocess.run(["srun", "--mpi=pmix", "-N3", "--ntasks-per-node=2", "--time=2",
                            sys.executable, str(ROOT / "tests" / "workers" / "mpi_worker_init.py")],
                           capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    finally:
        secret.unlink(missing_ok=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = re.findall(r"RESULT rank=(\d+) size=(\d+) host=(\S+) launcher=(\S+) backend=(\S+) auto=(\S+) ok=(\d+)", r.stdout)
    assert sorted(int(x[0]) for x in rows) == list(range(6)), out[-4000:]
    assert {x[2] for x in rows} == {"node1", "node2", "node3"}
    assert all(x[1] == "6" and x[4] == "MpiBackend" and x[5] == "mpi" and x[6] == "3" for x in rows), rows
