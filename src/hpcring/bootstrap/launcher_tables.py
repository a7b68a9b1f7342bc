"""The launcher and allocation tables: which environment variable gives which fact, as data.

:data:`TABLES` (one :class:`LauncherTable` per launcher, in :data:`DETECTION_ORDER`) tells a rank
who it is; :data:`ALLOCATIONS` tells a process inside an allocation (salloc, bsub -Is, a batch
script) how big the allocation is. The logic that reads them is in launchers.py (with
launcher_reading.py and launcher_corroborate.py) and allocation_size.py, LSF's slot lists in
lsf_slots.py. Standard library only.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

UNKNOWN = -1
UNKNOWN_HOST = "?"


@dataclass(frozen=True)
class LauncherTable:
    """Variable names per Topology field for one launcher; the first name that is set wins.

    ``marker``: variables that must all be set for the table to apply (``marker_value`` pins the
    first one to a value). ``required``: fields that must then be present, else BootstrapError.
    """

    name: str
    marker: tuple[str, ...]
    required: tuple[str, ...] = ()
    marker_value: str | None = None
    rank: tuple[str, ...] = ()
    size: tuple[str, ...] = ()
    local_rank: tuple[str, ...] = ()
    local_size: tuple[str, ...] = ()
    node_rank: tuple[str, ...] = ()
    num_nodes: tuple[str, ...] = ()
    job_id: tuple[str, ...] = ()
    master_addr: tuple[str, ...] = ()
    master_port: tuple[str, ...] = ()
    nodelist: tuple[str, ...] = ()        # hostlist expression of the nodes, node-rank order
    tasks_per_node: tuple[str, ...] = ()  # Slurm's "2(x3),1"
    hostname: tuple[str, ...] = ()        # this rank's node name as the launcher knows it
    step_id: tuple[str, ...] = ()
    rank_base: int = 0                    # the rank variable counts from this (LSF_PM_TASKID: 1)


TABLES: dict[str, LauncherTable] = {
    "local": LauncherTable(
        "local", marker=("HPCRING_LAUNCHER",), marker_value="local",
        required=("rank", "size", "local_rank", "local_size", "node_rank", "num_nodes", "nodelist"),
        rank=("HPCRING_RANK",), size=("HPCRING_SIZE",),
        local_rank=("HPCRING_LOCAL_RANK",), local_size=("HPCRING_LOCAL_SIZE",),
        node_rank=("HPCRING_NODE_RANK",), num_nodes=("HPCRING_NUM_NODES",),
        nodelist=("HPCRING_NODELIST",), hostname=("HPCRING_HOSTNAME",),
        job_id=("HPCRING_JOB_ID",), master_addr=("HPCRING_MASTER_ADDR",)),
    "torchrun": LauncherTable(
        "torchrun", marker=("RANK", "WORLD_SIZE"),
        required=("rank", "size", "local_rank", "local_size"),
        rank=("RANK",), size=("WORLD_SIZE",),
        local_rank=("LOCAL_RANK",), local_size=("LOCAL_WORLD_SIZE",),
        node_rank=("GROUP_RANK",), num_nodes=("GROUP_WORLD_SIZE",),
        job_id=("TORCHELASTIC_RUN_ID",),
        master_addr=("MASTER_ADDR",), master_port=("MASTER_PORT",)),
    "openmpi": LauncherTable(
        "openmpi", marker=("OMPI_COMM_WORLD_RANK",),
        required=("rank", "size", "local_rank", "local_size"),
        rank=("OMPI_COMM_WORLD_RANK",), size=("OMPI_COMM_WORLD_SIZE",),
        local_rank=("OMPI_COMM_WORLD_LOCAL_RANK",), local_size=("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mvapich": LauncherTable(
        "mvapich", marker=("MV2_COMM_WORLD_RANK",),
        required=("rank", "size", "local_rank", "local_size"),
        rank=("MV2_COMM_WORLD_RANK",), size=("MV2_COMM_WORLD_SIZE",),
        local_rank=("MV2_COMM_WORLD_LOCAL_RANK",), local_size=("MV2_COMM_WORLD_LOCAL_SIZE",)),
    "pmi": LauncherTable(
        "pmi", marker=("PMI_RANK",), required=("rank", "size"),
        rank=("PMI_RANK",), size=("PMI_SIZE",),
        # Hydra sets these; Slurm's pmi2 plugin does not (then srun's SLURM_* corroborate).
        local_rank=("MPI_LOCALRANKID",), local_size=("MPI_LOCALNRANKS",)),
    "pmix": LauncherTable(
        "pmix", marker=("PMIX_RANK",), required=("rank",), rank=("PMIX_RANK",)),
    "jsrun": LauncherTable(
        "jsrun", marker=("JSM_NAMESPACE_RANK",),
        required=("rank", "size", "local_rank", "local_size"),
        rank=("JSM_NAMESPACE_RANK",), size=("JSM_NAMESPACE_SIZE",),
        local_rank=("JSM_NAMESPACE_LOCAL_RANK",), local_size=("JSM_NAMESPACE_LOCAL_SIZE",),
        job_id=("LSB_JOBID",)),
    "blaunch": LauncherTable(
        "blaunch", marker=("LSF_PM_TASKID", "LSB_JOBID"), required=("rank",),
        rank=("LSF_PM_TASKID",), rank_base=1, job_id=("LSB_JOBID",)),
    "slurm": LauncherTable(
        "slurm", marker=("SLURM_STEP_ID", "SLURM_PROCID"),
        required=("rank", "size", "local_rank", "node_rank", "nodelist", "tasks_per_node"),
        rank=("SLURM_PROCID",), size=("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        local_rank=("SLURM_LOCALID",), node_rank=("SLURM_NODEID",),
        num_nodes=("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
        nodelist=("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
        tasks_per_node=("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
        hostname=("SLURMD_NODENAME",), job_id=("SLURM_JOB_ID", "SLURM_JOBID"),
        step_id=("SLURM_STEP_ID",)),
}


DETECTION_ORDER = ("local", "torchrun", "openmpi", "mvapich", "pmi", "pmix", "jsrun", "blaunch", "slurm")
OUTER = ("jsrun", "slurm")                         # may corroborate an inner launcher (launcher_corroborate.py)
INNER_MPI = ("openmpi", "mvapich", "pmi", "pmix")  # must agree on the rank when several are set
# LSF's lists of the job's slots (one host per slot), first one set wins. A rank reads hpcring's
# own host file first: the one `hpcring run` started it from (launch node already left out).
LSF_HOST_VARS = ("LSB_DJOB_RANKFILE", "LSB_DJOB_HOSTFILE", "LSB_MCPU_HOSTS", "LSB_HOSTS")
RANK_SLOT_VARS = ("HPCRING_LSF_HOSTFILE", *LSF_HOST_VARS)
JOB_ID_FALLBACK = ("SLURM_JOB_ID", "SLURM_JOBID", "LSB_JOBID")
# Slurm's special step ids (batch 0xfffffffb, interactive 0xfffffffa, ...) are not task steps.
SLURM_MAX_TASK_STEP = 0xFFFFFFF0


@dataclass(frozen=True)
class AllocationTable:
    """How an allocation tells a process inside it its size; the first variable set wins.

    ``job_id`` marks the allocation; ``num_nodes`` gives the node count, or ``slots`` lists one
    host per slot (LSF: node count = distinct hosts, after leaving out a launch node).
    """

    name: str
    job_id: tuple[str, ...]
    num_nodes: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()


# In this order: a Slurm job id wins (a Slurm allocation inside an LSF job is not a thing).
ALLOCATIONS: tuple[AllocationTable, ...] = (
    # SLURM_JOB_NUM_NODES is the job's even inside a step (SLURM_NNODES is then the step's)
    AllocationTable("slurm", job_id=("SLURM_JOB_ID", "SLURM_JOBID"),
                    num_nodes=("SLURM_JOB_NUM_NODES", "SLURM_NNODES")),
    AllocationTable("lsf", job_id=("LSB_JOBID",), slots=LSF_HOST_VARS),
)


def env_get(env: Mapping[str, str], name: str) -> str | None:
    """A variable's value, None when unset or empty (launchers sometimes export empty values)."""
    value = env.get(name)
    return value if value not in (None, "") else None


def first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """(variable, value) of the first of ``names`` that is set."""
    for n in names:
        v = env_get(env, n)
        if v is not None:
            return n, v
    return None
