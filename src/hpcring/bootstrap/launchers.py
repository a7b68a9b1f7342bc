"""Launcher detection: the process environment -> :class:`~hpcring.bootstrap.topology.Topology`.

Contract
--------
``detect(environ=None, *, hostname=None, lsf_drop_launch_node=None) -> Topology``
    Pure apart from reading the LSF host files named by ``HPCRING_LSF_HOSTFILE`` /
    ``LSB_DJOB_RANKFILE`` / ``LSB_DJOB_HOSTFILE`` and, only when ``hostname`` is None and a launcher does not name this
    host, calling ``socket.gethostname()``. Raises :class:`hpcring.errors.BootstrapError` naming
    the variables and values when the chosen launcher's variables are partial or contradict each
    other (rank >= size, local rank >= local size, a nodelist shorter than the node count, ...).

The pieces: launcher_reading.py reads and checks one table, launcher_corroborate.py cross-checks
the other launchers and LSF's slot list; the allocation's size is allocation_size.py's.

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

from hpcring import hostlist
from hpcring.bootstrap import lsf_slots
from hpcring.bootstrap.launcher_corroborate import (_blaunch_size, _check_inner_agree, _corroborate, _local_from_hosts,
                                                    _lsf_hosts)
from hpcring.bootstrap.launcher_reading import _INT_FIELDS, _check_ranges, _marker_text, _matches, _read, _Reading
from hpcring.bootstrap.launcher_tables import (DETECTION_ORDER, JOB_ID_FALLBACK, TABLES, UNKNOWN, UNKNOWN_HOST,
                                               LauncherTable, env_get, first)
from hpcring.bootstrap.slurm_layout import parse_tasks_per_node
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError

__all__ = ["detect", "complete", "hosts_known", "explain", "LauncherTable",
           "TABLES", "DETECTION_ORDER", "UNKNOWN", "UNKNOWN_HOST", "parse_tasks_per_node"]


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
