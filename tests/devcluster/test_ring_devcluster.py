"""The ring backend is correct across real nodes: 3 nodes x 2 ranks on the dev cluster, one job,
with every transport on: shared memory within a node, the two-level allreduce / reduce-scatter
at every size, 2 TCP streams per peer striped by 2 I/O threads from 4 KiB chunks.

Every collective x dtype {float32, float64, int32, float16, bfloat16 (uint16 storage)} x size
{0, 1, 7, 1000, 65537}, with deterministic per-rank data: every rank computes the numpy reference
for every other rank's data itself, counts mismatches, and prints a hash of all its results so the
test can also check that replicated results are bit-identical on all ranks.
"""
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


WORKER = r'''
import hashlib, json, sys
import numpy as np
import hpcring

DTYPES = ["float32", "float64", "int32", "float16", "bfloat16"]
SIZES = [0, 1, 7, 1000, 65537]


def bf16(vals):            # small integers are exact in bfloat16: the top 16 bits of the float32
    return (np.asarray(vals, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def data(rank, dtype, count, op, salt):
    rng = np.random.default_rng([rank, count, salt])
    v = rng.choice([-1, 1, 1, 2], count) if op == "prod" else rng.integers(-6, 7, count)
    if dtype == "bfloat16":
        return bf16(v)
    return v.astype(dtype)


def values(a, dtype):
    return bf16_value(a) if dtype == "bfloat16" else a.astype(np.float64 if dtype != "int32" else np.int64)


def reduce_ref(arrs, op, dtype):
    v = np.stack([values(a, dtype) for a in arrs])
    # exact for these small integers in every dtype (avg is compared within a rounding)
    return {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}[op](v, axis=0)


def mismatches(got, want, dtype, op):
    g = values(np.asarray(got).reshape(-1), dtype)
    w = np.asarray(want).reshape(-1)
    if g.shape != w.shape:
        return max(g.size, w.size) or 1
    if op == "avg":
        eps = {"float16": 2 ** -10, "bfloat16": 2 ** -7, "float32": 2 ** -23, "float64": 2 ** -52}[dtype]
        return int(np.count_nonzero(~np.isclose(g, w, rtol=4 * eps, atol=0)))
    return int(np.count_nonzero(g != w))


def main():
    s = hpcring.init()
    comm = s.communicator("ring")
    n, rank = comm.size, comm.rank
    kw = lambda dt: {"dtype": "bfloat16"} if dt == "bfloat16" else {}
    fails, checks = [], 0
    h_all = hashlib.sha256()          # results that must be identical on every rank
    h_mine = hashlib.sha256()         # per-rank results (reduce_scatter, alltoall), for the record
    for dt in DTYPES:
        for count in SIZES:
            cases = [("allreduce", op) for op in ("sum", "prod", "min", "max", "avg") if not (op == "avg" and dt == "int32")]
            cases += [("reduce_scatter", "sum"), ("reduce_scatter", "max"), ("allgather", None),
                      ("broadcast", None), ("alltoall", None)]
            for salt, (coll, op) in enumerate(cases):
                ins = [data(r, dt, count * (n if coll == "alltoall" else 1), op, salt) for r in range(n)]
                x = ins[rank].copy()
                if coll == "allreduce":
                    got = comm.allreduce(x, op=op, **kw(dt))
                    want, same = reduce_ref(ins, op, dt), True
                elif coll == "reduce_scatter":
                    got = comm.reduce_scatter(x, op=op, **kw(dt))
                    full = reduce_ref(ins, op, dt)
                    base, extra = divmod(count, n)
                    off = rank * base + min(rank, extra)
                    want, same = full[off:off + base + (rank < extra)], False
                elif coll == "allgather":
                    got = comm.allgather(x, **kw(dt))
                    want, same = np.concatenate([values(a, dt) for a in ins]), True
                elif coll == "broadcast":
                    root = n - 1
                    got = comm.broadcast(x, root=root, **kw(dt))
                    want, same = values(ins[root], dt), True
                else:
                    got = comm.alltoall(x, **kw(dt))
                    want = np.concatenate([values(a, dt)[rank * count:(rank + 1) * count] for a in ins])
                    same = False
                bad = mismatches(got, want, dt, op)
                checks += 1
                if np.asarray(got).dtype != (np.uint16 if dt == "bfloat16" else np.dtype(dt)):
                    bad = bad or 1
                if bad:
                    fails.append(f"{coll}/{op}/{dt}/{count}: {bad} wrong")
                (h_all if same else h_mine).update(f"{coll}{op}{dt}{count}".encode() + np.ascontiguousarray(got).tobytes())
    comm.barrier()
    print("RINGCHECK " + json.dumps({"rank": rank, "size": n, "host": s.topology.host, "checks": checks,
                                     "transport": comm.backend.describe(),
                                     "cut": [comm.backend.rd_threshold, comm.backend.rh_chunk],
                                     "fails": fails, "hash": h_all.hexdigest()}), flush=True)
    return 1 if fails else 0


sys.exit(main())
'''


def _run_worker(**extra):
    worker = Path("/srv/hpcring") / f"ring-worker-{os.getpid()}.py"   # /tmp is private per node
    worker.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **extra)
    try:
        r = subprocess.run(["salloc", "-N", "3", "--ntasks-per-node=2", "--time=5", sys.executable, "-m", "hpcring",
                            "run", "--site", "devcluster", "--tasks-per-node", "2", "--", sys.executable, str(worker)],
                           capture_output=True, text=True, timeout=400, env=env, cwd="/srv/hpcring",
                           stdin=subprocess.DEVNULL)
    finally:
        worker.unlink()
    recs = [json.loads(l.split("RINGCHECK ", 1)[1]) for l in r.stdout.splitlines() if "RINGCHECK " in l]
    fails = [f for x in recs for f in x["fails"]]
    assert not fails, fails[:20]
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(x["rank"] for x in recs) == list(range(6))
    assert {x["host"] for x in recs} == {"node1", "node2", "node3"}
    assert all(x["checks"] == 5 * 5 * 10 - 5 for x in recs)
    assert len({x["hash"] for x in recs}) == 1, "replicated results differ between ranks"
    return recs


def test_recursive_halving_across_3_nodes_x_2_ranks():
    """Every allreduce by recursive halving/doubling over TCP between real nodes (6 ranks: the
    fold of a non-power-of-two job included), shared memory off."""
    recs = _run_worker(HPCRING_RING_SHM="0", HPCRING_RD_THRESHOLD="0", HPCRING_RH_CHUNK=str(1 << 40))
    assert all("tcp only" in x["transport"] and x["cut"] == [0, 1 << 40] for x in recs), recs[0]


def test_ring_all_ops_dtypes_sizes_3_nodes_x_2_ranks():
    recs = _run_worker(HPCRING_RING_SHM="1", HPCRING_TWOLEVEL_MIN="0", HPCRING_RING_STREAMS="2",
                       HPCRING_RING_THREADS="2", HPCRING_RING_STRIPE_MIN="4096")
    assert all("two-level allreduce over 3 hosts" in x["transport"] and "2 stream(s)/peer, 2 I/O thread(s)"
               in x["transport"] for x in recs), recs[0]["transport"]
    # 5 dtypes x 5 sizes x (5 allreduce ops, 4 for int32, + 5 other calls)
    assert all(x["checks"] == 5 * 5 * 10 - 5 for x in recs)
    assert len({x["hash"] for x in recs}) == 1, "replicated results differ between ranks"
