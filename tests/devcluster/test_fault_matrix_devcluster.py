"""The fault matrix on the dev cluster (see tests/integration/test_fault_matrix.py for the local
half): a frozen rank ends the whole Slurm job (ring and MPI) and the LSF emulation's, the victim
named, every rank gone and the job out of the queue within the deadline + 30 s, FAILED; a
different count or collective on MPI is named at once and leaves every node usable."""
from __future__ import annotations

import importlib.util

import pytest

from helpers.faults import DEADLINE, check, fault_matrix

mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")


@pytest.mark.parametrize("backend", ["ring", pytest.param("mpi", marks=mpi)])
def test_slurm_frozen_rank_ends_the_job(backend):
    res = fault_matrix.run_one("slurm", backend, "stop", DEADLINE)
    check(res)
    assert "rank 1 (node2) unreachable" in res.headline


def test_lsf_frozen_rank_ends_the_job():
    res = fault_matrix.run_one("lsf", "ring", "stop", DEADLINE)
    check(res)
    assert "ending the job: bkill" in fault_matrix._rank_logs(res.folder)


@mpi
@pytest.mark.parametrize("fault", ["different", "mismatch"])
def test_slurm_mpi_mismatch_is_named_and_leaves_every_node_usable(fault):
    bad = fault_matrix.unusable_nodes()
    if bad:
        pytest.skip(f"dev cluster nodes not usable before the test: {bad}")
    res = fault_matrix.run_one("slurm", "mpi", fault, DEADLINE)
    check(res)
    assert "rank 1 (node2) called" in res.headline, res.headline
    assert res.dt(res.report_at) < 3.0, res.dt(res.report_at)
    # every rank ends itself: the reporter no longer sits in a scancel of its own step until
    # slurmstepd's KillWait SIGKILL (5 s here: ->gone was report + 5.0 s in every run before)
    assert res.dt(res.gone_at) - res.dt(res.report_at) < 3.0, (res.dt(res.report_at), res.dt(res.gone_at))
    assert fault_matrix.unusable_nodes() == []      # no "Kill task failed" drain
