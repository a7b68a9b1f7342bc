"""examples/train.py run as one process and through hpcring, and the check that both trained the same."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

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
