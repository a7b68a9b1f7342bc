"""torch.distributed backend ``hpcring``: DDP, FSDP and Lightning on hpcring's collectives.

    import hpcring.distributed            # registers the backend (hpcring submit does it for you)
    dist.init_process_group("hpcring")    # or "cpu:hpcring,cuda:hpcring"

The process group takes its ranks from the hpcring session (:func:`hpcring.init`): the one the
job already has (``hpcring submit`` / ``hpcring run``), or a new bootstrap from the launcher's
environment (srun, mpirun, torchrun, ...) through hpcring's authenticated store, which needs the
per-job secret (HPCRING_SECRET_FILE). torch's own Store (torchrun's TCPStore, MASTER_ADDR) is not
used to meet: it does not authenticate peers. See docs/torch.md.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from hpcring.distributed.hooks import allreduce_hook
from hpcring.distributed.process_group import BACKEND_NAME, ProcessGroupHpcring
from hpcring.distributed.work import HpcringWork
from hpcring.errors import UsageError
from hpcring.bootstrap.frameworks import framework_env


def _seconds(timeout) -> float | None:
    """torch's group timeout as hpcring's deadline: torch's default (30 min) means "not chosen",
    so hpcring's own default applies (HPCRING_TIMEOUT or 300 s); an explicit one is used."""
    from torch.distributed.constants import default_pg_timeout
    if timeout is None or timeout == default_pg_timeout:
        return None
    return timeout.total_seconds()


def _create(opts, _backend_options=None) -> ProcessGroupHpcring:
    """torch's creator (extended API), called on the members of a group only (torch gives the
    other ranks GroupMember.NON_GROUP_MEMBER). A group of every rank shares the session's
    communicators; a subset gets its own (hpcring.collectives.groups: connections among the
    members only, its own sequence numbers, records and reports naming global ranks)."""
    from hpcring.session import current, init  # deferred: session (~100 ms) waits for a process group, not import torch (rank_site)
    session = current() or init()
    size, rank = int(opts.group_size), int(opts.group_rank)
    members = list(opts.global_ranks_in_group or range(size))
    if members != list(range(session.size)):
        group = session.group(members)
        if group is None or list(group.members) != members or (rank, size) != (group.rank, group.size):
            raise UsageError(f"hpcring backend: torch asks for rank {rank} of {size} in a group of ranks "
                             f"{members}, but this process is rank {session.rank} of the hpcring job "
                             f"({session.size} ranks)",
                             hint="create groups with dist.new_group(ranks) on every rank of the job")
        return ProcessGroupHpcring(group, rank, size, timeout=_seconds(opts.timeout))
    if (rank, size) != (session.rank, session.size):
        raise UsageError(f"hpcring backend: torch says rank {rank} of {size}, but the hpcring session on "
                         f"{session.host} is rank {session.rank} of {session.size}",
                         hint="pass rank/world_size as hpcring exports them (RANK, WORLD_SIZE), or leave them out")
    return ProcessGroupHpcring(session, rank, size, timeout=_seconds(opts.timeout))


_TORCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def init_process_group(backend: str = BACKEND_NAME, **kwargs) -> None:
    """``dist.init_process_group`` under any launcher, including a plain srun / mpirun that sets
    none of torch's env:// variables: bootstrap hpcring first (:func:`hpcring.init`), export
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a free port on rank 0's verified
    interface) from the session where the launcher did not set them, then call torch."""
    from hpcring.session import init  # deferred: session (~100 ms) waits for a process group, not import torch (rank_site)
    session = init()
    for key, value in framework_env(session.topology).items():
        if key in _TORCH_ENV:
            os.environ.setdefault(key, value)
    dist.init_process_group(backend, **kwargs)


def register() -> None:
    """Register ``hpcring`` with torch.distributed for CPU and CUDA tensors (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


register()

__all__ = ["BACKEND_NAME", "HpcringWork", "ProcessGroupHpcring", "allreduce_hook", "init_process_group", "register"]
