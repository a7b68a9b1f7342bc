"""One table row per collective, as nccl-tests has one small file per collective: its bus-bandwidth
factor, whether it reduces, whether its size splits into shares, and its buffers, timed call and
check; where the buffers live (host or GPU)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from hpcring.errors import UsageError
from hpcring.bench.data import Case, _sentinel, count_wrong, rank_pattern, reduce_patterns, tile


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``n`` ranks."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return _spec(collective).factor(n)


def _spec(collective: str) -> "Collective":
    try:
        return TABLE[collective]
    except KeyError:
        raise UsageError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}") from None


def counts_for(collective: str, nbytes: int, itemsize: int, n: int) -> tuple[int, int, int]:
    """(total elements of the largest buffer, the printed per-rank count, the printed size in bytes)."""
    total = nbytes // itemsize
    if _spec(collective).shares:
        total -= total % n
        return total, total // n, total * itemsize
    return total, total, total * itemsize


MEMORIES = ("auto", "device", "host")


def device_module(comm, memory: str):
    """CuPy when the buffers live on the GPU: ``memory`` "device", or "auto" on a GPU backend
    (nccl-tests times device buffers); None for host (numpy) buffers, which a GPU backend stages."""
    on_gpu = comm.device == "cuda"
    if memory == "host" or (memory == "auto" and not on_gpu):
        return None
    if not on_gpu:
        raise UsageError(f"--memory device needs a GPU backend (nccl); backend {comm.backend_name} works on host memory")
    return comm.array_module


def memory_label(comm, memory: str) -> str:
    xp = device_module(comm, memory)
    if xp is not None:
        return f"device (CuPy arrays on GPU {comm.device_id})"
    if comm.device == "cuda":
        return "host (numpy, staged through the GPU by the backend: not what nccl-tests measures)"
    return "host (numpy)"


@dataclass
class _Point:
    """What every case builder gets: the communicator, the per-rank patterns, the point's size,
    and how buffers reach the memory under test (``put``) and come back for the check (``get``)."""
    comm: object
    pat: list
    dtype: str
    op: str
    root: int
    total: int
    put: Callable
    get: Callable

    @property
    def dt(self):             # dtype= for the call: only bfloat16 needs saying (uint16 storage)
        return "bfloat16" if self.dtype == "bfloat16" else None

    @property
    def mine(self):
        return self.pat[self.comm.rank]


def _allreduce(k: _Point) -> Case:
    x, out = k.put(tile(k.mine, 0, k.total)), k.put(_sentinel(k.total, k.dtype))
    want = lambda: tile(reduce_patterns(k.pat, k.op, k.dtype), 0, k.total)  # noqa: E731
    return Case(lambda: k.comm.allreduce(x, op=k.op, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype, k.op), [x, out])


def _reduce_scatter(k: _Point) -> Case:
    per, rank = k.total // k.comm.size, k.comm.rank
    x, out = k.put(tile(k.mine, 0, k.total)), k.put(_sentinel(per, k.dtype))
    want = lambda: tile(reduce_patterns(k.pat, k.op, k.dtype), rank * per, per)  # noqa: E731
    return Case(lambda: k.comm.reduce_scatter(x, op=k.op, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype, k.op), [x, out])


def _allgather(k: _Point) -> Case:
    per = k.total // k.comm.size
    x, out = k.put(tile(k.mine, 0, per)), k.put(_sentinel(k.comm.size * per, k.dtype))
    want = lambda: np.concatenate([tile(p, 0, per) for p in k.pat]) if per else k.get(out)[:0]  # noqa: E731
    return Case(lambda: k.comm.allgather(x, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype), [x, out])


def _alltoall(k: _Point) -> Case:
    per, rank = k.total // k.comm.size, k.comm.rank
    x, out = k.put(tile(k.mine, 0, k.total)), k.put(_sentinel(k.total, k.dtype))
    # rank q's block for this rank is elements [rank*per, (rank+1)*per) of q's input
    want = lambda: np.concatenate([tile(p, rank * per, per) for p in k.pat]) if per else k.get(out)[:0]  # noqa: E731
    return Case(lambda: k.comm.alltoall(x, out=out, dtype=k.dt),
                lambda: count_wrong(k.get(out), want(), k.dtype), [x, out])


def _broadcast(k: _Point) -> Case:
    buf = k.put(tile(k.mine, 0, k.total))

    def check() -> int:     # fresh buffers for the checked call: non-roots start from the sentinel
        fresh = tile(k.mine, 0, k.total) if k.comm.rank == k.root else _sentinel(k.total, k.dtype)
        buf[...] = k.put(fresh)
        k.comm.broadcast(buf, root=k.root, dtype=k.dt)
        return count_wrong(k.get(buf), tile(k.pat[k.root], 0, k.total), k.dtype)
    return Case(lambda: k.comm.broadcast(buf, root=k.root, dtype=k.dt), check, [buf])


@dataclass(frozen=True)
class Collective:
    """One collective as nccl-tests treats it: its bus-bandwidth factor for n ranks, whether it
    reduces (has a redop), whether the size is split into n shares (count printed per share),
    and the builder of its buffers, timed call and check."""
    factor: Callable[[int], float]
    reducing: bool
    shares: bool
    build: Callable[[_Point], Case]


TABLE: dict[str, Collective] = {
    "allreduce": Collective(lambda n: 2.0 * (n - 1) / n, True, False, _allreduce),
    "allgather": Collective(lambda n: (n - 1) / n, False, True, _allgather),
    "broadcast": Collective(lambda n: 1.0, False, False, _broadcast),
    "reduce_scatter": Collective(lambda n: (n - 1) / n, True, True, _reduce_scatter),
    "alltoall": Collective(lambda n: (n - 1) / n, False, True, _alltoall),
}
COLLECTIVES = tuple(TABLE)
REDUCING = tuple(c for c, spec in TABLE.items() if spec.reducing)


def make_case(comm, collective: str, dtype: str, op: str, root: int, total: int, seed: int = 0,
              xp=None) -> Case:
    """Buffers, the timed call and its check for this rank (``total``: elements of the largest
    buffer). ``xp`` (CuPy): the buffers live on the GPU; checks copy them back."""
    pat = [rank_pattern(r, dtype, op, seed) for r in range(comm.size)]
    put = (lambda a: a) if xp is None else xp.asarray  # noqa: E731
    get = (lambda a: a) if xp is None else xp.asnumpy  # noqa: E731
    return _spec(collective).build(_Point(comm, pat, dtype, op, root, total, put, get))
