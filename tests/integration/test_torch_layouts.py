"""Real parallel layouts on the ``hpcring`` torch backend, each equal to the same layout on gloo
groups over the same ranks (tests/workers/torch_layouts_worker.py, started by `hpcring run` on local
ranks): FSDP1 HYBRID_SHARD / _HYBRID_SHARD_ZERO2 and FSDP2 HSDP on a 2-D mesh, DTensor tensor
parallelism (alone and under FSDP2), a 3-D DeviceMesh, and monitored_barrier (torch allows it on
gloo only). Also examples/train_hsdp.py through `hpcring run` on 4 ranks.

Bit-identical to gloo where every reducing group has at most 2 ranks (4 ranks as 2 x 2, 2 ranks);
at 3 ranks a group of 3 sums in another order than gloo, so within rounding (rtol 1e-5)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "workers" / "torch_layouts_worker.py")
MODES = ("fsdp1", "fsdp2", "tp", "mesh3d", "monitored")


def run_ranks(tmp_path, cmd, ranks, timeout=240):
    """`hpcring run` of ``cmd`` on ``ranks`` local ranks. Bounded: every hpcring collective by
    HPCRING_TIMEOUT (60 s, then the watchdog ends the job), the whole run by ``timeout`` (the
    ranks die with their supervisor, PR_SET_PDEATHSIG, when `hpcring run` is killed)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCRING_JOB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           "HPCRING_TIMEOUT": "60"}
    return subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks),
                           "--", *cmd], env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("ranks", [4, 3, 2])
def test_hsdp_tp_3d_mesh_and_monitored_barrier_match_gloo(tmp_path, ranks):
    p = run_ranks(tmp_path, [sys.executable, "-W", "ignore", WORKER, *MODES], ranks)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    for r in range(ranks):
        for mode in MODES:
            assert re.search(rf"rank {r}: {mode} OK ", out), (r, mode, out[-5000:])
    line = {m: re.search(rf"rank 0: {m} OK (.*)", out).group(1) for m in MODES}
    shape = {4: "(2, 2)", 3: "(3, 1)", 2: "(1, 2)"}[ranks]
    assert line["fsdp1"].startswith(f"mesh {shape}: HYBRID_SHARD") and "_HYBRID_SHARD_ZERO2" in line["fsdp1"]
    assert line["fsdp2"].startswith(f"mesh {shape}: fp32") and "bf16" in line["fsdp2"]
    # the worker checked each: bit-identical where no reducing group has more than 2 ranks
    kinds = re.findall(r"\((bit-identical|rounding)\)", line["fsdp1"] + line["fsdp2"] + line["tp"])
    exact = ["bit-identical" if ranks != 3 else "rounding"]
    assert kinds == exact * 4 + ["bit-identical" if ranks <= 2 else "rounding"] + exact, kinds
    assert line["tp"].startswith(f"tp {ranks}:") and "fsdp x tp" in line["tp"]
    assert re.match(r"mesh \(\d, \d, \d\): 12 ops on 3 dims equal to gloo", line["mesh3d"]), line["mesh3d"]
    # torch refuses monitored_barrier on any backend but gloo; a gloo group names the late rank
    assert f"gloo group named rank {ranks - 1}" in line["monitored"]
    assert f"Ranks {ranks - 1} failed to pass monitoredBarrier" in out


def test_train_hsdp_example_on_4_local_ranks(tmp_path):
    """examples/train_hsdp.py: FSDP2 HSDP on a (2, 2) mesh; the loss equals gloo's (the same
    script with --backend gloo) bit for bit, and it learns."""
    script = str(ROOT / "examples" / "train_hsdp.py")
    runs = {}
    for backend in ("hpcring", "gloo"):
        p = run_ranks(tmp_path / backend, [sys.executable, "-W", "ignore", script, "--steps", "3", "--cpu",
                                           "--backend", backend], 4)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-5000:]
        assert "4 ranks as (2, 2) (replicate, shard)" in out, out[-3000:]
        runs[backend] = re.findall(r"step\s+(\d+) loss (\S+)", out)
        assert [s for s, _ in runs[backend]] == ["0", "1", "2"], out[-3000:]
    assert runs["hpcring"] == runs["gloo"], runs
    losses = [float(v) for _, v in runs["hpcring"]]
    assert losses[-1] < losses[0], losses


def test_rank_missing_from_a_mesh_group_barrier_is_named(tmp_path):
    """What monitored_barrier is for, on hpcring: the last rank never reaches a barrier of its
    (2, 2) mesh "shard" group; the deadline's report names it by global rank and host."""
    from helpers.jobs import hang_report
    env_extra = {"HPCRING_TIMEOUT": "4", "HPCRING_DIAG_GRACE": "3"}
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCRING_JOB_DIR": str(tmp_path), "OMP_NUM_THREADS": "1",
           **env_extra}
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "4", "--",
                        sys.executable, "-W", "ignore", WORKER, "late"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    rep = hang_report(tmp_path)
    assert rep["categories"].get("missing") == [3], rep
    assert rep["categories"].get("joined") == [2], rep
    assert re.fullmatch(r"barrier#\d+ \(group \d+ of ranks 2-3\): rank 3 \(local0\) never joined", rep["headline"]), rep
    assert "late finished" not in out
