"""Point-to-point and pipeline parallelism on the ``hpcring`` torch backend across the 3 dev-cluster
nodes (hpcring submit, 3 nodes x 2 ranks):

* tests/workers/torch_p2p_worker.py ``p2p`` on the ring and on MPI: send/recv, isend/irecv, batches, any
  source, tags out of order, every dtype, and point-to-point inside subgroups (the odd and the
  even ranks: each group spans the 3 hosts and shares each with the other) equal to gloo's;
* examples/train_pipeline.py as 6 stages (1F1B, one per rank, neighbours on the same node and
  across nodes): the last stage's losses on the ring and on MPI equal gloo's digit for digit."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STEPS = 9


def submit(tmp_path, script, *args, backend=None):
    """3 nodes x 2 ranks; ``backend``: HPCRING_BACKEND (ring, mpi) or None (the site's choice).
    Bounded three ways: every hpcring call (HPCRING_TIMEOUT), the Slurm job (--time, minutes) and
    the wait here."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(tmp_path / "state"),
               HPCRING_TIMEOUT="60")
    env.pop("HPCRING_BACKEND", None)
    if backend:
        env["HPCRING_BACKEND"] = backend
    return subprocess.run([sys.executable, "-m", "hpcring", "submit", str(script), "--site", "devcluster",
                           "--nodes", "3", "--tasks-per-node", "2", "--time", "10", "--wait", "--", *args],
                          capture_output=True, text=True, timeout=660, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_p2p_across_3_nodes_x_2_ranks_matches_gloo(tmp_path, backend):
    r = submit(tmp_path, ROOT / "tests" / "workers" / "torch_p2p_worker.py", "p2p", backend=backend)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    counts = set()
    for rank in range(6):
        m = re.search(rf"^\[{rank}\]<stdout>:rank {rank}: p2p OK \((\d+) results equal to gloo\) on {backend}$",
                      r.stdout, re.M)
        assert m, (rank, out[-5000:])
        counts.add(int(m.group(1)))
    assert len(counts) == 1, counts       # every rank compared the same calls (subgroups included)


def test_pipeline_example_6_stages_on_3_nodes_matches_gloo(tmp_path):
    runs = {}
    for name, backend in (("ring", "ring"), ("mpi", "mpi"), ("gloo", None)):
        r = submit(tmp_path / name, ROOT / "examples" / "train_pipeline.py", "--steps", str(STEPS), "--cpu",
                   "--backend", "gloo" if name == "gloo" else "hpcring", backend=backend)
        out = r.stdout + r.stderr
        assert r.returncode == 0, (name, out[-5000:])
        assert "6 stages, schedule 1f1b, 6 microbatches of 16" in out, out[-3000:]
        rows = re.findall(r"^\[(\d+)\]<stdout>:step\s+(\d+) loss (\S+)$", r.stdout, re.M)
        assert {rk for rk, _, _ in rows} == {"5"}, rows                  # the last stage prints
        assert [int(s) for _, s, _ in rows] == list(range(STEPS)), out[-3000:]
        runs[name] = [v for _, _, v in rows]
    assert runs["ring"] == runs["gloo"] and runs["mpi"] == runs["gloo"], runs
    losses = [float(v) for v in runs["gloo"]]
    assert losses[8] < losses[0], losses       # step 8 sees step 0's batch again
