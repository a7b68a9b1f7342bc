"""The site-config schema: everything cluster-specific, written once by a cluster's admins.

Unknown keys are errors (a typo must not silently fall back to a default). Cross-field rules that
pydantic cannot express per field (RoCE needs a GID index, the default partition must exist, ...)
live in ``site.py`` so every problem is reported at once, each with its key path.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpcring.config import envvars
from hpcring.config.envvars import DEFAULT_TIMEOUT, MAX_TIMEOUT
from hpcring.config.slurmtime import time_to_minutes  # noqa: F401  (re-exported)

def minutes_to_slurm(mins: int) -> str:
    days, rem = divmod(mins, 1440)
    hours, minutes = divmod(rem, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours:02d}:{minutes:02d}:00"


def minutes_to_lsf(mins: int) -> str:
    hours, minutes = divmod(mins, 60)
    return f"{hours}:{minutes:02d}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Partition(_Strict):
    """A Slurm partition or an LSF queue."""

    max_time: str | None = None
    max_nodes: int | None = Field(default=None, ge=1, le=envvars.MAX_NODES)
    gpus_per_node: int | None = Field(default=None, ge=0, le=envvars.MAX_GPUS_PER_NODE)
    cpus_per_node: int | None = Field(default=None, ge=1)
    qos: str | None = None

    @field_validator("max_time")
    @classmethod
    def _time(cls, v):
        if v is not None:
            time_to_minutes(v)
        return v


class Defaults(_Strict):
    """Job defaults when neither the CLI nor the environment says otherwise."""

    partition: str | None = None
    time: str = "00:30:00"
    nodes: int = Field(default=1, ge=1, le=envvars.MAX_NODES)
    tasks_per_node: int | None = Field(default=None, ge=1, le=envvars.MAX_TASKS_PER_NODE)  # None: one per GPU, else 1
    cpus_per_task: int = Field(default=1, ge=1, le=envvars.MAX_CPUS_PER_TASK)
    exclusive: bool = False

    @field_validator("time")
    @classmethod
    def _time(cls, v):
        time_to_minutes(v)
        return v


class Launcher(_Strict):
    """How ranks are started inside the allocation."""

    kind: Literal["srun", "mpirun", "jsrun", "blaunch", "local"]
    mpi: Literal["pmix", "pmi2", "none"] | None = None  # srun --mpi=...
    args: list[str] = []


class Fabric(_Strict):
    """The network between nodes, from which NCCL/MPI/UCX/Gloo settings are derived.

    Interface entries follow NCCL's syntax: ``ib`` is a prefix, ``=ib0`` an exact name,
    a leading ``^`` on the first entry excludes the listed names instead.
    """

    kind: Literal["infiniband", "roce", "tcp"]
    data_interfaces: list[str] = []
    bootstrap_interfaces: list[str] = []
    hcas: list[str] = []  # "mlx5_0:1" (device:port)
    gid_index: int | None = Field(default=None, ge=0)
    # hpcring ring striping: TCP streams per peer and I/O threads per pass (HPCRING_RING_STREAMS /
    # HPCRING_RING_THREADS; None keeps the measured defaults, see collectives/ring.py)
    ring_streams: int | None = Field(default=None, ge=1, le=16)
    ring_threads: int | None = Field(default=None, ge=1, le=16)
    ring_shm: bool | None = None      # shared memory between a host's ranks (HPCRING_RING_SHM)

    @field_validator("hcas")
    @classmethod
    def _hcas(cls, v):
        for h in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+(:\d+)?", h):
                raise ValueError(f"HCA {h!r} is not of the form device[:port], e.g. mlx5_0:1")
        return v


class LsfOptions(_Strict):
    drop_launch_node: bool = False  # the batch host is not a compute host (CSM/jsrun sites)
    nnodes: bool = False            # request whole nodes with -nnodes (CSM sites)
    gpu_mode: Literal["exclusive_process", "shared"] = "exclusive_process"
    warning_signal: str | None = "USR2"
    warning_time: str | None = "5"   # minutes before the limit (-wt)


class SlurmOptions(_Strict):
    gpu_directive: Literal["gpus-per-node", "gres"] = "gpus-per-node"
    gres_name: str = "gpu"
    signal: str | None = "USR2@90"  # preemption/timeout warning: USR1 is avoided (NCCL may use it)
    requeue: bool = True


class SiteConfig(_Strict):
    """One cluster, as its admins describe it."""

    name: str
    description: str = ""
    scheduler: Literal["slurm", "lsf", "local"]
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    job_dir: str = "~/hpcring-jobs"   # must be on a filesystem every node sees
    gpus_per_node: int = Field(default=0, ge=0, le=envvars.MAX_GPUS_PER_NODE)
    cpus_per_node: int | None = Field(default=None, ge=1)
    partitions: dict[str, Partition] = {}
    defaults: Defaults = Defaults()
    launcher: Launcher
    fabric: Fabric = Fabric(kind="tcp")
    setup: list[str] = []               # shell lines before launch: modules, conda, env
    env: dict[str, str] = {}            # extra env for every rank (wins over derived fabric env)
    python: str | None = None           # interpreter on the compute nodes (default: the submitting one)
    template: str | None = None         # own job-script template, relative to the site file
    timeout: float = Field(default=DEFAULT_TIMEOUT, gt=0, le=MAX_TIMEOUT, allow_inf_nan=False)  # per-collective deadline, s
    slurm: SlurmOptions = SlurmOptions()
    lsf: LsfOptions = LsfOptions()
    sched_args: list[str] = []          # extra scheduler flags for every job

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError(f"site name {v!r} may use letters, digits, '_', '.' and '-' only")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
        return v
