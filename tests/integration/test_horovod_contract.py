"""Horovod's contract for hpcring.torch, on 2 and 3 real local ranks: one long process
per rank runs every check of tests/workers/horovod_contract_worker.py in turn (as horovodrun runs a test
file), so a check whose error poisoned the engine would fail the checks after it. Covered:
exception classes and per-op failure (mismatch, stall, bad arguments), join semantics, every
dtype and Horovod's integer arithmetic, process sets (static, dynamic, on every op and on
DistributedOptimizer), grouped_reducescatter, autograd, sparse gradients, broadcast_optimizer_state
without gradients, and the response cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "horovod_contract_worker.py")
CHECKS = ["mismatch", "args", "stall", "join", "dtypes", "int_arith", "process_sets", "grouped_rs", "autograd",
          "sparse", "optstate_nograd", "cache",
          # what Horovod's own test file relies on, then a long mixed sequence
          "names_after_refusal", "sparse_handle", "sparse_as_dense", "optimizer_outside_set", "optstate_zero_grads",
          "parameter_names", "step_warning", "average_exact", "long_mixed"]


def run_contract(tmp: Path, ranks: int, env=None):
    e = {**os.environ, "HPCRING_TIMEOUT": "10", "HPCRING_JOB_DIR": str(tmp), **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", str(ranks),
                           "--", sys.executable, WORKER, f"size={ranks}", *CHECKS], env=e, capture_output=True,
                          text=True, timeout=240, cwd=tmp)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = {}
    for ranks in (2, 3):
        tmp = tmp_path_factory.mktemp(f"contract{ranks}")
        tl = tmp / "tl" / "timeline.json"
        out[ranks] = (run_contract(tmp, ranks, {"HPCRING_TIMELINE": str(tl)} if ranks == 3 else None), tl)
    return out


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("check", CHECKS)
def test_horovod_contract(jobs, ranks, check):
    p, _ = jobs[ranks]
    out = p.stdout + p.stderr
    fails = [line for line in out.splitlines() if f"FAIL {check} rank" in line]
    assert not fails, out
    for r in range(ranks):
        assert f"OK {check} rank {r}" in out, out


def test_job_ends_cleanly(jobs):
    for ranks, (p, _) in jobs.items():
        assert p.returncode == 0, (ranks, p.stdout + p.stderr)


def test_timeline_shows_the_process_set(jobs):
    p, tl = jobs[3]
    events = []
    for r in range(3):
        lines = Path(f"{tl}.rank{r}").read_text().splitlines()[1:]
        events += [json.loads(x) for x in lines]
    sets = {e["args"].get("process_set") for e in events if e["cat"] == "backend"}
    assert {None, 1, 2} <= sets, sets            # the global set (no tag) and both other sets
