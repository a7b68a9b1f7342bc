"""examples/train.py on the dev cluster, 3 nodes x 2 ranks: the single-process loss curve (same global
batch) and weights (the local backend's half: tests/integration/test_train_example.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from helpers.train_example import ARGS, STEPS, TRAIN, assert_same_training, losses, single_process


def test_devcluster_3_nodes_x_2_ranks_matches_single_process(hpcring, tmp_path):
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
