"""Rendezvous benchmark: N local ranks (processes) with the local backend's environment.

    PYTHONPATH=src python benchmarks/rendezvous_bench.py [--ranks 256] [--per-node 8] [--verify ring]

Process start-up is measured separately from rendezvous, because on a small machine starting N
Python interpreters dominates: every rank imports hpcring, reports ready and blocks on a start
gate (a pipe the parent closes once all are ready); only then does init_bootstrap() run.

* spawn s  from the first Popen until every rank reported ready (interpreters + imports)
* meet s   from opening the gate until every rank has met (all host names gathered in the store)
* total s  from opening the gate until every rank returned from init_bootstrap (incl. verification)
* store up s / all conn s  when rank 0 / the last rank had connected to the store (from the gate)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

RANK = r"""
import json, os, sys, time
from hpcring.bootstrap import init as bi
import concurrent.futures          # imported lazily by verification; part of start-up, not of meeting
gate = int(sys.argv[1])
print("ready", flush=True)
os.read(gate, 1)                      # blocks until the parent closes the write end
t_gate = time.time()
topo, client = bi.init_bootstrap(timeout=float(sys.argv[2]), verify=sys.argv[3])
t_done = time.time()
print(json.dumps({"rank": topo.rank, "gate": t_gate, "met": t_gate + bi.last_timings["met"],
                  "done": t_done, "iface": topo.interface, "conn": bi.last_timings["connected"]}), flush=True)
client.barrier("bench-exit", topo.size, timeout=60)   # rank 0 hosts the store: leave together
"""


def local_env(rank: int, size: int, per_node: int, job_id: str, secret: Path) -> dict[str, str]:
    """The local backend's per-rank variables (docs/architecture.md)."""
    nodes = (size + per_node - 1) // per_node
    return {
        "HPCRING_LAUNCHER": "local", "HPCRING_JOB_ID": job_id,
        "HPCRING_RANK": str(rank), "HPCRING_SIZE": str(size),
        "HPCRING_LOCAL_RANK": str(rank % per_node), "HPCRING_LOCAL_SIZE": str(per_node),
        "HPCRING_NODE_RANK": str(rank // per_node), "HPCRING_NUM_NODES": str(nodes),
        "HPCRING_NODELIST": f"local[0-{nodes - 1}]" if nodes > 1 else "local0",
        "HPCRING_HOSTNAME": f"local{rank // per_node}", "HPCRING_MASTER_ADDR": "127.0.0.1",
        "HPCRING_SECRET_FILE": str(secret),
    }


def run(size: int, per_node: int, verify: str, timeout: float) -> dict[str, float]:
    sys.path.insert(0, SRC)
    from hpcring.bootstrap.auth import new_secret_file
    if size % per_node:
        raise SystemExit(f"--ranks {size} must be a multiple of --per-node {per_node}")
    secret = new_secret_file(tempfile.mkdtemp(prefix="hpcring-bench-"))
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("HPCRING_")}
    base["PYTHONPATH"] = SRC + os.pathsep + base.get("PYTHONPATH", "")
    gate_r, gate_w = os.pipe()
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(gate_r), str(timeout), verify],
                              env={**base, **local_env(r, size, per_node, job_id, secret)},
                              stdout=subprocess.PIPE, text=True, pass_fds=(gate_r,))
             for r in range(size)]
    os.close(gate_r)
    for p in procs:   # a rank that dies before "ready" gives an empty line: fail loudly
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"a rank exited before becoming ready (rc={p.wait()})")
    t_ready = time.time()
    os.close(gate_w)
    t_gate = time.time()
    results = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait(timeout=timeout)
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise SystemExit(f"{len(bad)} ranks failed")
    return {"ranks": size, "spawn": t_ready - t0,
            "meet": max(r["met"] for r in results) - t_gate,
            "total": max(r["done"] for r in results) - t_gate,
            "iface": results[0]["iface"], "conn": max(r["conn"] for r in results), "conn0": results[0]["conn"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[256])
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--verify", choices=("ring", "all", "none"), default="ring")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    print(f"{'ranks':>6} {'spawn s':>8} {'meet s':>7} {'total s':>8} {'store up s':>10} "
          f"{'all conn s':>12}  (cores: {os.cpu_count()}, verify={args.verify})")
    for n in args.ranks:
        row = run(n, min(args.per_node, n), args.verify, args.timeout)
        print(f"{row['ranks']:>6} {row['spawn']:>8.2f} {row['meet']:>7.2f} {row['total']:>8.2f} "
              f"{row['conn0']:>10.2f} {row['conn']:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
