"""What backend="auto" picks (hpcring.collectives.choice), from the launcher and the environment."""
from __future__ import annotations

import importlib.util
import types

import pytest

from hpcring.collectives import choice
from hpcring.errors import UsageError

needs_mpi4py = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed")


def topo(launcher: str):
    return types.SimpleNamespace(launcher=launcher)


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    from hpcring.collectives import nccl_lib
    monkeypatch.setattr(nccl_lib, "gpu_available", lambda: False)


def test_the_environment_wins():
    assert choice.auto_backend(topo("openmpi"), {"HPCRING_BACKEND": "ring"}) == "ring"
    assert choice.auto_backend(topo("local"), {"HPCRING_BACKEND": "mpi"}) == "mpi"
    with pytest.raises(UsageError, match="HPCRING_BACKEND"):
        choice.auto_backend(topo("local"), {"HPCRING_BACKEND": "gloo"})


@needs_mpi4py
@pytest.mark.parametrize("launcher", ["openmpi", "mvapich", "pmi", "pmix"])
def test_an_mpi_launcher_means_mpi(launcher):
    assert choice.auto_backend(topo(launcher), {}) == "mpi"


@needs_mpi4py
@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"])
def test_a_slurm_step_with_an_mpi_plugin_means_mpi(var):
    assert var in choice.MPI_RANK_VARS                  # from the launcher tables, not a copy
    assert choice.auto_backend(topo("slurm"), {var: "0"}) == "mpi"
    assert choice.auto_backend(topo("slurm"), {var: ""}) == "ring"


@needs_mpi4py
@pytest.mark.parametrize("fabric", ["infiniband", "roce", "tcp", None])
@pytest.mark.parametrize("launcher", ["openmpi", "pmix", "slurm+PMIX_RANK"])
def test_on_a_tcp_fabric_an_mpi_launcher_means_the_ring(launcher, fabric):
    name, _, var = launcher.partition("+")
    env = {var: "0"} if var else {}
    if fabric:
        env["HPCRING_FABRIC"] = fabric
    assert choice.auto_backend(topo(name), env) == ("ring" if fabric == "tcp" else "mpi")
    env["HPCRING_BACKEND"] = "mpi"                     # the environment still wins
    assert choice.auto_backend(topo(name), env) == "mpi"


def test_a_bad_fabric_value_is_refused_naming_the_variable():
    with pytest.raises(UsageError, match="HPCRING_FABRIC"):
        choice.auto_backend(topo("openmpi"), {"HPCRING_FABRIC": "ethernet"})


@pytest.mark.parametrize("kind", ["infiniband", "roce", "tcp"])
def test_the_site_fabric_sets_the_variable_in_every_job(kind):
    from hpcring.config.fabric import fabric_env
    from hpcring.config.schema import Fabric
    assert fabric_env(Fabric(kind=kind))["HPCRING_FABRIC"] == kind


@pytest.mark.parametrize("launcher", ["local", "torchrun", "slurm", "jsrun", "blaunch"])
def test_otherwise_the_ring(launcher):
    assert choice.auto_backend(topo(launcher), {}) == "ring"


def test_a_gpu_means_nccl(monkeypatch):
    from hpcring.collectives import nccl_lib
    monkeypatch.setattr(nccl_lib, "gpu_available", lambda: True)
    assert choice.auto_backend(topo("openmpi"), {}) == "nccl"
