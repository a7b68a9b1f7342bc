"""The site-config schema: everything cluster-specific, written once by a cluster's admins.

Unknown keys are errors (a typo must not silently fall back to a default). Cross-field rules that
pydantic cannot express per field (RoCE needs a GID index, the default partition must exist, ...)
live in ``site.py`` so every problem is reported at once, each with its key path.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


def time_to_minutes(value: str | int) -> int:
    """Slurm time syntax (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) or minutes -> minutes."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("time must be positive minutes")
        return value
    m = _TIME_RE.match(value.strip())
    if not m:
        raise ValueError(f"not a time: {value!r} (use minutes, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        mins = int(days) * 1440 + int(a) * 60 + int(b or 0) + (1 if c and int(c) else 0)
    elif b is None:  # MM
        mins = int(a)
    elif c is None:  # MM:SS
        mins = int(a) + (1 if int(b) else 0)
    else:  # HH:MM:SS
        mins = int(a) * 60 + int(b) + (1 if int(c) else 0)
    if mins <= 0:
        raise ValueError(f"time {value!r} is zero")
    return mins


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
    max_nodes: int | None = Field(default=None, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=0)
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
    nodes: int = Field(default=1, ge=1)
    tasks_per_node: int | None = Field(default=None, ge=1)  # None: one per GPU, else 1
    cpus_per_task: int = Field(default=1, ge=1)
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
    gpus_per_node: int = Field(default=0, ge=0)
    cpus_per_node: int | None = Field(default=None, ge=1)
    partitions: dict[str, Partition] = {}
    defaults: Defaults = Defaults()
    launcher: Launcher
    fabric: Fabric = Fabric(kind="tcp")
    setup: list[str] = []               # shell lines before launch: modules, conda, env
    env: dict[str, str] = {}            # extra env for every rank (wins over derived fabric env)
    python: str | None = None           # interpreter on the compute nodes (default: the submitting one)
    template: str | None = None         # own job-script template, relative to the site file
    timeout: float = Field(default=300.0, gt=0)  # default per-collective deadline, seconds
    slurm: SlurmOptions = SlurmOptions()
    lsf: LsfOptions = LsfOptions()
    sched_args: list[str] = []          # extra scheduler flags for every job

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k!r} is not a valid environment variable name")
        return v
