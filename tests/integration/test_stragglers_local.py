"""Straggler verdicts in real local jobs (``hpcring run``, 4 ranks, ring): a rank whose compute
takes 1.5x as long is named by rank 0, with its host, while the job runs; a job where every rank
computes alike gets no verdict; HPCRING_STRAGGLERS=0 starts no watcher; on the MPI backend
(mpirun) the slow rank is named too.

The job is benchmarks/straggler_train.py (compute is a sleep, so that 4 ranks on 2 cores do not
fight for them)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "benchmarks" / "straggler_train.py"


def run(hpcring, tmp_path, steps, **env):
    r = hpcring("run", "--tasks-per-node", "4", "--", sys.executable, str(TRAIN),
                env={"STEPS": str(steps), "HPCRING_JOB_DIR": str(tmp_path / "jobs"),
                     "HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_SITE": "local", **env},
                timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"RESULT (\{.*\})", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(m.group(1)), r.stderr


def test_a_rank_computing_1_5x_as_long_is_named_with_its_host_while_the_job_runs(hpcring, tmp_path):
    res, err = run(hpcring, tmp_path, 160, SLOW_RANK="3", SLOW_FACTOR="1.5", WORK_MS="20")
    named = [ln for ln in err.splitlines() if "straggler:" in ln]
    assert named and "[0]" in named[0] and "straggler: rank 3 (local0) arrived last in " in named[0], err[-3000:]
    assert "its compute between collectives is" in named[0]
    assert res["first_verdict_step"] is not None and res["first_verdict_step"] <= 150, res
    assert all("rank 3" in ln or "none in the last" in ln for ln in named), named


def test_ranks_computing_alike_get_no_verdict(hpcring, tmp_path):
    res, err = run(hpcring, tmp_path, 300, WORK_MS="10")
    assert res["windows"] >= 2, res                 # windows were judged ...
    assert res["lines"] == [] and "straggler:" not in err, err[-3000:]     # ... and nobody named


def test_a_slow_rank_in_a_group_is_named_with_its_global_rank_and_the_group(hpcring, tmp_path):
    """The collectives run on a group of global ranks 1-3 only (as HSDP's shard groups carry most
    of a job's): the group's rank 0 (global rank 1) judges it; the line names global rank 3 and
    the group, and the verdict is kept in the group's own file for the report."""
    res, err = run(hpcring, tmp_path, 160, SLOW_RANK="3", SLOW_FACTOR="1.5", WORK_MS="20", GROUP="1,2,3")
    named = [ln for ln in err.splitlines() if "straggler:" in ln]
    assert named and named[0].startswith("[1]") and "straggler: rank 3 (local0) arrived last in " in named[0], \
        err[-3000:]
    assert "allreduces of group" in named[0] and "of ranks 1-3" in named[0], named[0]
    assert res["lines"] == []                        # the job-wide communicator ran no collective to judge
    files = list((tmp_path / "jobs").rglob("stragglers-group*-ring.jsonl"))
    assert len(files) == 1 and json.loads(files[0].read_text().splitlines()[0])["verdict"]["ranks"] == [3]


@pytest.mark.parametrize("value", ["0", "false"])
def test_the_watcher_can_be_turned_off(hpcring, tmp_path, value):
    res, err = run(hpcring, tmp_path, 20, SLOW_RANK="1", SLOW_FACTOR="3", HPCRING_STRAGGLERS=value)
    assert res["on"] is False and "straggler:" not in err


@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="mpirun or mpi4py is not installed")
def test_a_slow_rank_is_named_on_the_mpi_backend_too(tmp_path):
    """The watcher reads the flight recorder, which every backend writes: under mpirun, on hpcring's
    MPI backend, the slow rank is named as on the ring."""
    from hpcring.bootstrap.auth import new_secret
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_SECRET=new_secret(), HPCRING_MASTER_ADDR="127.0.0.1",
               BACKEND="mpi", STEPS="160", SLOW_RANK="2", SLOW_FACTOR="1.5", WORK_MS="20",
               OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_btl_tcp_if_include="eth0",
               OMPI_MCA_oob_tcp_if_include="eth0")
    env.pop("HPCRING_SECRET_FILE", None)
    names = ["HPCRING_SECRET", "HPCRING_MASTER_ADDR", "BACKEND", "STEPS", "SLOW_RANK", "SLOW_FACTOR", "WORK_MS",
             "PYTHONPATH"]
    cmd = ["mpirun", "-np", "3", "--allow-run-as-root", "--oversubscribe"]
    for k in names:
        cmd += ["-x", k]
    r = subprocess.run([*cmd, sys.executable, str(TRAIN)], capture_output=True, text=True, env=env, timeout=240,
                       cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(re.search(r"RESULT (\{.*\})", r.stdout).group(1))
    assert res["lines"] and res["lines"][0].startswith("straggler: rank 2 ("), res


HVD_SCRIPT = """
import os, time, torch
import hpcring.torch as hvd
hvd.init()
t = torch.ones(1024)
for step in range(160):
    time.sleep(0.02 * (1.5 if hvd.rank() == 2 else 1.0))
    hvd.allreduce(t, name=f"g{step}")
print("HVD_DONE", hvd.rank(), flush=True)
"""


def test_a_horovod_style_script_gets_the_verdict_unchanged(hpcring, tmp_path):
    """A script written for horovod.torch (hpcring.torch) is watched like any other: its slow
    rank is named, with no change to the script."""
    pytest.importorskip("torch")
    script = tmp_path / "hvd_slow.py"
    script.write_text(HVD_SCRIPT)
    r = hpcring("run", "--tasks-per-node", "3", "--", sys.executable, str(script),
                env={"HPCRING_SITE": "local", "HPCRING_JOB_DIR": str(tmp_path / "jobs"),
                     "HPCRING_STATE_DIR": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}, timeout=240)
    assert r.returncode == 0 and r.stdout.count("HVD_DONE") == 3, r.stdout[-2000:] + r.stderr[-3000:]
    named = [ln for ln in r.stderr.splitlines() if "straggler:" in ln]
    assert named and "straggler: rank 2 (local0) arrived last in " in named[0], r.stderr[-3000:]
