"""Launcher detection: the process environment -> :class:`~hpcring.bootstrap.topology.Topology`.

Contract
--------
``detect(environ=None, *, hostname=None, lsf_drop_launch_node=None) -> Topology``
    Pure apart from reading the LSF host files named by ``HPCRING_LSF_HOSTFILE`` /
    ``LSB_DJOB_RANKFILE`` / ``LSB_DJOB_HOSTFILE`` and, only when ``hostname`` is None and a launcher does not name this
    host, calling ``socket.gethostname()``. Raises :class:`hpcring.errors.BootstrapError` naming
    the variables and values when the chosen launcher's variables are partial or contradict each
    other (rank >= size, local rank >= local size, a nodelist shorter than the node count, ...).
``allocation(environ=None, *, lsf_drop_launch_node=None) -> Allocation | None``
    The Slurm or LSF allocation this process runs in (salloc, bsub -Is, a batch script) and its
    node count, from :data:`ALLOCATIONS`; None outside any. Same purity and errors.

Each launcher is a DATA TABLE (:data:`TABLES`, in launcher_tables.py): which variables give which Topology field; the
first variable of a field's tuple that is set wins. ``Topology.sources`` records, per field, the
variable (or derivation) it came from, plus ``launcher`` (why that table was chosen) and
``hosts_known``.

Detection order (innermost launcher first, because an inner launcher's variables are the truth for
the process and an outer launcher's variables are inherited noise: ``mpirun`` in an ``sbatch``
script sees SLURM_PROCID=0 of the batch step on every rank it starts on the first node):

1. ``local``    HPCRING_LAUNCHER=local (hpcring's local backend; exclusive, nothing else is read)
2. ``torchrun`` RANK and WORLD_SIZE (torchrun, or anything torchrun-style)
3. ``openmpi``  OMPI_COMM_WORLD_RANK
4. ``mvapich``  MV2_COMM_WORLD_RANK
5. ``pmi``      PMI_RANK (MPICH/Hydra, Intel MPI, ``srun --mpi=pmi2``)
6. ``pmix``     PMIX_RANK (size only from an enclosing launcher)
7. ``jsrun``    JSM_NAMESPACE_RANK
   ``blaunch``  LSF_PM_TASKID and LSB_JOBID (a task LSF's blaunch started: LSF_PM_TASKID is the
                1-based task id LSF's RES sets, rank = LSF_PM_TASKID - 1; size, hosts and local
                ranks come from the LSF slot list, one task per slot as ``blaunch -u hostfile``)
8. ``slurm``    SLURM_STEP_ID and SLURM_PROCID (a task of an ``srun`` step; the batch step sets
                SLURM_PROCID but no SLURM_STEP_ID, and a batch script is one process)
9. ``single``   none of the above: rank 0 of 1 (job id from SLURM_JOB_ID or LSB_JOBID if set)

Corroboration: after the first table matches, the outer launchers ``jsrun`` and ``slurm`` (those
after it in the order) are read too; if one agrees on every rank field both know (rank, size,
local rank, local size), the processes were started by it directly (``srun --mpi=pmix`` starting
Open MPI ranks sets SLURM_*, PMIX_* and OMPI_*), so its fields fill the gaps (hosts, size for
PMIx) and ``Topology.launcher`` names it. An outer launcher that disagrees or is inconsistent is
ignored (noted in sources). Other inner tables that are set must agree on the rank, else
BootstrapError. If hosts are still unknown inside an LSF job, the LSF slot list
(HPCRING_LSF_HOSTFILE, LSB_DJOB_RANKFILE, LSB_DJOB_HOSTFILE, LSB_MCPU_HOSTS, LSB_HOSTS, first one
set; read by lsf_slots.py) gives them when
it has exactly ``size`` slots and is consistent with this rank's local rank, local size and host;
then the launcher is ``lsf`` (never for jsrun, which places ranks by resource set, not by
slot). ``lsf_drop_launch_node`` drops the leading entries of the first host
(Summit-like sites list the launch node first); None (the default) reads it from
HPCRING_LSF_DROP_LAUNCH_NODE, which job scripts and ``hpcring run`` export for a site with
``lsf.drop_launch_node``.

Unknown values (documented convention, the rendezvous fills them in with :func:`complete`):
an int field a launcher does not give is :data:`UNKNOWN` (-1); a host of another rank that is not
known is :data:`UNKNOWN_HOST` (``"?"``); ``sources["hosts_known"]`` is ``"true"`` or ``"false"``
and :func:`hosts_known` tells the same. Open MPI's OMPI_COMM_WORLD_NODE_RANK is deliberately not
used: it is the process's rank among all processes on its node, not the node's index.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from hpcring.bootstrap import hostlist, lsf_slots
from hpcring.bootstrap.launcher_tables import (
    ALLOCATIONS, DETECTION_ORDER, INNER_MPI, JOB_ID_FALLBACK, OUTER, RANK_SLOT_VARS, SLURM_MAX_TASK_STEP,
    TABLES, UNKNOWN, UNKNOWN_HOST, LauncherTable, env_get, first,
)
from hpcring.bootstrap.slurm_layout import block, cyclic, parse_tasks_per_node
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError, HostlistError

__all__ = ["detect", "allocation", "Allocation", "complete", "hosts_known", "explain", "LauncherTable",
           "TABLES", "DETECTION_ORDER", "UNKNOWN", "UNKNOWN_HOST", "parse_tasks_per_node"]

_INT_FIELDS = ("rank", "size", "local_rank", "local_size", "node_rank", "num_nodes")
_RANK_FIELDS = ("rank", "size", "local_rank", "local_size")


class _Reading:
    """Fields read from one table so far, with the variable each came from."""

    def __init__(self, launcher: str) -> None:
        self.launcher = launcher
        self.values: dict[str, object] = {}
        self.sources: dict[str, str] = {}

    def set(self, name: str, value: object, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def get(self, name: str, default: object = None) -> object:
        return self.values.get(name, default)

    def known(self, name: str) -> bool:
        return self.values.get(name, UNKNOWN) not in (UNKNOWN, None)


# ------------------------------------------------------------------------------------ public API

def detect(environ: Mapping[str, str] | None = None, *, hostname: str | None = None,
           lsf_drop_launch_node: bool | None = None) -> Topology:
    """Who am I and who else is there, from the launcher's environment variables.

    Pre: ``environ`` maps names to strings (default ``os.environ``); ``hostname`` is this
    machine's name (default ``socket.gethostname()``, only consulted when needed).
    Post: a Topology with ``0 <= rank < size``, ``len(hosts) == size``, ``hosts[rank]`` this host,
    ``sources`` naming the variable behind each field; unknown ints are UNKNOWN, unknown hosts
    UNKNOWN_HOST (see module docstring).
    Raises: BootstrapError for partial or contradictory variables.
    """
    env = os.environ if environ is None else environ
    lsf_drop_launch_node = lsf_slots.drop_launch_node(env, lsf_drop_launch_node)
    name = next((n for n in DETECTION_ORDER if _matches(TABLES[n], env)), None)
    if name is None:
        return _single(env, hostname)
    reading = _read(TABLES[name], env)
    reading.sources["launcher"] = _marker_text(TABLES[name], env)
    if name != "local":
        _check_inner_agree(reading, env)
        _corroborate(reading, env)
        if reading.launcher == "blaunch":
            _blaunch_size(reading, env, lsf_drop_launch_node)
        # jsrun places ranks by resource set, not in LSF slot order: never map its ranks to slots.
        if not reading.known("hosts") and reading.launcher != "jsrun" and env_get(env, "LSB_JOBID"):
            _lsf_hosts(reading, env, hostname, lsf_drop_launch_node)
    if reading.launcher == "blaunch" and reading.known("hosts"):
        _local_from_hosts(reading)
    return _build(reading, env, hostname)


@dataclass(frozen=True)
class Allocation:
    """The allocation a process runs in (see :data:`ALLOCATIONS`)."""

    scheduler: str                # "slurm" or "lsf"
    job_id: str
    num_nodes: int | None         # None when the allocation does not say
    source: str                   # the variable the node count came from
    slots: tuple[str, ...] = ()   # LSF: one host per slot, a launch node left out


def allocation(environ: Mapping[str, str] | None = None, *,
               lsf_drop_launch_node: bool | None = None) -> Allocation | None:
    """The Slurm or LSF allocation of this process and its node count; None outside any."""
    env = os.environ if environ is None else environ
    for t in ALLOCATIONS:
        job = first(env, t.job_id)
        if job is None:
            continue
        found = first(env, t.num_nodes)
        if found:
            return Allocation(t.name, job[1], _parse_int(*found, t.name), found[0])
        got = lsf_slots.read(env, lsf_slots.drop_launch_node(env, lsf_drop_launch_node), t.slots) \
            if t.slots else None
        if got:
            return Allocation(t.name, job[1], len(set(got[0])), got[1], tuple(got[0]))
        return Allocation(t.name, job[1], None, "unknown")
    return None


def hosts_known(topo: Topology) -> bool:
    """True when every rank's host is known (no UNKNOWN_HOST placeholder)."""
    return UNKNOWN_HOST not in topo.hosts


def complete(topo: Topology, hosts: list[str] | tuple[str, ...], *, source: str = "rendezvous") -> Topology:
    """``topo`` with all hosts filled in (e.g. gathered by the rendezvous) and node fields derived.

    Pre: ``len(hosts) == topo.size``, no UNKNOWN_HOST in ``hosts``. Post: node_rank/num_nodes
    follow from hosts (node order = first appearance); local_rank/local_size too when unknown.
    """
    hosts = tuple(hosts)
    if len(hosts) != topo.size or UNKNOWN_HOST in hosts:
        raise BootstrapError(f"complete(): need {topo.size} known hosts, got {list(hosts)[:8]}...")
    nodes = list(dict.fromkeys(hosts))
    mine = [r for r, h in enumerate(hosts) if h == hosts[topo.rank]]
    sources = dict(topo.sources, hosts=source, node_rank=source, num_nodes=source,
                   hosts_known="true")
    changes = dict(hosts=hosts, node_rank=nodes.index(hosts[topo.rank]), num_nodes=len(nodes))
    if topo.local_rank == UNKNOWN or topo.local_size == UNKNOWN:
        changes.update(local_rank=mine.index(topo.rank), local_size=len(mine))
        sources.update(local_rank=source, local_size=source)
    return topo.with_(sources=sources, **changes)


def explain(topo: Topology) -> str:
    """Multi-line ``field = value  <- source`` report (for ``--verbose``)."""
    lines = [f"launcher    = {topo.launcher}  <- {topo.sources.get('launcher', '-')}"]
    for f in (*_INT_FIELDS, "job_id", "master_addr", "master_port"):
        lines.append(f"{f:<11} = {getattr(topo, f)}  <- {topo.sources.get(f, '-')}")
    shown = hostlist.compress(topo.hosts) if hosts_known(topo) else ",".join(topo.hosts[:16])
    lines.append(f"hosts       = {shown}  <- {topo.sources.get('hosts', '-')}")
    lines.append(f"hosts_known = {topo.sources.get('hosts_known', '-')}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- reading

def _matches(table: LauncherTable, env: Mapping[str, str]) -> bool:
    """Whether the table's marker variables are set (and, for ``local``, have the pinned value)."""
    if not all(env_get(env, v) is not None for v in table.marker):
        return False
    if table.marker_value is not None and env[table.marker[0]] != table.marker_value:
        return False
    if table.step_id:
        return _is_task_step(env[table.step_id[0]])
    return True


def _is_task_step(step_id: str) -> bool:
    """SLURM_STEP_ID of a real srun step (not batch/extern/interactive pseudo-steps)."""
    return step_id.isdigit() and int(step_id) < SLURM_MAX_TASK_STEP


def _marker_text(table: LauncherTable, env: Mapping[str, str]) -> str:
    return " ".join(f"{v}={env[v]}" for v in table.marker)


def _parse_int(var: str, value: str, table: str) -> int:
    """Non-negative int from a variable, or BootstrapError naming it."""
    text = value.strip()
    if not text.isdigit():
        raise BootstrapError(f"{table}: {var}={value!r} is not a non-negative integer",
                             hint="the launcher environment is damaged or was set by hand")
    return int(text)


def _read(table: LauncherTable, env: Mapping[str, str]) -> _Reading:
    """Read and check one table. Raises BootstrapError for partial/contradictory variables."""
    r = _Reading(table.name)
    for f in (*_INT_FIELDS, "master_port"):
        found = first(env, getattr(table, f))
        if found:
            r.set(f, _parse_int(*found, table.name), found[0])
    if table.rank_base and r.known("rank"):
        if r.get("rank") < table.rank_base:
            raise BootstrapError(f"{table.name}: {r.sources['rank']}={r.get('rank')} but it counts from "
                                 f"{table.rank_base}", hint="the launcher environment is damaged or was set by hand")
        r.set("rank", r.get("rank") - table.rank_base, f"{r.sources['rank']}-{table.rank_base}")
    for f in ("job_id", "master_addr", "nodelist", "tasks_per_node", "hostname"):
        found = first(env, getattr(table, f))
        if found:
            r.set(f, found[1].strip(), found[0])
    missing = [f for f in table.required if f not in r.values]
    if missing:
        present = ", ".join(f"{v}={env[v]}" for v in table.marker)
        wanted = ", ".join("/".join(getattr(table, f)) for f in missing)
        raise BootstrapError(f"{table.name}: {present} is set but {wanted} "
                             f"{'is' if len(missing) == 1 else 'are'} missing",
                             hint="a launcher that sets some of these sets all of them; "
                                  "was the environment copied or edited by hand?")
    _check_ranges(r)
    if table.name == "slurm":
        _slurm_hosts(r, env)
    elif table.name == "local":
        _local_hosts(r)
    return r


def _check_ranges(r: _Reading) -> None:
    """rank < size, local_rank < local_size, node_rank < num_nodes, local_size <= size."""
    for small, big in (("rank", "size"), ("local_rank", "local_size"), ("node_rank", "num_nodes")):
        if r.known(small) and r.known(big) and r.get(small) >= r.get(big):
            raise BootstrapError(f"{r.launcher}: {r.sources[small]}={r.get(small)} is not below "
                                 f"{r.sources[big]}={r.get(big)}")
    if r.known("local_size") and r.known("size") and r.get("local_size") > r.get("size"):
        raise BootstrapError(f"{r.launcher}: {r.sources['local_size']}={r.get('local_size')} is "
                             f"larger than {r.sources['size']}={r.get('size')}")


def _expand_nodes(r: _Reading) -> list[str]:
    """Nodes of the reading's nodelist; HostlistError becomes BootstrapError naming the variable."""
    try:
        return hostlist.expand(str(r.get("nodelist")))
    except HostlistError as e:
        raise BootstrapError(f"{r.launcher}: {r.sources['nodelist']} is not a valid hostlist: "
                             f"{e.message}") from None


# --------------------------------------------------------------------------------------- slurm

def _slurm_hosts(r: _Reading, env: Mapping[str, str]) -> None:
    """Check the step's node and task layout; set local_size, num_nodes and (if derivable) hosts."""
    nodes = _expand_nodes(r)
    if r.known("num_nodes") and len(nodes) != r.get("num_nodes"):
        raise BootstrapError(f"slurm: {r.sources['nodelist']}={r.get('nodelist')} has {len(nodes)} "
                             f"hosts but {r.sources['num_nodes']}={r.get('num_nodes')}")
    if not r.known("num_nodes"):
        r.set("num_nodes", len(nodes), r.sources["nodelist"])
    tpn_var, tpn = r.sources["tasks_per_node"], str(r.get("tasks_per_node"))
    try:
        counts = parse_tasks_per_node(tpn)
    except ValueError as e:
        raise BootstrapError(f"slurm: {tpn_var}={tpn!r} is malformed ({e}); expected e.g. 2(x3),1") from None
    if len(counts) != len(nodes):
        raise BootstrapError(f"slurm: {tpn_var}={tpn} describes {len(counts)} nodes but "
                             f"{r.sources['nodelist']}={r.get('nodelist')} has {len(nodes)}")
    if sum(counts) != r.get("size"):
        raise BootstrapError(f"slurm: {tpn_var}={tpn} adds up to {sum(counts)} tasks but "
                             f"{r.sources['size']}={r.get('size')}")
    node = r.get("node_rank")
    if node >= len(nodes):
        raise BootstrapError(f"slurm: SLURM_NODEID={node} but the step has {len(nodes)} nodes "
                             f"({r.sources['nodelist']}={r.get('nodelist')})")
    r.set("local_size", counts[node], f"{tpn_var}[SLURM_NODEID]")
    _check_ranges(r)
    if r.get("hostname") is not None and r.get("hostname") != nodes[node]:
        raise BootstrapError(f"slurm: SLURMD_NODENAME={r.get('hostname')} but node SLURM_NODEID={node} "
                             f"of {r.sources['nodelist']}={r.get('nodelist')} is {nodes[node]}")
    _slurm_rank_hosts(r, env, nodes, counts)


def _slurm_rank_hosts(r: _Reading, env: Mapping[str, str], nodes: list[str], counts: list[int]) -> None:
    """Host of every rank from Slurm's task distribution, if it is block or cyclic and checks out."""
    dist = (env_get(env, "SLURM_DISTRIBUTION") or "block").split(":")[0]
    layout = {"block": block, "cyclic": cyclic}.get(dist)
    how = f"{r.sources['nodelist']}+{r.sources['tasks_per_node']} ({dist} distribution)"
    if layout is None:
        r.sources["hosts"] = f"unknown: SLURM_DISTRIBUTION={dist} is neither block nor cyclic"
        r.set("own_host", nodes[r.get("node_rank")], r.sources["nodelist"])
        return
    rank_nodes = layout(counts)
    rank, node = r.get("rank"), r.get("node_rank")
    same_node = [q for q, n in enumerate(rank_nodes) if n == node]
    # Why check: a distribution Slurm did not announce (plane, arbitrary) shows up right here.
    if rank_nodes[rank] != node or same_node.index(rank) != r.get("local_rank"):
        r.sources["hosts"] = (f"unknown: {how} does not put SLURM_PROCID={rank} at "
                              f"SLURM_NODEID={node}, SLURM_LOCALID={r.get('local_rank')}")
        r.set("own_host", nodes[node], r.sources["nodelist"])
        return
    r.set("hosts", tuple(nodes[n] for n in rank_nodes), how)


# --------------------------------------------------------------------------------------- local

def _local_hosts(r: _Reading) -> None:
    """hpcring's local backend: ``num_nodes x local_size`` ranks in block order over the nodelist."""
    nodes = _expand_nodes(r)
    if len(nodes) != r.get("num_nodes"):
        raise BootstrapError(f"local: HPCRING_NODELIST={r.get('nodelist')} has {len(nodes)} hosts but "
                             f"HPCRING_NUM_NODES={r.get('num_nodes')}")
    per = r.get("local_size")
    if per * len(nodes) != r.get("size"):
        raise BootstrapError(f"local: HPCRING_SIZE={r.get('size')} is not HPCRING_NUM_NODES={len(nodes)} "
                             f"x HPCRING_LOCAL_SIZE={per}")
    if r.get("rank") != r.get("node_rank") * per + r.get("local_rank"):
        raise BootstrapError(f"local: HPCRING_RANK={r.get('rank')} does not match HPCRING_NODE_RANK="
                             f"{r.get('node_rank')} x {per} + HPCRING_LOCAL_RANK={r.get('local_rank')}")
    own = nodes[r.get("node_rank")]
    if r.get("hostname") is not None and r.get("hostname") != own:
        raise BootstrapError(f"local: HPCRING_HOSTNAME={r.get('hostname')} but node HPCRING_NODE_RANK="
                             f"{r.get('node_rank')} of HPCRING_NODELIST={r.get('nodelist')} is {own}")
    r.set("hosts", tuple(nodes[q // per] for q in range(r.get("size"))), "HPCRING_NODELIST (block)")


# ------------------------------------------------------------------------- corroboration & LSF

def _check_inner_agree(r: _Reading, env: Mapping[str, str]) -> None:
    """Every other MPI-family table that is set must name the same rank (else stale variables)."""
    if r.launcher not in INNER_MPI:
        return
    for name in INNER_MPI:
        t = TABLES[name]
        if name == r.launcher or not _matches(t, env):
            continue
        var, value = t.rank[0], env[t.rank[0]]
        if _parse_int(var, value, name) != r.get("rank"):
            raise BootstrapError(f"contradictory ranks: {r.sources['rank']}={r.get('rank')} "
                                 f"but {var}={value}",
                                 hint="variables of another launch leaked into this environment")


def _corroborate(r: _Reading, env: Mapping[str, str]) -> None:
    """Let an outer launcher that agrees with ``r`` fill its gaps and give the launcher name."""
    later = OUTER[OUTER.index(r.launcher) + 1:] if r.launcher in OUTER else OUTER
    for name in later:
        if not _matches(TABLES[name], env):
            continue
        try:
            outer = _read(TABLES[name], env)
        except BootstrapError as e:
            r.sources.setdefault("ignored", f"{name}: {e.message}")
            continue
        clash = [f for f in _RANK_FIELDS if r.known(f) and outer.known(f) and r.get(f) != outer.get(f)]
        if clash:
            r.sources.setdefault("ignored", f"{name}: disagrees on " + ", ".join(
                f"{outer.sources[f]}={outer.get(f)} vs {r.sources[f]}={r.get(f)}" for f in clash))
            continue
        for f, v in outer.values.items():
            if not r.known(f):
                r.set(f, v, outer.sources[f])
        if "hosts" in outer.sources and "hosts" not in r.sources:
            r.sources["hosts"] = outer.sources["hosts"]
        r.sources["launcher"] += f"; corroborated by {_marker_text(TABLES[name], env)}"
        r.launcher = name
        return


def _short(host: str) -> str:
    return host.split(".", 1)[0]


def _lsf_hosts(r: _Reading, env: Mapping[str, str], hostname: str | None, drop: bool) -> None:
    """Take hosts from the LSF slot list when it is consistent with this rank; else leave unknown."""
    try:
        got = lsf_slots.read(env, drop)
    except BootstrapError as e:
        r.sources.setdefault("ignored", e.message)
        return
    if got is None or not r.known("size"):
        return
    slots, var = got
    why = _lsf_mismatch(r, slots, hostname)
    if why:
        r.sources.setdefault("ignored", f"lsf: {var}: {why}")
        return
    r.set("hosts", tuple(slots), f"{var} (one slot per rank)")
    r.sources["launcher"] += f"; hosts from {var}"
    if r.launcher != "blaunch":  # blaunch tasks keep their launcher's name
        r.launcher = "lsf"


def _blaunch_size(r: _Reading, env: Mapping[str, str], drop: bool) -> None:
    """blaunch starts one task per slot of the host file: the world size is the slot count."""
    try:
        got = lsf_slots.read(env, drop)
    except BootstrapError as e:
        raise BootstrapError(f"blaunch: {e.message}", hint="blaunch tasks need the job's LSF host file") from None
    if not got or not got[0]:
        raise BootstrapError(f"blaunch: LSF_PM_TASKID={env.get('LSF_PM_TASKID')} is set but none of "
                             f"{', '.join(RANK_SLOT_VARS)} lists the job's slots, so the world size is unknown",
                             hint="start the ranks with `blaunch -u $LSB_DJOB_HOSTFILE ...` inside the job")
    slots, var = got
    r.set("size", len(slots), f"{var} ({len(slots)} slots, one blaunch task each)")
    _check_ranges(r)


def _local_from_hosts(r: _Reading) -> None:
    """Local rank and size from the rank -> host map (blaunch does not export them)."""
    hosts = r.get("hosts")
    mine = [q for q, h in enumerate(hosts) if h == hosts[r.get("rank")]]
    r.set("local_rank", mine.index(r.get("rank")), r.sources["hosts"])
    r.set("local_size", len(mine), r.sources["hosts"])


def _lsf_mismatch(r: _Reading, slots: list[str], hostname: str | None) -> str | None:
    """Why the slot list cannot be this job's rank->host map (None if it can)."""
    if len(slots) != r.get("size"):
        return f"{len(slots)} slots but size {r.get('size')}"
    rank = r.get("rank")
    mine = [q for q, h in enumerate(slots) if h == slots[rank]]
    if r.known("local_size") and len(mine) != r.get("local_size"):
        return f"host {slots[rank]} has {len(mine)} slots but local size {r.get('local_size')}"
    if r.known("local_rank") and mine.index(rank) != r.get("local_rank"):
        return f"rank {rank} is slot {mine.index(rank)} of {slots[rank]} but local rank {r.get('local_rank')}"
    hostname = hostname or socket.gethostname()
    if _short(hostname) != _short(slots[rank]):
        return f"slot {rank} is {slots[rank]} but this host is {hostname}"
    return None


# --------------------------------------------------------------------------------------- build

def _single(env: Mapping[str, str], hostname: str | None) -> Topology:
    """No launcher: one process (possibly a batch script inside a Slurm or LSF job)."""
    host = hostname or socket.gethostname()
    found = first(env, JOB_ID_FALLBACK)
    sources = {"launcher": "no launcher variables", "rank": "default", "size": "default",
               "local_rank": "default", "local_size": "default", "node_rank": "default",
               "num_nodes": "default", "hosts": "hostname", "hosts_known": "true"}
    if found:
        sources["job_id"] = found[0]
    return Topology(rank=0, size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1,
                    hosts=(host,), launcher="single", job_id=found[1] if found else None,
                    sources=sources)


def _build(r: _Reading, env: Mapping[str, str], hostname: str | None) -> Topology:
    """Turn a checked reading into a Topology, filling unknowns by the documented convention."""
    if not r.known("size"):
        raise BootstrapError(f"{r.launcher}: {r.sources['rank']}={r.get('rank')} is set but no world size "
                             "is known (PMIx does not export it and no enclosing srun step agrees)",
                             hint="launch with srun --mpi=pmix or mpirun, which export the size")
    _check_ranges(r)
    if not r.known("job_id"):
        found = first(env, JOB_ID_FALLBACK)
        if found:
            r.set("job_id", found[1], found[0])
    hosts = r.get("hosts")
    if hosts is not None:
        nodes = list(dict.fromkeys(hosts))
        if not r.known("node_rank"):
            r.set("node_rank", nodes.index(hosts[r.get("rank")]), "derived from hosts")
        if not r.known("num_nodes"):
            r.set("num_nodes", len(nodes), "derived from hosts")
        r.sources["hosts_known"] = "true"
    else:
        own = r.get("own_host") or hostname or socket.gethostname()
        hosts = tuple(own if q == r.get("rank") else UNKNOWN_HOST for q in range(r.get("size")))
        r.sources.setdefault("hosts", f"own host only ({'launcher' if r.get('own_host') else 'hostname'}); "
                                      "others filled in by the rendezvous")
        r.sources["hosts_known"] = "false"
    ints = {f: r.get(f) if r.known(f) else UNKNOWN for f in _INT_FIELDS}
    for f in _INT_FIELDS:
        r.sources.setdefault(f, "unknown")
    return Topology(hosts=tuple(hosts), launcher=r.launcher,
                    job_id=r.get("job_id"), master_addr=r.get("master_addr"),
                    master_port=r.get("master_port"), sources=dict(r.sources), **ints)
