"""Worker for tests/devcluster/test_mpi_devcluster.py: hpcring.init(backend="mpi") under srun --mpi=pmix."""
from __future__ import annotations

import sys

import numpy as np


import hpcring.session as hs  # noqa: E402
from hpcring.collectives.choice import auto_backend  # noqa: E402


def main() -> int:
    s = hs.init(backend="mpi", timeout=60)
    comm = s.communicator("mpi")
    rank, size = comm.rank, comm.size
    assert (rank, size) == (s.topology.rank, s.topology.size)
    ok = 0
    x = comm.allreduce(np.arange(1000, dtype=np.float64) + rank)
    assert np.array_equal(x, size * np.arange(1000) + size * (size - 1) / 2), x[:4]
    ok += 1
    g = comm.allgather(np.full(3, rank, np.int32))
    assert np.array_equal(g, np.repeat(np.arange(size, dtype=np.int32)[:, None], 3, axis=1)), g
    ok += 1
    b = np.full(7, rank, np.float32)
    comm.broadcast(b, root=size - 1)
    assert np.all(b == size - 1), b
    ok += 1
    comm.barrier()
    print(f"RESULT rank={rank} size={size} host={s.topology.host} launcher={s.topology.launcher} "
          f"backend={type(comm.backend).__name__} auto={auto_backend(s.topology)} ok={ok}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
