"""LSF's slot lists: one host per slot of the job, from a host file or a variable.

Contract: :func:`read` returns the slots and the variable they came from (None when no list is
set); with ``drop_launch_node`` the leading entries of the first host are left out (Summit-like
sites list the batch node first). hpcring's own host file (HPCRING_LSF_HOSTFILE, written by
``hpcring run``) comes first and is already without a launch node. BootstrapError names the
variable for an unreadable file or a malformed LSB_MCPU_HOSTS. :func:`host_file` is the inverse
for ``hpcring run``: the lines of a host file for ``nodes x per_node`` ranks.
"""
from __future__ import annotations

from collections.abc import Mapping

from hpcring.bootstrap.launcher_tables import RANK_SLOT_VARS, first
from hpcring.config import envvars
from hpcring.errors import BootstrapError, UsageError


def drop_launch_node(env: Mapping[str, str], override: bool | None = None) -> bool:
    """The site's ``lsf.drop_launch_node`` as the job exports it (HPCRING_LSF_DROP_LAUNCH_NODE)."""
    return bool(envvars.get("HPCRING_LSF_DROP_LAUNCH_NODE", env)) if override is None else override


def read(env: Mapping[str, str], drop_launch_node: bool,
         names: tuple[str, ...] = RANK_SLOT_VARS) -> tuple[list[str], str] | None:
    """Host of each LSF slot (first of ``names`` set) and the variable it came from."""
    found = first(env, names)
    if found is None:
        return None
    var, value = found
    if var in ("HPCRING_LSF_HOSTFILE", "LSB_DJOB_RANKFILE", "LSB_DJOB_HOSTFILE"):
        try:
            with open(value, encoding="utf-8") as fh:
                slots = [line.strip() for line in fh if line.strip()]
        except OSError as e:
            raise BootstrapError(f"lsf: cannot read {var}={value}: {e.strerror}") from None
    elif var == "LSB_MCPU_HOSTS":
        slots = mcpu_slots(value)
    else:
        slots = value.split()
    if drop_launch_node and slots and var != "HPCRING_LSF_HOSTFILE":
        head = slots[0]
        while slots and slots[0] == head:
            slots.pop(0)
        var += " (launch node dropped)"
    return slots, var


def mcpu_slots(value: str) -> list[str]:
    """``hA 4 hB 4`` -> one entry per slot."""
    parts = value.split()
    if len(parts) % 2 or not all(p.isdigit() for p in parts[1::2]):
        raise BootstrapError(f"lsf: LSB_MCPU_HOSTS={value!r} is not 'host count host count ...'")
    return [h for h, c in zip(parts[::2], parts[1::2]) for _ in range(int(c))]


def host_file(slots: list[str], nodes: int, per_node: int, source: str) -> list[str]:
    """Lines of a host file for ``per_node`` ranks on each of the first ``nodes`` hosts of ``slots``.

    Raises UsageError when the allocation (``source`` names where ``slots`` came from) has fewer
    hosts, or a host fewer slots, than asked for.
    """
    hosts = list(dict.fromkeys(slots))
    if nodes > len(hosts):
        raise UsageError(f"--nodes {nodes} but this LSF allocation has {len(hosts)} host(s) ({source})")
    short = [h for h in hosts[:nodes] if slots.count(h) < per_node]
    if short:
        raise UsageError(f"--tasks-per-node {per_node} but host {short[0]} has {slots.count(short[0])} "
                         f"slot(s) in this allocation ({source})",
                         hint="ask bsub for more slots per host (-R span[ptile=K]) or lower --tasks-per-node")
    return [h for h in hosts[:nodes] for _ in range(per_node)]
