"""The ring's shared-memory segment of a host (see :mod:`hpcring.collectives.ring`): its pieces,
its name, mapping it."""
from __future__ import annotations

import logging
import os
import time

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_wire import StoreTimeoutError
from hpcring.collectives.ring_peers import node_layout
from hpcring.config import envvars
from hpcring.errors import BootstrapError

log = logging.getLogger("hpcring.collectives.ring")

try:
    from hpcring import _native
except ImportError:  # pragma: no cover - only without a built extension (RingBackend.create refuses)
    _native = None


def default_shm_piece(local_ranks: int) -> int:
    """1 MiB per rank on the host, 1-8 MiB: fewer barriers per byte as ranks get more (measured on
    2 cores, 64 MiB: 2 ranks 2 MiB 0.76-1.51 vs 1 MiB 0.50-0.54 GB/s; 4 ranks 2-4 MiB 0.30-0.50 vs
    1 MiB 0.22-0.37 GB/s). The segment holds 2 pieces per rank (8 ranks: 128 MiB of /dev/shm)."""
    return min(8, max(1, local_ranks)) << 20


def default_cma_allgather_min(local_ranks: int, cores: int | None = None) -> int:
    """Bytes per peer from which allgather reads its peers' buffers directly: 64 KiB where each of
    the host's ranks has a core (os.cpu_count(), the same on every rank of the host), else never.
    Measured on the 2-core VM (native/hr_internal.h): 2 ranks 3-5x faster than the segment from
    64 KiB; 4 ranks 1.4-1.8x from 256 KiB but mixed at 64 KiB; 8 ranks slower."""
    if cores is None:
        cores = os.cpu_count() or 1
    return 64 << 10 if local_ranks <= cores else 0


def default_cma_alltoall_min(local_ranks: int) -> int:
    """Block bytes from which alltoall reads its peers' blocks directly, by the host's rank count
    (the same on every rank of the host). Measured on the 2-core VM after direct reads started at
    the next rank (2026-11-29, 3 rounds, us per call, segment / direct reads): 2 ranks 512 KiB
    blocks 38.6-39.2 / 58.6-59.3 (the segment), 4 ranks 256 KiB 137-149 / 176-248 but 512 KiB
    604-822 / 358-402, 8 ranks 64 KiB 172-195 / 265-292 but 128 KiB 762-840 / 508-606 and 512 KiB
    4117-4889 / 1921-2562. More than 8 ranks: not measured, 8's cut kept."""
    if local_ranks <= 2:
        return 1 << 20
    return 512 << 10 if local_ranks <= 4 else 128 << 10


def shm_name(secret: bytes, job: str, base: str, host: str) -> str:
    """The POSIX name of a host's shared-memory segment: the same on the ranks of one communicator
    on one host, another for every other job, array task (an array's tasks share the secret and
    may run at once on one host), communicator generation or host."""
    parts = (job, base, host)
    return "/hpcring-" + auth.mac(secret, b"hpcring-ring-v1 shm", *(s.encode() + b"\0" for s in parts)).hex()[:32]


def _agree_cma(comm, store, base: str, rank: int, local: list[int], deadline: float) -> bool:
    """Whether the host's collectives may read peers' memory directly (native/transport_shm.h):
    only when every local rank can read every other's (ptrace rules, Yama, seccomp and containers
    differ per process) and none turned it off (HPCRING_RING_CMA=0); one more store round of the
    host's ranks, all of them taking part whatever their answer."""
    ok, err = comm.shm_cma_probe() if envvars.get("HPCRING_RING_CMA") else (False, 0)
    if not ok and err:
        log.info("rank %d: cannot read this host's other ranks' memory (%s): shared memory copies "
                 "twice", rank, os.strerror(err))
    store.set(f"{base}/shm/cma/{rank}", b"1" if ok else b"0")
    answers = store.gather([f"{base}/shm/cma/{r}" for r in local], timeout=max(0.1, deadline - time.monotonic()))
    return all(a == b"1" for a in answers)


def attach_shm(comm, store, secret: bytes, base: str, rank: int, hosts: tuple[str, ...],
               deadline: float, job: str = "") -> None:
    """Map the host's shared-memory segment (see :mod:`hpcring.collectives.ring`); no-op for a rank
    alone on its host."""
    local, column = node_layout(hosts, rank)
    if len(local) < 2:
        return
    piece = (envvars.get("HPCRING_RING_SHM_PIECE") or default_shm_piece(len(local))) // 64 * 64
    name = shm_name(secret, job, base, hosts[rank])
    leader = local[0]
    try:
        if rank == leader:
            _native.shm_unlink(name)      # a leftover of this very job's earlier attempt
            comm.shm_attach(name, True, local, column, piece)
            store.set(f"{base}/shm/created/{leader}", b"1")
        else:
            store.get(f"{base}/shm/created/{leader}", timeout=max(0.1, deadline - time.monotonic()))
            comm.shm_attach(name, False, local, column, piece)
        store.set(f"{base}/shm/mapped/{rank}", b"1")
        store.gather([f"{base}/shm/mapped/{r}" for r in local], timeout=max(0.1, deadline - time.monotonic()))
        comm.shm_cma = _agree_cma(comm, store, base, rank, local, deadline)
        if comm.shm_cma and envvars.get("HPCRING_RING_CMA_ALLGATHER_MIN") is None:
            comm.cma_allgather_min = default_cma_allgather_min(len(local))
        if comm.shm_cma and envvars.get("HPCRING_RING_CMA_MIN") is None:
            comm.cma_min = default_cma_alltoall_min(len(local))
    except _native.NativeError as e:
        raise BootstrapError(f"ring setup: rank {rank} ({hosts[rank]}): shared memory: {e}",
                             hint="check /dev/shm (size, permissions), or turn shared memory "
                                  "off on every rank with HPCRING_RING_SHM=0") from None
    except StoreTimeoutError as e:
        raise BootstrapError(f"ring setup: rank {rank} ({hosts[rank]}): the ranks of this host "
                             f"did not all map the shared-memory segment in time "
                             f"(missing: {', '.join(e.missing or [])})",
                             hint="a rank of this host did not start or failed; see its log") from None
    finally:
        _native.shm_unlink(name)          # on every path: no name outlives the setup
