"""The site-config schema: everything cluster-specific, written once by a cluster's admins.

Unknown keys are errors (a typo must not silently fall back to a default). Cross-field rules that
pydantic cannot express per field (RoCE needs a GID index, the default partition must exist, ...)
live in ``site.py`` so every problem is reported at once, each with its key path.
"""
from __future__ import annotations

import re
import signal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from hpcring.config import envvars, remote_checks
from hpcring.config.container import RUNTIMES, image_problem, mount_problem
from hpcring.config.text import shown, text_problem
from hpcring.config.envvars import DEFAULT_TIMEOUT, MAX_TIMEOUT
from hpcring.config.slurmtime import time_to_minutes  # noqa: F401  (re-exported)

def minutes_to_slurm(mins: int) -> str:
    days, rem = divmod(mins, 1440)
    hours, minutes = divmod(rem, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours:02d}:{minutes:02d}:00"


def minutes_to_lsf(mins: int) -> str:
    hours, minutes = divmod(mins, 60)
    return f"{hours}:{minutes:02d}"


MAX_CPUS_PER_NODE = 65_536
MAX_GID_INDEX = 255      # GID tables hold far fewer entries


def _strings(value: Any, sub: tuple = ()):
    """(position below the field, text) of every string in a validated field value, dict keys included;
    sub-models check their own fields."""
    if isinstance(value, str):
        yield sub, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, sub + (i,))
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _strings(k, sub + (k,))
            yield from _strings(item, sub + (k,))


def slurm_signal_spec(spec: str) -> tuple[str, str, int] | None:
    """sbatch's ``--signal=[{R|B}:]<sig_num>[@sig_time]`` as (flags, bare signal name such as
    USR2, seconds: Slurm's default 60 when left out), or None when Slurm would not take it (it
    keeps sig_time in 16 bits)."""
    m = re.fullmatch(r"(?:([RB]{1,2}):)?([A-Za-z0-9]+)(?:@(\d{1,5}))?", spec)
    if not m or (m.group(1) and len(set(m.group(1))) != len(m.group(1))):
        return None
    sig, secs = m.group(2), int(m.group(3)) if m.group(3) else 60
    if sig.isdigit():
        if not 1 <= int(sig) <= 64:
            return None
        try:
            sig = signal.Signals(int(sig)).name
        except ValueError:             # a real-time signal: Slurm takes its number
            return m.group(1) or "", sig, secs
    elif not _signal_name(sig):
        return None
    return (m.group(1) or "", sig.upper().removeprefix("SIG"), secs) if secs <= 65535 else None


def _signal_name(name: str) -> bool:
    """A signal's name as Slurm and LSF take it: USR2 or SIGUSR2."""
    base = name[3:] if name.startswith("SIG") else name
    return base.isalnum() and base.isupper() and hasattr(signal, "SIG" + base) \
        and isinstance(getattr(signal, "SIG" + base), signal.Signals)


class _PathKey:
    """Marks a key that names a file, a folder or a command (``Annotated[str | None, PATH]``): an empty
    or blank value is refused. Left to the code that uses it, ``job_dir: ""`` is the folder hpcring
    happens to start in and ``template: ""`` silently the bundled template."""

    def __repr__(self) -> str:
        return "PATH"


PATH = _PathKey()


class _Strict(BaseModel):
    # strict: a YAML true is no number, 1 no boolean, "4" no count; every field, present and future
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @field_validator("*")
    @classmethod
    def _plain_text(cls, v, info):
        """Every string of every field: one line, printable, bounded (a line break in any value that
        reaches a job script starts a new command; ESC sequences rewrite the user's terminal); a
        path (PATH) not empty."""
        for sub, text in _strings(v):
            why = text_problem(text)
            if why:
                raise PydanticCustomError("site_text", "{why}", {"why": why, "sub": sub})
        if isinstance(v, str) and not v.strip() and PATH in cls.model_fields[info.field_name].metadata:
            raise PydanticCustomError("site_path", "{why}", {"why": "empty, and this key names a path (a file, "
                                      "folder or command): write one, or remove the key for its default"})
        return v


class Partition(_Strict):
    """A Slurm partition or an LSF queue."""

    max_time: str | None = None
    max_nodes: int | None = Field(default=None, ge=1, le=envvars.MAX_NODES)
    gpus_per_node: int | None = Field(default=None, ge=0, le=envvars.MAX_GPUS_PER_NODE)
    cpus_per_node: int | None = Field(default=None, ge=1, le=MAX_CPUS_PER_NODE)
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
    max_restarts: int = Field(default=0, ge=0, le=100)   # submit --wait: restarts after a node fault
    spare_nodes: int = Field(default=0, ge=0, le=envvars.MAX_NODES)   # restarts inside the allocation
    preflight: bool = False            # the gang check before the script (hpcring.preflight)
    preflight_min_gbps: float | None = Field(default=None, gt=0, le=100000, allow_inf_nan=False)  # None: report only
    min_nodes: int | None = Field(default=None, ge=1, le=envvars.MAX_NODES)

    @field_validator("time")
    @classmethod
    def _time(cls, v):
        time_to_minutes(v)
        return v


class BadNodes(_Strict):
    """Bad nodes stay out (hpcring.nodehistory): a node blamed ``blames`` times within ``days`` is left
    out of new jobs; HPCRING_BAD_NODE_BLAMES/_DAYS override, unset keys keep the defaults."""

    blames: int | None = Field(default=None, ge=0, le=1000)      # 0: never left out automatically
    days: float | None = Field(default=None, gt=0, le=envvars.MAX_BAD_NODE_DAYS, allow_inf_nan=False)


class Launcher(_Strict):
    """How ranks are started inside the allocation."""

    kind: Literal["srun", "mpirun", "jsrun", "blaunch", "local"]
    mpi: Literal["pmix", "pmi2", "none"] | None = None  # srun --mpi=...
    args: list[str] = []   # each one word of the launcher line (quoted there)


_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")   # Linux interface names: at most 15 characters


class Fabric(_Strict):
    """The network between nodes, from which NCCL/MPI/UCX/Gloo settings are derived.

    Interface entries follow NCCL's syntax: ``ib`` is a prefix, ``=ib0`` an exact name,
    a leading ``^`` on the first entry excludes the listed names instead.
    """

    kind: Literal["infiniband", "roce", "tcp"]
    data_interfaces: list[str] = []
    bootstrap_interfaces: list[str] = []
    hcas: list[str] = []  # "mlx5_0:1" (device:port)
    gid_index: int | None = Field(default=None, ge=0, le=MAX_GID_INDEX)
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
                raise ValueError(f"HCA {shown(h)} is not of the form device[:port], e.g. mlx5_0:1")
        return v

    @field_validator("data_interfaces", "bootstrap_interfaces")
    @classmethod
    def _interfaces(cls, v):
        # NCCL syntax per entry: a prefix, =exact; ^ (exclude) on the first entry covers the list
        for i, spec in enumerate(v):
            name = spec[1:] if i == 0 and spec.startswith("^") else spec
            name = name[1:] if name.startswith("=") else name
            if not _IFNAME.fullmatch(name):
                raise PydanticCustomError(
                    "site_interface", "{why}",
                    {"why": f"{shown(spec)} is not an interface entry: an interface name (or prefix) of up to 15 "
                            "letters, digits, '_', '.', ':', '@' or '-', written 'ib' (prefix), '=ib0' "
                            "(exact) or, on the first entry only, '^docker' (exclude)", "sub": (i,)})
        return v


class LsfOptions(_Strict):
    drop_launch_node: bool = False  # the batch host is not a compute host (CSM/jsrun sites)
    nnodes: bool = False            # request whole nodes with -nnodes (CSM sites)
    gpu_mode: Literal["exclusive_process", "shared"] = "exclusive_process"
    warning_signal: str | None = "USR2"
    warning_time: str | None = "5"   # minutes before the limit (-wt): [hours:]minutes, quoted

    @field_validator("warning_signal")
    @classmethod
    def _warning_signal(cls, v):
        if v is not None and not _signal_name(v):
            raise ValueError(f"{shown(v)} is not a signal name; LSF's -wa takes one such as USR2 or SIGUSR2")
        return v

    @field_validator("warning_time")
    @classmethod
    def _warning_time(cls, v):
        m = v is not None and re.fullmatch(r"(?:(\d{1,4}):)?(\d{1,5})", v)
        if v is not None and (not m or (m.group(1) and int(m.group(2)) > 59)):
            raise ValueError(f"{shown(v)} is not a warning time; LSF's -wt takes [hours:]minutes, e.g. \"5\" or \"1:30\"")
        return v


class SlurmOptions(_Strict):
    gpu_directive: Literal["gpus-per-node", "gres"] = "gpus-per-node"
    gres_name: str = "gpu"
    signal: str | None = "USR2@90"  # preemption/timeout warning: USR1 is avoided (NCCL may use it)
    requeue: bool = True

    @field_validator("gres_name")
    @classmethod
    def _gres(cls, v):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?", v):
            raise ValueError(f"gres name {shown(v)} is not of the form name[:type], e.g. gpu or gpu:a100")
        return v

    @field_validator("signal")
    @classmethod
    def _signal(cls, v):
        if v is not None and slurm_signal_spec(v) is None:
            raise ValueError(f"{shown(v)} is not a Slurm signal spec; write [R:|B:]SIGNAL[@SECONDS] with a "
                             "signal name or number and 0-65535 seconds, e.g. USR2@90")
        return v


class Container(_Strict):
    """The image every rank starts in (docs/containers.md); ``--container-image`` and
    ``--container-mounts`` override, ``--no-container`` turns it off for one job."""

    runtime: Literal[RUNTIMES]
    image: str | None = None        # None: only with --container-image (else ranks run on the host)
    mounts: list[str] = []          # SRC[:DST[:OPTIONS]], absolute paths; the job folder is added
    workdir: Annotated[str | None, PATH] = None      # the ranks' working directory inside the image
    flags: list[str] = []           # extra runtime options, one word each (quoted on the line)

    @field_validator("image")
    @classmethod
    def _image(cls, v):
        why = v is not None and image_problem(v)
        if why:
            raise ValueError(f"image {why}")
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v):
        for i, m in enumerate(v):
            why = mount_problem(m)
            if why:
                raise PydanticCustomError("site_mount", "{why}", {"why": f"mount {why}", "sub": (i,)})
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v):
        if v is not None and (not v.startswith("/") or any(c.isspace() or c in ",:" for c in v)):
            raise ValueError(f"workdir {shown(v)} is not an absolute path without spaces, ',' or ':'")
        return v

    @field_validator("flags")
    @classmethod
    def _flags(cls, v):
        for i, f in enumerate(v):
            if not f.startswith("-") or any(c.isspace() for c in f):
                raise PydanticCustomError(
                    "site_flag", "{why}",
                    {"why": f"flag {shown(f)} is not one option word starting with '-' (e.g. --writable-tmpfs; "
                            "an option and its value as one word: --env=A=1)", "sub": (i,)})
        return v


class Remote(_Strict):
    """The login node `submit`, `status`, `logs`, `cancel` and `stacks` go through from a laptop
    (docs/remote.md); ``--remote`` and HPCRING_REMOTE name another."""

    host: str
    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    ssh_options: list[str] = []       # Key=Value (or a mapping Key: Value), ssh_config(5) keywords
    workdir: Annotated[str | None, PATH] = None   # where the script's folder is copied (relative: the home folder)
    hpcring: Annotated[str | None, PATH] = None   # the hpcring command there (default: hpcring on its PATH)

    @field_validator("ssh_options", mode="before")
    @classmethod
    def _options_mapping(cls, v):
        if not isinstance(v, dict):
            return v
        out = []
        for k, val in v.items():
            if not isinstance(k, str) or not isinstance(val, (str, int)) or isinstance(val, bool):
                raise PydanticCustomError("site_ssh_option", "{why}", {"why": f"{shown(k)}: {shown(val)} is not "
                                          "an ssh option; write Key: text (e.g. IdentityFile: ~/.ssh/id_ed25519)",
                                          "sub": (k,)})
            why = text_problem(k) or text_problem(str(val))
            try:
                if why:
                    raise ValueError(why)
                out.append("=".join(remote_checks.ssh_option_pair(k, str(val))))
            except ValueError as exc:
                raise PydanticCustomError("site_ssh_option", "{why}", {"why": str(exc), "sub": (k,)}) from None
        return out

    @field_validator("ssh_options")
    @classmethod
    def _options(cls, v):
        out = []
        for i, text in enumerate(v):
            try:
                out.append("=".join(remote_checks.ssh_option(text)) if not text_problem(text) else text)
            except ValueError as exc:
                raise PydanticCustomError("site_ssh_option", "{why}", {"why": str(exc), "sub": (i,)}) from None
        return out

    @field_validator("host", "user", "workdir", "hpcring")
    @classmethod
    def _words(cls, v, info):
        check = {"host": remote_checks.host_problem, "user": remote_checks.user_problem,
                 "workdir": remote_checks.workdir_problem, "hpcring": remote_checks.hpcring_problem}[info.field_name]
        why = v is not None and not text_problem(v) and check(v)
        if why:
            raise ValueError(why)
        return v


class SiteConfig(_Strict):
    """One cluster, as its admins describe it."""

    name: str
    description: str = ""
    scheduler: Literal["slurm", "lsf", "local"]
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    job_dir: Annotated[str, PATH] = "~/hpcring-jobs"   # must be on a filesystem every node sees
    gpus_per_node: int = Field(default=0, ge=0, le=envvars.MAX_GPUS_PER_NODE)
    cpus_per_node: int | None = Field(default=None, ge=1, le=MAX_CPUS_PER_NODE)
    partitions: dict[str, Partition] = {}
    defaults: Defaults = Defaults()
    launcher: Launcher
    fabric: Fabric = Fabric(kind="tcp")
    setup: list[str] = []               # shell lines before launch: modules, conda, env
    env: dict[str, str] = {}            # extra env for every rank (wins over derived fabric env)
    python: Annotated[str | None, PATH] = None     # interpreter path on the compute nodes (default: the submitting one)
    template: Annotated[str | None, PATH] = None   # own job-script template, relative to the site file
    timeout: float = Field(default=DEFAULT_TIMEOUT, gt=0, le=MAX_TIMEOUT, allow_inf_nan=False)  # per-collective deadline, s
    slurm: SlurmOptions = SlurmOptions()
    lsf: LsfOptions = LsfOptions()
    sched_args: list[str] = []          # extra scheduler flags for every job
    container: Container | None = None  # ranks inside an image (docs/containers.md)
    remote: Remote | None = None        # a login node to submit through from a laptop (docs/remote.md)
    bad_nodes: BadNodes = BadNodes()   # nodes blamed again and again are left out (hpcring.nodehistory)

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError(f"site name {shown(v)} may use letters, digits, '_', '.' and '-' only")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{shown(k)} is not a valid environment variable name")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v):
        # one word (quoted in job scripts); refused outright where a shell would act on it, so no
        # script that writes it, a user's own template included, can run something else
        bad = sorted(set(v) & set(" \t$`\"'\\;&|<>()*?[]{}!#"))
        if not v or bad:
            raise ValueError(f"python is the interpreter's path, e.g. /opt/conda/bin/python; "
                             f"{'it is empty' if not v else 'it contains ' + ' '.join(repr(c) for c in bad)} "
                             "(for a wrapper command, point python at a script that runs it)")
        return v
