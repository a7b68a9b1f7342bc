"""Subgroups on the ``hpcring`` torch backend (new_group, new_subgroups, a 2-D DeviceMesh), each
op equal to gloo over the same ranks; a rank missing from a subgroup's collective is reported by
its global rank and host. `hpcring run` starts local ranks running tests/workers/torch_subgroup_worker.py."""
from __future__ import annotations

import importlib.util
import re
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "workers" / "torch_subgroup_worker.py")


def run_job(tmp_path, *args, ranks, env=None, timeout=300):
    from helpers.jobs import run_local
    return run_local(WORKER, tmp_path, *args, ranks=ranks, env=env, timeout=timeout)


@pytest.mark.parametrize("ranks", [4, 3, 2])
def test_new_group_new_subgroups_and_2d_mesh_match_gloo(tmp_path, ranks):
    p = run_job(tmp_path, "groups", ranks=ranks)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for r in range(ranks):
        assert re.search(rf"rank {r}: groups OK \(\d+ ops equal to gloo\) on ring", out), out[-4000:]


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None,
                    reason="mpi4py or mpirun is not installed")
def test_subgroups_on_the_mpi_backend_under_plain_mpirun(tmp_path):
    """The session picks MPI under mpirun: groups are MPI_Comm_create_group communicators."""
    from helpers.jobs import run_mpirun
    p = run_mpirun(WORKER, tmp_path, "groups", ranks=4)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    for r in range(4):
        assert re.search(rf"rank {r}: groups OK \(\d+ ops equal to gloo\) on mpi", out), out[-4000:]


def test_rank_missing_from_a_subgroup_collective_is_named_by_global_rank_and_host(tmp_path):
    from helpers.jobs import hang_report
    p = run_job(tmp_path, "hang", "2", ranks=4, env={"HPCRING_TIMEOUT": "4", "HPCRING_DIAG_GRACE": "3"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    rep = hang_report(tmp_path)
    # the group {0, 2}: its rank 1 is global rank 2; ranks 1 and 3 are not members (not "missing")
    assert rep["categories"].get("missing") == [2], rep
    assert rep["categories"].get("joined") == [0], rep
    assert rep["headline"] == "allreduce#2 (group 1 of ranks 0,2): rank 2 (local0) never joined", rep["headline"]
    assert "hang at torch_subgroup_worker.py" in rep["details"]["2"], rep
    assert "rank 2 (local0)" in rep["trigger"]["error"], rep["trigger"]
    for r in range(4):                                  # every rank, member or not, says why it exits
        assert f"hpcring: rank {r} (local0)" in out and "exiting with code 1" in out
    assert "hang finished" not in out
    fault = float(re.search(r"FAULT \w+ at (\S+)", out).group(1))
    assert time.time() - fault < 4 + 30                 # deadline + 30 s
