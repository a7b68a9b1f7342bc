"""After the first table matched: the other inner tables must agree on the rank, an outer launcher
that agrees fills the gaps (and names the launcher), and LSF's slot list gives hosts, blaunch's
world size and local ranks (see the detection order in launchers.py)."""
from __future__ import annotations

import socket
from collections.abc import Mapping

from hpcring.bootstrap import lsf_slots
from hpcring.bootstrap.launcher_reading import (_RANK_FIELDS, _check_ranges, _marker_text, _matches, _parse_int,
                                                _read, _Reading)
from hpcring.bootstrap.launcher_tables import INNER_MPI, OUTER, RANK_SLOT_VARS, TABLES
from hpcring.errors import BootstrapError


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
