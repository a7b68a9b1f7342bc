"""Worker for tests/integration/test_mpi_backend.py, run under mpirun (each rank runs this).

    python tests/workers/mpi_worker.py ops    every op x dtype x size vs numpy; results identical on all ranks
    python tests/workers/mpi_worker.py skip   the last rank skips the second allreduce (deadline test)
    python tests/workers/mpi_worker.py mismatch|different|larger
                                      the last rank all-reduces half the count / calls a barrier /
                                      all-reduces twice the count, past the folded check's slot
                                      (FOLD_BYTES), instead of the second allreduce (signature check)

With ``MPI_WORKER_NOFOLD=1`` the backend's check is the (signature, -signature) allreduce that
communicators of more than FOLD_RANKS ranks use, and no call rides in the check's slot.
    python tests/workers/mpi_worker.py cost BYTES CALLS
                                      time per allreduce of BYTES with the signature check off
                                      and on (alternating rounds), ``COST`` lines from rank 0

Prints ``RESULT rank=<r> ok=<n checks>`` (or ``FAIL ...`` lines and exit 1) and, in skip mode,
``CAUGHT rank=<r> elapsed=<s> msg=<error>``.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np


from hpcring.collectives.api import Communicator  # noqa: E402
from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS, chunk_counts  # noqa: E402
from hpcring.collectives.mpi import MpiBackend, from_float32, to_float32  # noqa: E402
from hpcring.errors import CollectiveError  # noqa: E402

SIZES = (0, 1, 7, 1000)
NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "int32": np.int32,
      "int64": np.int64, "uint8": np.uint8, "bfloat16": np.uint16}


def make(dtype: str, n: int, rank: int, salt: int) -> np.ndarray:
    """Rank-specific data, the same on every run (each rank can rebuild any rank's input)."""
    rng = np.random.default_rng(1000 * rank + 7 * n + salt)
    if dtype in FLOAT_DTYPES:
        vals = (rng.integers(-8, 9, n) / 4.0).astype(np.float32)
        vals[vals == 0] = 0.5                       # prod stays informative
        if dtype == "bfloat16":
            out = np.empty(n, np.uint16)
            from_float32(vals, out, "bfloat16")
            return out
        return vals.astype(NP[dtype])
    if dtype == "uint8":
        return rng.integers(0, 256, n).astype(np.uint8)
    return rng.integers(-5, 6, n).astype(NP[dtype])


def as_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return to_float32(a, "bfloat16").astype(np.float64)
    return a.astype(np.float64)


def expected_reduce(stack: list[np.ndarray], dtype: str, op: str, size: int):
    if dtype in FLOAT_DTYPES:
        s = np.stack([as_f64(a, dtype) for a in stack])
        return {"sum": s.sum(0), "prod": s.prod(0), "min": s.min(0), "max": s.max(0),
                "avg": s.sum(0) / size}[op]
    s = np.stack(stack)
    t = NP[dtype]
    return {"sum": lambda: s.sum(0, dtype=t), "prod": lambda: s.prod(0, dtype=t),
            "min": lambda: s.min(0), "max": lambda: s.max(0)}[op]()


def close(got: np.ndarray, want, dtype: str, size: int) -> bool:
    if dtype in FLOAT_DTYPES:
        g = as_f64(got, dtype)
        eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -22, "float64": 2.0 ** -50}[dtype]
        return bool(np.all(np.abs(g - want) <= (size + 1) * eps * np.maximum(np.abs(want), 1.0)))
    return bool(np.array_equal(got, want))


def run_ops(comm: Communicator) -> int:
    rank, size = comm.rank, comm.size
    digest = hashlib.sha256()
    failures: list[str] = []
    checks = 0

    def check(label, got, want, dtype):
        nonlocal checks
        checks += 1
        if not label.startswith(("reduce_scatter", "alltoall")):   # the rest must agree bit for bit
            digest.update(label.encode() + np.ascontiguousarray(got).tobytes())
        if not close(got, want, dtype, size):
            failures.append(f"FAIL rank={rank} {label}: got {got[:8]} want {np.asarray(want)[:8]}")

    for dtype in DTYPES:
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        for n in SIZES:
            inputs = [make(dtype, n, r, 0) for r in range(size)]
            for op in OPS:
                if op == "avg" and dtype not in FLOAT_DTYPES:
                    continue
                want = expected_reduce(inputs, dtype, op, size)
                got = comm.allreduce(inputs[rank].copy(), op=op, **kw)
                check(f"allreduce {dtype} n={n} {op}", got, want, dtype)
                buf = inputs[rank].copy()
                comm.allreduce(buf, op=op, out=buf, **kw)
                check(f"allreduce-inplace {dtype} n={n} {op}", buf, want, dtype)
                # reduce_scatter of an uneven length (n elements over size ranks)
                counts = chunk_counts(n, size)
                off = sum(counts[:rank])
                got = comm.reduce_scatter(inputs[rank].copy(), op=op, **kw)
                check(f"reduce_scatter {dtype} n={n} {op}", got.reshape(-1), want[off:off + counts[rank]], dtype)
            got = comm.allgather(inputs[rank], **kw)
            check(f"allgather {dtype} n={n}", got.reshape(-1), np.concatenate(inputs), "uint8")
            root = size - 1
            buf = inputs[rank].copy()
            comm.broadcast(buf, root=root, **kw)
            check(f"broadcast {dtype} n={n}", buf, inputs[root], "uint8")
            a2a = [make(dtype, n * size, r, 1) for r in range(size)]
            want = np.concatenate([a2a[r].reshape(size, n)[rank] for r in range(size)]) if n else a2a[0]
            got = comm.alltoall(a2a[rank].copy(), **kw)
            check(f"alltoall {dtype} n={n}", got, want, "uint8")
            buf = a2a[rank].copy()
            comm.alltoall(buf, out=buf, **kw)
            check(f"alltoall-inplace {dtype} n={n}", buf, want, "uint8")
    for dt in ("int32", "int64", "uint8"):     # wrap-around like numpy, on long (vectorized) buffers
        info = np.iinfo(NP[dt])
        mine = np.full(1000, info.max - rank, NP[dt])
        stack = [np.full(1000, info.max - r, NP[dt]) for r in range(size)]
        check(f"allreduce wrap {dt} sum", comm.allreduce(mine), np.stack(stack).sum(0, dtype=NP[dt]), dt)
        check(f"allreduce wrap {dt} prod", comm.allreduce(mine, op="prod"), np.stack(stack).prod(0, dtype=NP[dt]), dt)
    comm.barrier()
    h = comm.allreduce_async(np.full(5, rank + 1, np.int64))
    check("allreduce_async", h.wait(), np.full(5, size * (size + 1) // 2, np.int64), "int64")
    comm.barrier_async().wait()

    from mpi4py import MPI
    digests = MPI.COMM_WORLD.allgather(digest.hexdigest())
    if len(set(digests)) != 1:
        failures.append(f"FAIL rank={rank} results differ between ranks: {digests}")
    for f in failures:
        print(f, flush=True)
    print(f"RESULT rank={rank} ok={checks - len(failures)} failed={len(failures)}", flush=True)
    return 1 if failures else 0


def run_skip(comm: Communicator, deadline: float) -> int:
    rank, size = comm.rank, comm.size
    x = comm.allreduce(np.ones(4, np.float32))
    assert x[0] == size, x
    if rank == size - 1:                          # the straggler: never enters allreduce#2
        time.sleep(deadline + 2.0)
        print(f"SKIPPED rank={rank}", flush=True)
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(1000, np.float32), timeout=deadline)
    except CollectiveError as e:
        print(f"CAUGHT rank={rank} elapsed={time.monotonic() - t0:.3f} msg={str(e).splitlines()[0]}", flush=True)
        last = comm.recorder.records()[-1]        # the short path's record (the C ring's slot)
        print(f"RECORD rank={rank} {last.op}#{last.seq} {last.state} error={last.error == str(e)}", flush=True)
        try:
            comm.barrier(timeout=deadline)
        except CollectiveError as e2:
            print(f"STICKY rank={rank} msg={str(e2).splitlines()[0]}", flush=True)
        os._exit(0)
    print(f"NOERROR rank={rank}", flush=True)
    os._exit(1)


def run_mismatch(comm: Communicator, mode: str) -> int:
    rank, size = comm.rank, comm.size
    comm.allreduce(np.ones(1000, np.float32))
    t0 = time.monotonic()
    try:
        if rank == size - 1 and mode == "mismatch":
            comm.allreduce(np.ones(500, np.float32))
        elif rank == size - 1 and mode == "larger":
            comm.allreduce(np.ones(2000, np.float32))
        elif rank == size - 1:
            comm.barrier()
        else:
            comm.allreduce(np.ones(1000, np.float32))
    except CollectiveError as e:
        print(f"CAUGHT rank={rank} elapsed={time.monotonic() - t0:.3f} msg={str(e).splitlines()[0]}", flush=True)
        return 0
    print(f"NOERROR rank={rank}", flush=True)
    return 1


def run_cost(comm: Communicator, nbytes: int, calls: int) -> int:
    """Median per-call time over rounds, the check off and on in alternating rounds (so load
    changes on a shared machine hit both alike)."""
    x = np.ones(max(1, nbytes // 4), np.float32)
    out = np.empty_like(x)
    be = comm.backend
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):
        comm.allreduce(x, out=out)
    for rnd in range(10):
        for check in (False, True):
            be.check = check
            be.barrier(30.0)
            t0 = time.perf_counter()
            for _ in range(calls):
                be.allreduce(x, out, "float32", "sum", 30.0)
            times[check].append((time.perf_counter() - t0) / calls)
    if comm.rank == 0:
        off, on = float(np.median(times[False])), float(np.median(times[True]))
        print(f"COST bytes={x.nbytes} calls={calls} off_us={off * 1e6:.1f} on_us={on * 1e6:.1f} "
              f"delta_us={(on - off) * 1e6:.1f} min_off_us={min(times[False]) * 1e6:.1f} "
              f"min_on_us={min(times[True]) * 1e6:.1f}", flush=True)
    return 0


def main() -> int:
    mode = sys.argv[1]
    backend = MpiBackend.create(None, timeout=30.0)
    if os.environ.get("MPI_WORKER_NOFOLD") == "1":
        backend.fold = False
    comm = Communicator(backend, timeout=30.0)
    if mode == "ops":
        rc = run_ops(comm)
        comm.close()
        return rc
    if mode == "skip":
        return run_skip(comm, float(sys.argv[2]) if len(sys.argv) > 2 else 1.5)
    if mode in ("mismatch", "different", "larger"):
        return run_mismatch(comm, mode)
    if mode == "cost":
        return run_cost(comm, int(sys.argv[2]), int(sys.argv[3]))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
