"""The ``hpcring`` torch.distributed backend with real torch: `hpcring run` starts local ranks
(ring over loopback TCP) running tests/workers/torch_worker.py; gloo over the same ranks is the reference."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "workers" / "torch_worker.py")


def run_job(tmp_path, *args, ranks=2, env=None, timeout=240, script=WORKER):
    e = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCRING_JOB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
         **(env or {})}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks), "--",
                        sys.executable, "-W", "ignore", script, *args], env=e, capture_output=True, text=True,
                       timeout=timeout, cwd=tmp_path, stdin=subprocess.DEVNULL)
    return p, time.monotonic() - t0


def test_ops_dtypes_bad_input_ddp_hook_fsdp_fsdp2_on_2_ranks(tmp_path):
    p, _ = run_job(tmp_path, "ops,bad,ddp,fsdp,fsdp2")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for r in range(2):
        assert f"[{r}]<stdout>:ops OK 105 checks on 2 ranks" in out
        assert f"[{r}]<stdout>:bad OK" in out
        # `hpcring run` registers the backend when the script imports torch, as `submit` does
        assert re.search(rf"\[{r}\]<stdout>:ddp OK on 2 ranks: .* = 0, comm hook 0; hpcring collectives on ring; registered before the script: True$", out, re.M), out
        assert f"[{r}]<stdout>:fsdp OK on 2 ranks" in out
        assert f"[{r}]<stdout>:fsdp2 OK on 2 ranks" in out


def test_ddp_on_3_ranks_matches_gloo(tmp_path):
    p, _ = run_job(tmp_path, "ddp", ranks=3)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert out.count("ddp OK on 3 ranks") == 3


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
                    reason="mpi4py or mpirun is not installed")
def test_plain_mpirun_uses_the_mpi_backend_through_the_init_helper(tmp_path):
    """No hpcring launcher, no torch env:// variables: hpcring.distributed.init_process_group
    bootstraps, exports them, and the session picks MPI (openmpi launcher + mpi4py)."""
    extra = {"HPCRING_SECRET": "0123456789abcdef0123456789abcdef", "HPCRING_MASTER_ADDR": "127.0.0.1",
             "TORCH_WORKER_INIT": "hpcring", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"),
             "OMPI_MCA_mpi_yield_when_idle": "1"}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe"]
    for k in extra:
        cmd += ["-x", k]
    p = subprocess.run([*cmd, sys.executable, "-W", "ignore", WORKER, "ddp"], env={**env, **extra},
                       capture_output=True, text=True, timeout=240, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert p.stdout.count("ddp OK on 2 ranks: max |hpcring - gloo| = 0, comm hook 0; hpcring collectives on mpi") == 2, \
        p.stdout[-3000:]


def _since_fault(out: str) -> float:
    """Seconds from the fault (the worker prints its time) until now, when every rank has exited."""
    return time.time() - float(re.search(r"FAULT \w+ at (\S+)", out).group(1))


def _report(tmp_path) -> dict:
    from helpers.jobs import hang_report
    return hang_report(tmp_path)


def test_hang_in_ddp_names_rank_host_and_op(tmp_path):
    p, _ = run_job(tmp_path, "skip", "1", env={"HPCRING_TIMEOUT": "4", "HPCRING_DIAG_GRACE": "3"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    rep = _report(tmp_path)
    assert rep["categories"]["missing"] == [1], rep
    assert re.match(r"(allreduce|broadcast)#\d+: rank 1 \(local0\) never joined", rep["headline"]), rep["headline"]
    assert "load_batch at torch_worker.py" in rep["details"]["1"]
    for r in range(2):                                  # every rank says why it exits
        assert f"hpcring: rank {r} (local0)" in out and "exiting with code 1" in out
    assert "training finished" not in out
    assert _since_fault(out) < 4 + 30                    # deadline + 30 s


def test_killed_rank_in_ddp_is_named_dead(tmp_path):
    p, _ = run_job(tmp_path, "kill", "1", env={"HPCRING_TIMEOUT": "4", "HPCRING_DIAG_GRACE": "3"})
    out = p.stdout + p.stderr
    assert p.returncode != 0
    rep = _report(tmp_path)
    assert rep["categories"].get("dead") == [1], rep
    assert re.match(r"(allreduce|broadcast)#\d+: rank 1 \(local0\) died", rep["headline"]), rep["headline"]
    assert "hpcring: rank 0 (local0)" in out and "died; exiting with code 1" in out
    assert _since_fault(out) < 4 + 30


def test_submit_registers_backend_when_script_imports_torch(tmp_path):
    """RunScript's hook: a script that never imports hpcring can init_process_group('hpcring')."""
    code = ("import sys\nfrom hpcring.job import register_torch_backend_on_import\n"
            "register_torch_backend_on_import()\n"
            "assert 'hpcring.distributed' not in sys.modules\n"
            "import torch.distributed as dist\n"
            "print('registered', 'hpcring' in dist.Backend.backend_list, 'hpcring.distributed' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "registered True True"


def test_lightning_ddp_strategy_on_hpcring(tmp_path):
    pytest.importorskip("lightning")
    script = ROOT / "tests" / "workers" / "lightning_worker.py"
    p, _ = run_job(tmp_path, script=str(script))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert out.count("lightning OK backend=hpcring") == 2, out[-3000:]
