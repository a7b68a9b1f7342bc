"""Every ``HPCRING_*`` environment variable: name, type, default, bounds and meaning, in one table.

Code reads a variable through :func:`get` (parsed and checked once per distinct value); a bad value
raises :class:`UsageError` naming the variable, the value, what is allowed and what to do. The
table in ``docs/environment.md`` is generated from :data:`VARS` (``python -m
hpcring.config.envvars``) and a unit test keeps the two in step. Variables that hpcring itself
sets for each rank (``set_by="hpcring"``) are listed so nothing reads an unknown name; users do not
set them.

Import cost matters (the CLI imports this): standard library only.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from hpcring.config.text import MAX_TEXT, check_text, parse_float_text, parse_int_text, shown
from hpcring.errors import UsageError
from hpcring.config.metrics_form import FORMS, parse
from hpcring.config.slurmtime import time_to_minutes

DEFAULT_TIMEOUT = 300.0          # per-collective deadline (s): site config, CLI and ring all use this
MAX_TIMEOUT = 7 * 24 * 3600.0    # a week: longer than any allocation, and finite
DEFAULT_INIT_TIMEOUT = 60.0
# bad nodes stay out (hpcring.nodehistory): blamed this many times within this many days
DEFAULT_BAD_NODE_BLAMES = 2
DEFAULT_BAD_NODE_DAYS = 7.0
MAX_BAD_NODE_DAYS = 3650.0

# Bounds of job sizes, shared by the CLI flags, the environment and the site schema. Generous (the
# largest machines have ~10^4 nodes) but finite, so a typo cannot render a job of 10^23 nodes.
MAX_NODES = 100_000
MAX_TASKS_PER_NODE = 1024
MAX_GPUS_PER_NODE = 64
MAX_CPUS_PER_TASK = 4096
MAX_RANKS = MAX_NODES * 8
# The local backend (no scheduler) starts every rank as a process on this machine.
MAX_LOCAL_RANKS = 256

# Longest text value: PATH_MAX for paths, the same for user-set text (partition, account, site
# dirs...); what hpcring itself exports (HPCRING_SESSION, node lists) is bounded by the kernel.

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Var:
    name: str
    kind: str                  # float, int, bool, choice, str, path, time, metrics
    default: Any
    meaning: str
    lo: float | None = None    # inclusive lower bound (numbers)
    hi: float | None = None    # inclusive upper bound (numbers)
    lo_open: bool = False      # lower bound excluded (timeouts must be > 0)
    choices: tuple[str, ...] = ()
    set_by: str = "user"       # "user" or "hpcring" (exported by job scripts / the local backend)

    @property
    def max_len(self) -> int | None:
        """Longest accepted text (None: only the kernel's own limit on an environment string)."""
        return MAX_TEXT if self.set_by == "user" or self.kind == "path" else None

    def allowed(self) -> str:
        if self.kind == "bool":
            return "one of 1/true/yes/on or 0/false/no/off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind in ("int", "float"):
            what = "a whole number" if self.kind == "int" else "a finite number"
            lo = "" if self.lo is None else (f" > {_num(self.lo)}" if self.lo_open else f" >= {_num(self.lo)}")
            hi = "" if self.hi is None else f" <= {_num(self.hi)}"
            return what + (lo + ("," if lo and hi else "") + hi)
        if self.kind == "time":
            return "a Slurm time limit"
        if self.kind == "metrics":
            return FORMS
        return "text without control characters" + (f", at most {self.max_len} characters" if self.max_len else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _v(*a, **kw) -> Var:
    return Var(*a, **kw)


VARS: tuple[Var, ...] = (
    # -- deadlines and behaviour (set by users) --
    _v("HPCRING_TIMEOUT", "float", DEFAULT_TIMEOUT, "deadline of every collective, seconds "
       "(also a job setting: CLI > this > site config `timeout`)", 0, MAX_TIMEOUT, lo_open=True),
    _v("HPCRING_INIT_TIMEOUT", "float", DEFAULT_INIT_TIMEOUT, "deadline of the bootstrap "
       "(rendezvous, interface checks), seconds", 0, MAX_TIMEOUT, lo_open=True),
    _v("HPCRING_BACKEND", "choice", None, "collective backend for `auto`; unset: NCCL with a GPU, "
       "MPI under an MPI launcher unless the fabric is TCP (HPCRING_FABRIC), else ring",
       choices=("ring", "mpi", "nccl")),
    _v("HPCRING_FABRIC", "choice", None, "the network between nodes (set from the site config's "
       "fabric.kind); on `tcp` the `auto` backend is the ring even under an MPI launcher",
       choices=("infiniband", "roce", "tcp")),
    _v("HPCRING_STORE_PORT", "int", None, "TCP port of the rendezvous store on rank 0's node "
       "(unset: derived from the job id in 29500-29999)", 1, 65535),
    _v("HPCRING_STORE_LINGER", "float", 30.0, "how long rank 0 keeps the store up at exit for "
       "slower ranks, seconds", 0, 3600),
    _v("HPCRING_IFNAME", "str", None, "interfaces hpcring's rendezvous and ring may use (NCCL "
       "syntax: `ib`, `=eth0`, `^docker`); set from the site config's fabric"),
    _v("HPCRING_RENDEZVOUS", "choice", "auto", "how ranks meet at init: `pmix` takes hosts and rank "
       "0's store address from the launcher's PMIx (srun --mpi=pmix, jsrun), `store` finds the store "
       "by its derived port, `auto` uses PMIx when present and working and the job has at least "
       "HPCRING_PMIX_MIN_RANKS ranks, else the store", choices=("auto", "store", "pmix")),
    _v("HPCRING_PMIX_MIN_RANKS", "int", 256, "`HPCRING_RENDEZVOUS=auto`: jobs from this many ranks meet "
       "through PMIx; smaller ones through the store, which was faster up to 48 ranks measured "
       "(docs/bootstrap.md)", 1, 1 << 30),
    _v("HPCRING_PMIX_LIBRARY", "path", None, "the PMIx client library to load (unset: libpmix.so.2 "
       "from the system)"),
    _v("HPCRING_VERIFY", "choice", "ring", "how interfaces are verified at init",
       choices=("ring", "all", "none")),
    _v("HPCRING_MASTER_ADDR", "str", None, "address of rank 0's node (else MASTER_ADDR, else the "
       "first host of the allocation)"),
    _v("HPCRING_SOCKBUF", "int", 0, "SO_SNDBUF/SO_RCVBUF of ring sockets, bytes (0: kernel "
       "autotuning)", 0, 1 << 30),
    _v("HPCRING_RD_THRESHOLD", "int", None, "allreduce messages below this many bytes use recursive "
       "doubling (unset: the measured default)", 0, 1 << 40),
    _v("HPCRING_RING_STREAMS", "int", 1, "TCP streams per ring peer, each carrying a slice of every "
       "chunk (site: fabric.ring_streams)", 1, 16),
    _v("HPCRING_RING_THREADS", "int", 1, "I/O threads per rank driving the ring's streams "
       "(site: fabric.ring_threads)", 1, 16),
    _v("HPCRING_RING_SHM", "bool", True, "shared memory between the ranks of one host instead of "
       "loopback TCP (site: fabric.ring_shm)"),
    _v("HPCRING_RH_CHUNK", "int", None, "allreduce from HPCRING_RD_THRESHOLD up: recursive halving/doubling "
       "while bytes per rank are below this, the ring above (unset: the measured 64 KiB; 0: never)", 0, 1 << 62),
    _v("HPCRING_DIRECT_MAX", "int", None, "allreduce on at most 3 ranks: one round of direct exchange while "
       "each rank sends at most this many bytes ((ranks - 1) x message; unset: the measured 32 KiB; 0: never)",
       0, 1 << 62),
    _v("HPCRING_BCAST_TREE_MAX", "int", None, "ring broadcast: binomial tree up to this many bytes, "
       "pipelined chain above (unset: the measured 256 KiB)", 0, 1 << 62),
    _v("HPCRING_RING_STRIPE_MIN", "int", None, "ring striping: bytes of a chunk per stream before "
       "another stream is used (unset: 1 MiB)", 1, 1 << 40),
    _v("HPCRING_TWOLEVEL_MIN", "int", None, "allreduce/reduce-scatter across hosts with shared memory: "
       "two-level from this many bytes (unset: the measured 8 MiB)", 0, 1 << 62),
    _v("HPCRING_RING_MAX_CONNECTIONS", "int", None, "ring: most TCP connections a rank keeps open to "
       "its peers; those its algorithms always use count first, alltoall opens the others in "
       "windows within the rest (at least 2) and closes them; the same on every rank. Unset: no limit "
       "in jobs of up to 256 ranks (alltoall never reconnects), 48 in larger ones", 2, 1 << 20),
    _v("HPCRING_P2P_UNIX", "bool", True, "point-to-point between ranks of one host over a Unix socket "
       "instead of loopback TCP (0: TCP; ranks in different network namespaces fall back to TCP)"),
    _v("HPCRING_P2P_DIRECT", "bool", True, "point-to-point within a host: the receiver copies a large "
       "message straight out of the sender's memory (process_vm_readv, one copy) where it can, instead "
       "of through the Unix socket (0: always the socket)"),
    _v("HPCRING_P2P_DIRECT_MIN", "int", 8 << 20, "point-to-point within a host: messages of at least "
       "this many bytes go by direct read (HPCRING_P2P_DIRECT); smaller ones through the socket, where "
       "the two ranks' copies overlap (measured on 2 cores: the socket leads at 2 MiB, direct reads "
       "from 8-16 MiB)", 1, 1 << 62),
    _v("HPCRING_RING_CMA", "bool", True, "shared memory: collectives may read the other ranks' buffers "
       "directly (process_vm_readv, one copy) where every rank of the host can"),
    _v("HPCRING_RING_CMA_MIN", "int", None, "shared memory: alltoall reads its peers' blocks directly "
       "from blocks of this many bytes (unset: by the host's rank count as measured, 1 MiB for 2 "
       "ranks, 512 KiB up to 4, 128 KiB above; 0: never)", 0, 1 << 62),
    _v("HPCRING_RING_CMA_GATHER_MIN", "int", None, "shared memory: broadcast reads the root's buffer "
       "directly from this many bytes (unset or 0: never; measured slower than the segment on a 2-core "
       "VM)", 0, 1 << 62),
    _v("HPCRING_RING_CMA_ALLGATHER_MIN", "int", None, "shared memory: allgather reads its peers' "
       "buffers directly from this many bytes per peer (unset: 64 KiB where the host's ranks have a "
       "core each, else never, as measured on a 2-core VM; 0: never)", 0, 1 << 62),
    _v("HPCRING_RING_SHM_PIECE", "int", None, "shared-memory piece per rank and buffer, bytes "
       "(unset: 1 MiB per local rank, 1-8 MiB)", 4096, 1 << 30),
    # -- hpcring.torch (the Horovod API) and torch's own backends --
    _v("HPCRING_FUSION_THRESHOLD", "int", 128 * 1024 * 1024, "hpcring.torch: Tensor Fusion buffer, bytes "
       "(0: no fusion; Horovod's default); queued gradients that fill it start a cycle at once", 0, 1 << 40),
    _v("HPCRING_CYCLE_TIME", "float", None, "hpcring.torch: how long a fusion cycle collects ready "
       "gradients, milliseconds; a cycle also starts as soon as an optimizer's gradients for the step "
       "are all queued or fill the fusion buffer. Unset: a DistributedOptimizer's CPU gradients wait "
       "for exactly that, everything else 1 ms (Horovod's default)", 0, 60_000),
    _v("HPCRING_TIMELINE", "path", None, "hpcring.torch: write this rank's timeline here "
       "(`hpcring timeline JOB` merges all ranks)"),
    _v("HPCRING_AUTOTUNE", "bool", False, "hpcring.torch: tune the fusion threshold and cycle time "
       "during the first steps"),
    _v("HPCRING_AUTOTUNE_LOG", "path", None, "hpcring.torch: CSV of every autotuning sample"),
    _v("HPCRING_AUTOTUNE_WARMUP_STEPS", "int", 3, "hpcring.torch: steps before autotuning measures", 0, 10_000),
    _v("HPCRING_AUTOTUNE_STEPS_PER_SAMPLE", "int", 5, "hpcring.torch: steps timed per autotuning "
       "sample", 1, 10_000),
    _v("HPCRING_CACHE_CAPACITY", "int", 1024, "hpcring.torch: response cache slots per process set "
       "(0: off; every cycle negotiates in full); Horovod's HOROVOD_CACHE_CAPACITY", 0, 1 << 20),
    _v("HPCRING_CHECK_COLLECTIVES", "bool", False, "check before each collective that every rank "
       "calls the same op, dtype, count and root (costs a small allreduce)"),
    _v("HPCRING_MPI_ABORT_ON_TIMEOUT", "bool", True, "MPI backend: abort the job when a collective "
       "misses its deadline (MPI cannot cancel one)"),
    _v("HPCRING_MPI_CHECK_SIGNATURES", "bool", True, "MPI backend: agree on every collective's op, "
       "count, dtype and root (one small allreduce) before handing it to MPI, so a mismatch is named "
       "instead of corrupting MPI's memory"),
    _v("HPCRING_WATCHDOG", "bool", True, "start the hang watchdog (flight records, stacks, report)"),
    _v("HPCRING_TORCH_WATCH", "bool", True, "give torch's own process groups (gloo, NCCL) hpcring's "
       "deadline and hang report (hpcring.diagnostics.torch_watch)"),
    _v("HPCRING_HANDSHAKE_TIMEOUT", "float", 10.0, "how long a peer may take to authenticate a new "
       "connection (rendezvous store, ring links, point-to-point) before it is dropped, seconds; the "
       "watchdog's tree waits a fifth of it (at least 2 s) for a child before taking it for stopped; "
       "raise it only where ranks are starved of CPU (many ranks per core, as in benchmarks/scale_sim.py)",
       0.1, 600),
    _v("HPCRING_DIAG_GRACE", "float", 5.0, "how long the watchdog waits for every rank's snapshot "
       "before reporting, seconds", 0.5, 3600),
    _v("HPCRING_ON_FAILURE", "choice", "abort", "after a diagnosed collective failure: `abort` ends "
       "the process, `raise` raises CollectiveError", choices=("abort", "raise")),
    _v("HPCRING_STRAGGLERS", "bool", True, "name a rank or node that arrives last in most collectives "
       "(one line on rank 0's stderr when the verdict changes; hpcring.diagnostics.stragglers)"),
    _v("HPCRING_STRAGGLER_WINDOW", "int", 50, "collectives per straggler window (every rank's time "
       "inside each is compared; below 14 nobody can be named: chance reaches 2^-13)", 16, 2000),
    _v("HPCRING_STRAGGLER_SHARE", "float", 0.75, "share of a window's collectives a rank (or node) "
       "must arrive last in to be named", 0.5, 1.0),
    _v("HPCRING_STRAGGLER_LINK_SHARE", "float", 0.2, "share of the time a rank's ring sends to one peer "
       "must wait (and 3x the median rank's) for the link between them to be named", 0.01, 1.0),
    _v("HPCRING_STRAGGLER_MIN_MS", "float", 2.0, "median lateness, ms, below which nobody is named", 0, 1e6),
    _v("HPCRING_STRAGGLER_MIN_FRAC", "float", 0.05, "median lateness, as a share of the time from one "
       "collective to the next, below which nobody is named", 0, 10),
    _v("HPCRING_STRAGGLER_PERIOD", "float", 0.0, "seconds between the straggler watcher's looks at the "
       "store (0: 0.25 s, or size/1000 s in larger jobs)", 0, 3600),
    _v("HPCRING_METRICS", "metrics", "off", "Prometheus figures of each rank (needs `pip install 'hpcring[metrics]'`): "
       "`off`, `http:HOST:PORT` (each rank serves /metrics on PORT + its local rank, bound to HOST) or "
       "`textfile:DIR` (each rank rewrites `DIR/hpcring_rank<r>.prom` for node-exporter's textfile collector); "
       "a site sets it in its `env:` (hpcring.diagnostics.metrics)"),
    _v("HPCRING_FLIGHT_RECORDS", "int", 2048, "collectives kept in each rank's flight recorder",
       16, 1 << 24),
    _v("HPCRING_FR_TRACE", "bool", True, "wherever flight records are dumped, also write them in torch's "
       "Flight Recorder format (`<job folder>/diag/fr-trace/fr_trace_rank_<r>`, read by `torchfrtrace`; "
       "hpcring.diagnostics.fr_trace)"),
    _v("HPCRING_LOCAL_AFTER_TIMEOUT_S", "float", 86400.0, "local backend: how long a job submitted with "
       "--dependency/--after waits for the jobs it depends on, seconds (then it fails)", 0, 10 * 365 * 86400,
       lo_open=True),
    _v("HPCRING_LOCAL_GRACE_S", "float", 10.0, "local backend and `hpcring run`: once a rank failed, "
       "seconds before the others are stopped (at most 5 s from a hang report's appearance)", 0, 3600),
    _v("HPCRING_END_JOB", "bool", True, "after a diagnosed collective failure the reporting rank asks "
       "the scheduler to end the job (scancel of the step, bkill)"),
    _v("HPCRING_ELASTIC_TIMEOUT", "float", 600.0, "elastic training (hpcring.elastic.driver, hvd.elastic): "
       "seconds a round may wait for --min-np workers (Horovod's HOROVOD_ELASTIC_TIMEOUT; the first round: "
       "counted from the first worker that asks)", 0, MAX_TIMEOUT, lo_open=True),
    _v("HPCRING_ELASTIC_DEAD_AFTER", "float", 6.0, "elastic training: seconds without a heartbeat before the "
       "coordinator counts a worker dead (the driver's own children: at once when they exit)", 0, 3600,
       lo_open=True),
    _v("HPCRING_ELASTIC_ADDR", "str", None, "elastic training: the address this worker's peers reach it at "
       "(default: the one its connection to the elastic driver leaves from)"),
    # -- paths and secrets (set by users or by job scripts) --
    _v("HPCRING_SITE", "str", "local", "site config name or path when --site is absent"),
    _v("HPCRING_SITE_DIRS", "str", None, "extra folders of site configs, colon-separated"),
    _v("HPCRING_STATE_DIR", "path", None, "where job records are kept (default "
       "~/.local/state/hpcring)"),
    _v("HPCRING_JOB_DIR", "path", None, "root of job folders (also a job setting, `job_dir`); each "
       "job's diagnostics land in `<root>/<job id>/diag`"),
    _v("HPCRING_SECRET_FILE", "path", None, "file holding the per-job secret (mode 0600); set by "
       "job scripts"),
    _v("HPCRING_SECRET", "str", None, "the per-job secret itself (prefer HPCRING_SECRET_FILE)"),
    # -- job settings (CLI flag > these > site config > default) --
    _v("HPCRING_NODES", "int", 1, "nodes of a submitted job (--nodes)", 1, MAX_NODES),
    _v("HPCRING_TASKS_PER_NODE", "int", None, "ranks per node (--tasks-per-node; default one per "
       "GPU, else 1)", 1, MAX_TASKS_PER_NODE),
    _v("HPCRING_GPUS_PER_NODE", "int", 0, "GPUs per node (--gpus-per-node); job scripts export it "
       "for the ranks", 0, MAX_GPUS_PER_NODE),
    _v("HPCRING_CPUS_PER_TASK", "int", 1, "CPUs per rank (--cpus-per-task)", 1, MAX_CPUS_PER_TASK),
    _v("HPCRING_TIME", "time", "00:30:00", "time limit (--time), Slurm syntax"),
    _v("HPCRING_PARTITION", "str", None, "partition or queue (--partition)"),
    _v("HPCRING_ACCOUNT", "str", None, "account or project (--account)"),
    _v("HPCRING_QOS", "str", None, "quality of service (--qos)"),
    _v("HPCRING_CONSTRAINT", "str", None, "node features (--constraint)"),
    _v("HPCRING_JOB_NAME", "str", None, "job name (--name; default the script's name)"),
    _v("HPCRING_CONTAINER_IMAGE", "str", None, "image every rank runs in, with the site's container "
       "runtime (--container-image; docs/containers.md)"),
    _v("HPCRING_CONTAINER_MOUNTS", "str", None, "SRC[:DST[:OPTS]],... bound into the container besides "
       "the site's mounts (--container-mounts)"),
    _v("HPCRING_NO_CONTAINER", "bool", False, "run the ranks on the host even if the site names an "
       "image (--no-container)"),
    _v("HPCRING_MAX_RESTARTS", "int", 0, "`submit --wait`: restarts after a node-level fault, each "
       "excluding the nodes blamed so far (--max-restarts; site: defaults.max_restarts)", 0, 100),
    _v("HPCRING_SPARE_NODES", "int", 0, "nodes held beside --nodes for restarts inside the allocation (--spare-nodes; "
       "needs --max-restarts; site: defaults.spare_nodes)", 0, MAX_NODES),
    _v("HPCRING_MIN_NODES", "int", None, "with no spare left, a restart inside the allocation goes on with as few "
       "nodes as this (--min-nodes; the world size shrinks; site: defaults.min_nodes)", 1, MAX_NODES),
    _v("HPCRING_PREFLIGHT", "bool", False, "run the preflight gang check on every node before the script "
       "(--preflight; site: defaults.preflight)"),
    _v("HPCRING_PREFLIGHT_MIN_GBPS", "float", 0.0, "preflight: a ring link below this many Gbit/s leaves its node out "
       "(0: measured and reported only; site: defaults.preflight_min_gbps)", 0, 100000),
    _v("HPCRING_PREFLIGHT_IFNAME_FOR", "str", None, "preflight: HOST=SPEC[;HOST=SPEC...], the interface spec of "
       "single nodes whose configuration differs from the site's (and the dev cluster's fault injection)"),
    _v("HPCRING_STEP_GRACE", "float", 1.0, "restarts inside the allocation: seconds between a task's failure and "
       "SIGKILL to the rest of its step (the survivors' report is written meanwhile)", 0, 60),
    _v("HPCRING_BAD_NODE_BLAMES", "int", DEFAULT_BAD_NODE_BLAMES, "a node blamed this many times (one blame per "
       "failed job, from its hang report) within HPCRING_BAD_NODE_DAYS is left out of new jobs (`--exclude`; "
       "0: never; `submit --no-node-history`: not this job; site: bad_nodes.blames; `hpcring nodes`)", 0, 1000),
    _v("HPCRING_BAD_NODE_DAYS", "float", DEFAULT_BAD_NODE_DAYS, "the window of HPCRING_BAD_NODE_BLAMES, days "
       "(site: bad_nodes.days)", 0, MAX_BAD_NODE_DAYS, lo_open=True),
    _v("HPCRING_REMOTE", "str", None, "login node to run submit/status/logs/cancel/stacks on over ssh: "
       "[user@]host[:port], or `none` (--remote; site: remote.host; docs/remote.md)"),
    _v("HPCRING_REMOTE_HPCRING", "str", None, "the hpcring command on the login node (site: "
       "remote.hpcring; default `hpcring` on its PATH)"),
    # -- set by hpcring for each rank (users do not set these) --
    _v("HPCRING_LAUNCHER", "str", None, "`local` for ranks of the local backend", set_by="hpcring"),
    _v("HPCRING_RANK", "int", None, "local backend: this rank", 0, MAX_RANKS, set_by="hpcring"),
    _v("HPCRING_SIZE", "int", None, "local backend: number of ranks", 1, MAX_RANKS, set_by="hpcring"),
    _v("HPCRING_LOCAL_RANK", "int", None, "local backend: rank on this node", 0, MAX_RANKS,
       set_by="hpcring"),
    _v("HPCRING_LOCAL_SIZE", "int", None, "local backend: ranks on this node", 1, MAX_RANKS,
       set_by="hpcring"),
    _v("HPCRING_NODE_RANK", "int", None, "local backend: this node's index", 0, MAX_NODES,
       set_by="hpcring"),
    _v("HPCRING_NUM_NODES", "int", None, "local backend: number of nodes", 1, MAX_NODES,
       set_by="hpcring"),
    _v("HPCRING_NODELIST", "str", None, "local backend: the virtual node list", set_by="hpcring"),
    _v("HPCRING_HOSTNAME", "str", None, "local backend: this rank's virtual host", set_by="hpcring"),
    _v("HPCRING_JOB_ID", "str", None, "local backend: the job id", set_by="hpcring"),
    _v("HPCRING_ARRAY_TASK", "int", None, "an array job's task index on every rank (0-based on every "
       "scheduler; `submit --array/--sweep`)", 0, 999_999, set_by="hpcring"),
    _v("HPCRING_LOCAL_JOB_ID", "str", None, "local backend supervisor: the job id", set_by="hpcring"),
    _v("HPCRING_TIME_LIMIT_S", "float", 0.0, "local backend supervisor: time limit, seconds (0: none)",
       0, 10 * 365 * 86400, set_by="hpcring"),
    _v("HPCRING_ELASTIC_STORE", "str", None, "elastic training: host:port of the elastic driver's store "
       "(its workers ask to join there)", set_by="hpcring"),
    _v("HPCRING_ELASTIC_ID", "str", None, "elastic training: this worker's name (w0, w1, ...)", set_by="hpcring"),
    _v("HPCRING_SESSION", "str", None, "`hpcring run`: the rank's session, handed to CMD",
       set_by="hpcring"),
    _v("HPCRING_RANK_ERROR_FILE", "path", None, "`hpcring run`: where CMD's Python writes the exception "
       "that ended it, for the rank's status record", set_by="hpcring"),
    _v("HPCRING_BENCH_TABLE", "path", None, "`hpcring bench`: where rank 0 writes its table",
       set_by="hpcring"),
    _v("HPCRING_DEVCLUSTER_SLURM", "str", None, "the dev cluster's Slurm release that `hpcring devcluster` "
       "commands and the dev-cluster tests mean (22.05 or 24.11; unset: 22.05); `devcluster login` sets it"),
    _v("HPCRING_DEVCLUSTER_WORLD", "str", None, "inside a dev cluster release's own namespaces: that "
       "release (how a test knows where it runs)", set_by="hpcring"),
    _v("HPCRING_LOG_PATTERN", "str", None, "LSF: per-rank log path pattern", set_by="hpcring"),
    _v("HPCRING_LSF_DROP_LAUNCH_NODE", "bool", False, "LSF: the site's `lsf.drop_launch_node`; the "
       "ranks leave the first host (the launch node) out of LSF's slot list", set_by="hpcring"),
    _v("HPCRING_LSF_HOSTFILE", "path", None, "LSF, `hpcring run`: the host file blaunch/mpirun started "
       "the ranks from (read before LSF's own slot lists)", set_by="hpcring"),
    _v("HPCRING_LSF_STEP", "int", None, "LSF, a step of the job script's step loop (`submit --spare-nodes`): "
       "its number; the store port folds it in, and the loop finds the step's tasks by it to end them",
       0, 1 << 20, set_by="hpcring"),
    _v("HPCRING_RESTART_COUNT", "int", 0, "submitted jobs: which restart after a node-level fault this "
       "attempt is (0: the first run; counted by hpcring.requeue_count())", 0, 100, set_by="hpcring"),
    _v("HPCRING_REQUEUE_COUNT", "int", 0, "submitted jobs: how many times hpcring requeued this job "
       "(hpcring.requeue_count())", 0, 1 << 20, set_by="hpcring"),
)

REGISTRY: dict[str, Var] = {v.name: v for v in VARS}


def spec(name: str) -> Var:
    try:
        return REGISTRY[name]
    except KeyError:   # a programming error: every variable hpcring reads is registered
        raise KeyError(f"{name} is not in hpcring.config.envvars.VARS") from None


def get(name: str, environ: Mapping[str, str] | None = None, default: Any = ...) -> Any:
    """The parsed value of ``name`` (unset or empty: the registry's default, or ``default``).

    Raises UsageError naming the variable and value, what is allowed, and what to do.
    """
    var = spec(name)
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or not raw.strip():
        return var.default if default is ... else default
    return _parse(name, raw)


@functools.lru_cache(maxsize=256)
def _parse(name: str, raw: str) -> Any:
    var = REGISTRY[name]
    text = raw.strip()
    try:
        return _convert(var, text)
    except ValueError as exc:
        why = str(exc)
        raise UsageError(f"environment variable {name}={shown(raw)}: {why}; expected {var.allowed()} "
                         f"({var.meaning})",
                         hint=f"fix or unset {name} (`unset {name}` uses the default"
                              + (f" {var.default!r})" if var.default is not None else ")")) from None


def _convert(var: Var, text: str) -> Any:
    if var.kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("not a yes/no value")
    if var.kind == "choice":
        if text.lower() not in var.choices:
            raise ValueError("not a known value")
        return text.lower()
    if var.kind == "int":
        value = parse_int_text(text)
        _check_bounds(var, value)
        return value
    if var.kind == "float":
        value = parse_float_text(text)
        _check_bounds(var, value)
        return value
    check_text(text, var.max_len)
    if var.kind == "metrics":
        parse(text)
    if var.kind == "time":
        time_to_minutes(text)
    return text


def _check_bounds(var: Var, value: float) -> None:
    if var.lo is not None and (value < var.lo or (var.lo_open and value <= var.lo)):
        raise ValueError("out of range")
    if var.hi is not None and value > var.hi:
        raise ValueError("out of range")


def check_environ(environ: Mapping[str, str] | None = None) -> None:
    """Parse every registered variable that is set; one UsageError listing each bad one.

    Entry points (the CLI, each rank's entry) call this first, so a bad value stops the job with
    one clear message before any rank or user code runs, not as a traceback from deep inside.
    """
    env = os.environ if environ is None else environ
    problems = []
    for v in VARS:
        if not (env.get(v.name) or "").strip():
            continue
        try:
            _parse(v.name, env[v.name])
        except UsageError as exc:
            problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise UsageError("bad environment variables:\n" + "\n".join(f"  - {p.message}" for p in problems),
                         hint="fix or unset each (see docs/environment.md)")


_OWN_REASONS = ("not a number", "not a whole number", "not finite", "out of range", "too long")


def check_number(what: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, integer: bool = False, hint: str | None = None) -> Any:
    """Validate a number from any edge (a flag, an argument, a site key): finite and in bounds.

    ``what`` names it, e.g. ``"--nodes"`` or ``"Communicator(timeout=)"``. Returns the value
    (an int when ``integer``); raises UsageError otherwise.
    """
    var = Var(what, "int" if integer else "float", None, "", lo, hi, lo_open)
    try:
        if isinstance(value, bool):
            raise ValueError("not a number")
        if isinstance(value, str):     # text from a file or a flag: the same rules as the environment
            number = parse_int_text(value.strip()) if integer else parse_float_text(value.strip())
        else:
            number = int(value) if integer else float(value)
        if integer and number != value and not isinstance(value, str):
            raise ValueError("not a whole number")
        if not integer and not math.isfinite(number):
            raise ValueError("not finite")
        _check_bounds(var, number)
    except (TypeError, ValueError, OverflowError) as exc:
        # our own reasons pass through; Python's ("invalid literal for int()...") do not
        why = str(exc) if isinstance(exc, ValueError) and str(exc).startswith(_OWN_REASONS) else "not a number"
        raise UsageError(f"{what} must be {var.allowed()}, got {shown(value)} ({why})",
                         hint=hint or f"pass {what} within those bounds") from None
    return number


def collective_timeout(timeout: Any = None, what: str = "Communicator timeout") -> float:
    """A collective deadline: ``timeout`` checked (finite, > 0, at most a week), or HPCRING_TIMEOUT."""
    if timeout is None:
        return get("HPCRING_TIMEOUT")
    return check_number(what, timeout, lo=0, lo_open=True, hi=MAX_TIMEOUT)


def markdown_table() -> str:
    """The docs table (docs/environment.md embeds it between markers)."""
    rows = ["| Variable | Type | Default | Allowed | Meaning |", "|---|---|---|---|---|"]
    for set_by in ("user", "hpcring"):
        for v in VARS:
            if v.set_by != set_by:
                continue
            default = "—" if v.default is None else f"`{v.default:g}`" if isinstance(v.default, float) \
                else f"`{v.default}`"
            allowed = v.allowed() if v.kind in ("int", "float", "bool", "choice") else v.kind
            meaning = v.meaning + (" *(set by hpcring)*" if set_by == "hpcring" else "")
            rows.append(f"| `{v.name}` | {v.kind} | {default} | {allowed} | {meaning} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- envvars:begin (generated: python -m hpcring.config.envvars) -->", "<!-- envvars:end -->"


def render_doc(text: str) -> str:
    """``text`` with the table between the markers replaced by the current one."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + BEGIN + "\n" + markdown_table() + END + tail


if __name__ == "__main__":   # regenerate docs/environment.md's table in place
    import sys
    from pathlib import Path
    doc = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/environment.md")
    doc.write_text(render_doc(doc.read_text()))
    print(f"wrote {doc}")
