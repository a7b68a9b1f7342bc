"""Parallel layouts on the ``hpcring`` torch backend across the 3 dev-cluster nodes (hpcring
submit, 3 nodes x 2 ranks): on a (3, 2) mesh the shard groups are the 2 ranks of one node and the
replicate groups span the 3 nodes; FSDP1 HYBRID_SHARD, FSDP2 HSDP, TP (alone and under FSDP2) and a
(3, 1, 2) mesh, each compared with gloo groups over the same ranks (tests/workers/torch_layouts_worker.py).
A replicate group has 3 ranks, so the reductions over it may round differently from gloo's
(checked within rtol 1e-5). Also examples/train_hsdp.py on 2 nodes x 2 ranks."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODES = ("fsdp1", "fsdp2", "tp", "mesh3d")


def submit(tmp_path, script, nodes, per_node, *args):
    pytest.importorskip("torch")
    # bounded three ways: every collective (HPCRING_TIMEOUT), the Slurm job (--time, minutes) and
    # the wait here (a loaded host once took 400 s for the 6-rank job)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(tmp_path / "state"),
               HPCRING_TIMEOUT="60")
    return subprocess.run([sys.executable, "-m", "hpcring", "submit", str(script), "--site", "devcluster",
                           "--nodes", str(nodes), "--tasks-per-node", str(per_node), "--time", "10", "--wait",
                           "--", *args],
                          capture_output=True, text=True, timeout=660, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL)


def test_hsdp_tp_and_3d_mesh_across_3_nodes_x_2_ranks_match_gloo(tmp_path):
    r = submit(tmp_path, ROOT / "tests" / "workers" / "torch_layouts_worker.py", 3, 2, *MODES)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    for rank in range(6):
        for mode in MODES:
            assert re.search(rf"rank {rank}: {mode} OK ", out), (rank, mode, out[-5000:])
    assert "rank 0: fsdp1 OK mesh (3, 2): HYBRID_SHARD" in out and "rank 0: fsdp2 OK mesh (3, 2): fp32" in out
    assert "rank 0: tp OK tp 6:" in out and "fsdp x tp (3, 2)" in out
    assert "rank 0: mesh3d OK mesh (3, 1, 2): 12 ops on 3 dims equal to gloo" in out


def test_train_hsdp_example_on_2_nodes_x_2_ranks(tmp_path):
    r = submit(tmp_path, ROOT / "examples" / "train_hsdp.py", 2, 2, "--steps", "2", "--cpu")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert "4 ranks as (2, 2) (replicate, shard), backend hpcring" in out, out[-3000:]
    assert re.findall(r"step\s+(\d+) loss \d", out) == ["0", "1"], out[-3000:]
