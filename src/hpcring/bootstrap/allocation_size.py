"""The Slurm or LSF allocation a process runs in (salloc, bsub -Is, a batch script) and its size.

Contract
--------
``allocation(environ=None, *, lsf_drop_launch_node=None) -> Allocation | None``
    The Slurm or LSF allocation this process runs in (salloc, bsub -Is, a batch script) and its
    node count, from :data:`~hpcring.bootstrap.launcher_tables.ALLOCATIONS`; None outside any.
    Pure apart from reading the LSF host files (lsf_slots.py); raises BootstrapError naming the
    variables and values that are malformed, as :func:`hpcring.bootstrap.launchers.detect` does.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hpcring.bootstrap import lsf_slots
from hpcring.bootstrap.launcher_reading import _parse_int
from hpcring.bootstrap.launcher_tables import ALLOCATIONS, first


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
