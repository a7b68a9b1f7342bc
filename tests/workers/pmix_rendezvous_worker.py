"""Worker for tests/devcluster/test_pmix_devcluster.py: hpcring.init() under srun --mpi=pmix, then a
ring allreduce whose result is checked exactly. PMIX_WORKER_HANG_RANK=r: that rank never calls init."""
from __future__ import annotations

import os
import sys
import time

import numpy as np


import hpcring.session as hs  # noqa: E402
from hpcring.bootstrap import init as binit  # noqa: E402


def main() -> int:
    if os.environ.get("PMIX_WORKER_HANG_RANK") == os.environ.get("SLURM_PROCID"):
        time.sleep(120)   # never reaches hpcring.init(): the others must name this rank
        return 0
    gate = float(os.environ.get("PMIX_WORKER_GATE", "0"))   # common start time (one machine's clock)
    late = time.time() - gate if gate else 0.0   # > 0: this rank came after the gate (timing invalid)
    if gate:
        time.sleep(max(0.0, gate - time.time()))
    try:
        s = hs.init(backend="ring", timeout=float(os.environ.get("PMIX_WORKER_TIMEOUT", "60")))
    except Exception as e:   # noqa: BLE001 - the test reads the message
        print(f"INITERROR rank={os.environ.get('SLURM_PROCID')} {e}", flush=True)
        return 3
    met = binit.last_timings.get("met", -1.0)
    comm = s.communicator("ring")
    rank, size = comm.rank, comm.size
    x = comm.allreduce(np.arange(1000, dtype=np.int64) * (rank + 1))
    ok = int(np.array_equal(x, np.arange(1000, dtype=np.int64) * (size * (size + 1) // 2)))
    print(f"RESULT rank={rank} size={size} host={s.topology.host} rendezvous={s.topology.sources.get('rendezvous')} "
          f"met={met:.4f} chosen={binit.last_timings.get('rendezvous_chosen', -1):.4f} late={max(0.0, late):.2f} ok={ok}", flush=True)
    comm.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
