"""examples/train.py: data-parallel training gives the single-process loss curve (same global batch)."""
from __future__ import annotations

import pytest

from helpers.train_example import ARGS, STEPS, TRAIN, assert_same_training, losses, single_process


@pytest.fixture
def local_env(tmp_path):
    return {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_JOB_DIR": str(tmp_path / "jobs")}


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (2, 2)])
def test_local_backend_matches_single_process(hpcring, tmp_path, local_env, nodes, per_node):
    ref, ref_ckpt = single_process(tmp_path)
    r = hpcring("submit", str(TRAIN), "--nodes", str(nodes), "--tasks-per-node", str(per_node), "--wait",
                "--", *ARGS, env=local_env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"on {nodes * per_node} rank(s)" in r.stdout
    # default checkpoint folder: <job folder>/checkpoints, written by rank 0 only (one file per save)
    ckpts = sorted((tmp_path / "jobs").glob("*/checkpoints/*"))
    assert [p.name for p in ckpts] == [f"step_{STEPS:06d}.npz"], ckpts
    assert_same_training(ref, losses(r.stdout), ref_ckpt, ckpts[0])
