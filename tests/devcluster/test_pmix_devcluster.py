"""Rendezvous through PMIx on the real dev cluster (srun --mpi=pmix -N3, Slurm's pmix plugin and
Debian's libpmix2): addresses from PMIx then an exact ring allreduce; a rank that never arrives is
named at the deadline; an unloadable libpmix falls back to the store (auto) or fails clearly (pmix)."""
from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcring.bootstrap import pmix

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "pmix_rendezvous_worker.py"
ROW = re.compile(r"RESULT rank=(\d+) size=(\d+) host=(\S+) rendezvous=(\S+)")


def _have_lib() -> bool:
    try:
        pmix.load_library()
        return True
    except Exception:   # noqa: BLE001
        return False


pytestmark = [
    pytest.mark.skipif(not _have_lib(), reason="libpmix2 is not installed"),
]


@pytest.fixture
def secret_file():
    path = Path("/srv/hpcring") / f"pmix-devcluster-secret-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    yield path
    path.unlink(missing_ok=True)


def _srun(secret: Path, per_node: int, timeout: float = 150, **extra: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMIX_", "SLURM_"))}   # the runner's own
    env.update(HPCRING_SECRET_FILE=str(secret), PYTHONPATH=str(ROOT / "src"), **extra)
    t = time.monotonic()
    r = subprocess.run(["srun", "--mpi=pmix", "-N3", f"--ntasks-per-node={per_node}", "--time=3",
                        sys.executable, str(WORKER)], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=ROOT)
    return r, time.monotonic() - t


def test_addresses_through_pmix_then_an_exact_ring_allreduce(secret_file):
    r, _ = _srun(secret_file, 2, HPCRING_RENDEZVOUS="pmix")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    rows = ROW.findall(r.stdout)
    assert sorted(int(x[0]) for x in rows) == list(range(6)), out[-4000:]
    assert {x[2] for x in rows} == {"node1", "node2", "node3"}
    assert all(x[1] == "6" and x[3] == "pmix" for x in rows), rows   # not the store
    assert r.stdout.count(" ok=1") == 6, r.stdout   # the worker checks the sum exactly


def test_auto_picks_pmix_under_srun_mpi_pmix_from_its_size(secret_file):
    r, _ = _srun(secret_file, 1, HPCRING_PMIX_MIN_RANKS="3")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert [x[3] for x in ROW.findall(r.stdout)] == ["pmix"] * 3, r.stdout
    r, _ = _srun(secret_file, 1)                  # 3 ranks, under the default 256: the store
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert [x[3] for x in ROW.findall(r.stdout)] == ["store"] * 3, r.stdout


def test_a_rank_that_never_arrives_is_named_at_the_deadline(secret_file):
    # 20 s: the other five must all reach the fence before it, even with start-up skew on loaded cores
    r, took = _srun(secret_file, 2, HPCRING_RENDEZVOUS="pmix", PMIX_WORKER_HANG_RANK="5", PMIX_WORKER_TIMEOUT="20")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    errors = [x for x in r.stdout.splitlines() if x.startswith("INITERROR")]
    assert errors, out[-4000:]
    for line in errors:
        assert "1 of 6 ranks never reached hpcring.init(): rank 5 on node3" in line, line
        assert "the PMIx fence of slurm.pmix." in line, line   # it was PMIx that timed out, not the store
    # the 20 s deadline; srun then ends the step (the hung rank is killed), with start-up on 2 loaded cores
    assert took < 20 + 60, took


def test_unloadable_libpmix_falls_back_to_the_store_in_auto_and_fails_in_pmix_mode(secret_file):
    r, _ = _srun(secret_file, 1, HPCRING_PMIX_LIBRARY="/nonexistent/libpmix.so.2", HPCRING_PMIX_MIN_RANKS="1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert [x[3] for x in ROW.findall(r.stdout)] == ["store"] * 3, out[-4000:]
    assert "rendezvous through the store: cannot load libpmix: /nonexistent/libpmix.so.2" in r.stderr, r.stderr[-3000:]
    r, took = _srun(secret_file, 1, HPCRING_PMIX_LIBRARY="/nonexistent/libpmix.so.2", HPCRING_RENDEZVOUS="pmix",
                    PMIX_WORKER_TIMEOUT="20")
    errors = [x for x in r.stdout.splitlines() if x.startswith("INITERROR")]
    assert r.returncode != 0 and errors, (r.stdout + r.stderr)[-4000:]
    assert all("HPCRING_RENDEZVOUS=pmix, but PMIx cannot be used: cannot load libpmix" in x for x in errors), errors
