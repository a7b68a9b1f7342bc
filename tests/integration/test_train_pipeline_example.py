"""examples/train_pipeline.py through `hpcring run` on 2 and 4 local ranks (one pipeline stage per
rank, torch.distributed.pipelining over hpcring's point-to-point): the last stage's losses equal
the same script's on gloo digit for digit (point-to-point only copies; each stage's arithmetic is
the same), and it learns (step 8 sees step 0's batch again)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "train_pipeline.py")
STEPS = 9


def run_example(tmp_path, ranks, *args, timeout=240):
    """Bounded: every hpcring call by HPCRING_TIMEOUT (60 s, then the watchdog ends the job), the
    whole run by ``timeout`` (the ranks die with their supervisor when `hpcring run` is killed)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCRING_JOB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "HPCRING_TIMEOUT": "60"}
    return subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks),
                           "--", sys.executable, "-W", "ignore", SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("ranks,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_pipeline_example_matches_gloo(tmp_path, ranks, schedule):
    runs = {}
    for backend in ("hpcring", "gloo"):
        p = run_example(tmp_path / backend, ranks, "--steps", str(STEPS), "--cpu", "--schedule", schedule,
                        "--backend", backend)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-5000:]
        assert f"{ranks} stages, schedule {schedule}, 4 microbatches of 16, backend {backend}" in out, out[-3000:]
        rows = re.findall(r"^\[(\d+)\]<stdout>:step\s+(\d+) loss (\S+)$", p.stdout, re.M)
        assert {r for r, _, _ in rows} == {str(ranks - 1)}, rows     # only the last stage has the loss
        assert [int(s) for _, s, _ in rows] == list(range(STEPS)), out[-3000:]
        runs[backend] = [v for _, _, v in rows]
    assert runs["hpcring"] == runs["gloo"], runs
    losses = [float(v) for v in runs["hpcring"]]
    assert losses[8] < losses[0], losses
