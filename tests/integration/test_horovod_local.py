"""hpcring.torch (the Horovod API) end to end: `hpcring run` starts real ranks on this machine
(ring backend over loopback TCP, real torch) running tests/workers/horovod_worker.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "horovod_worker.py")


def run_job(tmp_path, *args, ranks=2, env=None, timeout=180):
    e = {**os.environ, "HPCRING_TIMEOUT": "30", "HPCRING_JOB_DIR": str(tmp_path), **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks),
                           "--", sys.executable, WORKER, *args], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def ok(p, mode: str, ranks: int) -> None:
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    for r in range(ranks):
        assert f"OK {mode} rank {r}" in out, out


@pytest.fixture(scope="module")
def job3(tmp_path_factory):
    """One 3-rank job runs every positive check (ranks import torch once), recording a timeline."""
    tmp = tmp_path_factory.mktemp("hvd3")
    base = tmp / "tl" / "timeline.json"
    p = run_job(tmp, "train:none:1", "train:fp16:1", "train:none:2", "optstate", "collectives", "syncbn", "timeline", "cycles",
                ranks=3, env={"HPCRING_TIMELINE": str(base)})
    return p, base


@pytest.mark.parametrize("mode", ["train:none:1", "train:fp16:1", "train:none:2"])
def test_distributed_optimizer_matches_single_process_global_batch(job3, mode):
    ok(job3[0], mode, 3)


def test_broadcast_optimizer_state_restores_adam_and_sgd_momentum(job3):
    ok(job3[0], "optstate", 3)


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(job3):
    ok(job3[0], "syncbn", 3)


def test_collectives_allgather_uneven_alltoall_reducescatter_join(job3):
    ok(job3[0], "collectives", 3)


def test_fusion_cycle_starts_on_the_steps_last_gradient_or_a_full_buffer(job3):
    ok(job3[0], "cycles", 3)


def test_name_mismatch_is_named_on_every_rank(tmp_path):
    p = run_job(tmp_path, "mismatch", env={"HPCRING_TIMEOUT": "3"})
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    for r in (0, 1):
        assert (f"DIAG rank {r}: hpcring.torch: operation names do not match across ranks after 3 s" in out), out
    assert "'grad.layer0' submitted by rank 0, not by rank 1" in out
    assert "'grad.layer1' submitted by rank 1, not by rank 0" in out


def test_missing_rank_is_named(tmp_path):
    p = run_job(tmp_path, "missing", env={"HPCRING_TIMEOUT": "3", "HPCRING_DIAG_GRACE": "3"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    from helpers.jobs import hang_report
    rep = hang_report(tmp_path)
    assert rep["categories"]["missing"] == [1], rep
    assert "in allreduce at horovod_worker.py" in out          # where rank 0 waits


def test_merged_timeline_is_chrome_trace_with_every_rank(job3):
    p, base = job3
    ok(p, "timeline", 3)
    m = subprocess.run([sys.executable, "-m", "hpcring", "timeline", str(base)], capture_output=True, text=True,
                       timeout=60)
    assert m.returncode == 0, m.stderr
    doc = json.loads(base.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    for r in range(3):
        cats = {e["cat"] for e in events if e["pid"] == r}
        assert {"queued", "negotiate", "pack", "backend", "unpack"} <= cats, (r, cats)
    for e in events:
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 1 and e["name"]
    fused = [e for e in events if e["cat"] == "backend" and e["pid"] == 0]
    assert any(e["args"].get("count", 1) > 1 for e in fused), fused          # gradients were fused
    assert all(e["args"]["backend"] == "ring" for e in fused)


def test_timeline_cli_names_what_is_missing(tmp_path):
    m = subprocess.run([sys.executable, "-m", "hpcring", "timeline", str(tmp_path / "nothing")],
                       capture_output=True, text=True, timeout=60)
    assert m.returncode != 0 and "no timeline files" in m.stderr and "Traceback" not in m.stderr


def test_plain_python_runs_as_one_rank(tmp_path):
    """`python train.py` without a launcher is one rank, as with Horovod."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HPCRING_", "SLURM_", "OMPI_", "PMI", "LSB_", "LSF_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    code = ("import torch, hpcring.torch as hvd; hvd.init(); m = torch.nn.Linear(2, 1)\n"
            "o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())\n"
            "m(torch.ones(3, 2)).sum().backward(); o.step()\n"
            "print('ONE', hvd.size(), hvd.rank(), hvd.allreduce(torch.tensor([3.0])).item())")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 0 and "ONE 1 0 3.0" in p.stdout, p.stdout + p.stderr
