"""Which collective backends exist and what ``backend="auto"`` means: one owner for both (the
session, its groups and the benchmark ask here; the launchers' facts come from
:mod:`hpcring.bootstrap.launcher_tables`)."""
from __future__ import annotations

import importlib.util
import os

from hpcring.bootstrap.launcher_tables import INNER_MPI, TABLES
from hpcring.config import envvars
from hpcring.collectives import nccl_lib

BACKENDS = ("auto", "ring", "mpi", "nccl")

# the rank variables of the MPI launchers: one set under a Slurm step means srun --mpi=pmix|pmi2
MPI_RANK_VARS = tuple(v for name in INNER_MPI for v in TABLES[name].rank)


def auto_backend(topology, environ=None) -> str:
    """What ``backend="auto"`` means (decided the same way on every rank of a job):

    1. ``HPCRING_BACKEND`` if set (ring, mpi or nccl);
    2. ``nccl`` when cupy imports and sees at least one GPU;
    3. ``mpi`` when mpi4py is installed and an MPI launcher started the job: ``Topology.launcher``
       is one of the MPI launchers (openmpi, mvapich, pmi, pmix), or a Slurm step started with
       ``srun --mpi=pmix|pmi2`` (launcher ``slurm`` with an MPI launcher's rank variable set);
       unless the site's fabric is TCP (``HPCRING_FABRIC=tcp``, from the site config): there MPI
       has no RDMA to bring, and the ring measured faster than Open MPI's TCP transport at every
       collective and size on the dev cluster (1.11-5.89x) and at point-to-point from 4 MiB (a torch
       round trip 0.76-0.86 of Gloo's time against MPI's 1.3-2.2; docs/collectives.md "MPI and
       NCCL backends");
    4. ``ring`` otherwise.
    """
    env = os.environ if environ is None else environ
    chosen = envvars.get("HPCRING_BACKEND", env)
    if chosen:
        return chosen
    if nccl_lib.gpu_available():
        return "nccl"
    if envvars.get("HPCRING_FABRIC", env) != "tcp" and importlib.util.find_spec("mpi4py") is not None:
        if topology.launcher in INNER_MPI:
            return "mpi"
        if topology.launcher == "slurm" and any(env.get(v) for v in MPI_RANK_VARS):
            return "mpi"
    return "ring"
