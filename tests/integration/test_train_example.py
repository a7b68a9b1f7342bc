"""examples/train.py: data-parallel training gives the single-process loss curve (same global batch)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
STEPS = 20
# an uneven split on purpose: 30 rows over 4 ranks = 8, 8, 7, 7; over 6 ranks = 5 each
ARGS = ["--steps", str(STEPS), "--global-batch", "30", "--seed", "3"]
LOSS = re.compile(r"^(?:\[(\d+)\]<stdout>:)?step\s+(\d+) loss (\S+)$")


def losses(stdout: str) -> list[float]:
    """The printed losses in step order; asserts only rank 0 printed them, each step once."""
    rows = [m.groups() for m in map(LOSS.match, stdout.splitlines()) if m]
    assert {r[0] for r in rows} <= {None, "0"}, "only rank 0 may print the loss"
    steps = [int(r[1]) for r in rows]
    assert steps == list(range(STEPS)), steps
    return [float(r[2]) for r in rows]


def hpcring(*args, env=None, timeout=240, cwd=None):
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **(env or {}))
    return subprocess.run([sys.executable, "-m", "hpcring", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd or str(ROOT))


def single_process(tmp_path) -> tuple[list[float], Path]:
    ckpt = tmp_path / "solo-ckpt"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for v in ("RANK", "WORLD_SIZE", "HPCRING_SESSION", "SLURM_JOB_ID", "SLURM_PROCID"):
        env.pop(v, None)
    r = subprocess.run([sys.executable, str(TRAIN), *ARGS, "--ckpt-dir", str(ckpt)], capture_output=True,
                       text=True, env=env, timeout=120, cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "on 1 rank(s)" in r.stdout
    return losses(r.stdout), ckpt / f"step_{STEPS:06d}.npz"


def assert_same_training(ref: list[float], got: list[float], ref_ckpt: Path, got_ckpt: Path) -> None:
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)
    assert ref[-1] < ref[0]                          # it does learn
    a, b = np.load(ref_ckpt), np.load(got_ckpt)
    assert sorted(a.files) == sorted(b.files) and int(b["step"]) == STEPS
    for k in ("W1", "b1", "W2", "b2"):
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-9)


@pytest.fixture
def local_env(tmp_path):
    return {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_JOB_DIR": str(tmp_path / "jobs")}


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (2, 2)])
def test_local_backend_matches_single_process(tmp_path, local_env, nodes, per_node):
    ref, ref_ckpt = single_process(tmp_path)
    r = hpcring("submit", str(TRAIN), "--nodes", str(nodes), "--tasks-per-node", str(per_node), "--wait",
                "--", *ARGS, env=local_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"on {nodes * per_node} rank(s)" in r.stdout
    # default checkpoint folder: <job folder>/checkpoints, written by rank 0 only (one file per save)
    ckpts = sorted((tmp_path / "jobs").glob("*/checkpoints/*"))
    assert [p.name for p in ckpts] == [f"step_{STEPS:06d}.npz"], ckpts
    assert_same_training(ref, losses(r.stdout), ref_ckpt, ckpts[0])


def _idle_nodes() -> bool:
    from helpers_jobs import sinfo_states
    return "idle" in (sinfo_states() or "")


@pytest.mark.devcluster
@pytest.mark.skipif(not _idle_nodes(), reason="dev cluster has no idle nodes (hpcring devcluster up)")
def test_devcluster_3_nodes_x_2_ranks_matches_single_process(tmp_path):
    ref, ref_ckpt = single_process(tmp_path)
    ckpt = Path("/srv/hpcring") / f"train-ckpt-{os.getpid()}"
    try:
        r = hpcring("submit", str(TRAIN), "--site", "devcluster", "--nodes", "3", "--tasks-per-node", "2",
                    "--wait", "--", *ARGS, "--ckpt-dir", str(ckpt),
                    env={"HPCRING_STATE_DIR": str(tmp_path / "state")}, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "on 6 rank(s)" in r.stdout
        assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{STEPS:06d}.npz"]
        assert_same_training(ref, losses(r.stdout), ref_ckpt, ckpt / f"step_{STEPS:06d}.npz")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
