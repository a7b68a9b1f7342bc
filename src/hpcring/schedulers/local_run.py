"""Supervisor of a local-backend job: starts the ranks, watches them, records the outcome.

Each rank gets the environment a real allocation gives (docs/architecture.md): rank, local rank,
size, node rank and the virtual node list, under HPCRING_* names, plus submitit's SUBMITIT_LOCAL_*.
Like mpirun, when a rank fails the others get a grace period, then are stopped, so a job never
waits on ranks blocked in a collective with a dead peer. SIGTERM (hpcring cancel) stops all ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = float(os.environ.get("HPCRING_LOCAL_GRACE_S", "30"))


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def rank_env(base: dict, job_id: str, nodes: int, per_node: int, node: int, local: int) -> dict:
    rank, size = node * per_node + local, nodes * per_node
    nodelist = f"local[0-{nodes - 1}]" if nodes > 1 else "local0"
    env = dict(base)
    env.update({
        "HPCRING_LAUNCHER": "local", "HPCRING_JOB_ID": job_id,
        "HPCRING_RANK": str(rank), "HPCRING_SIZE": str(size),
        "HPCRING_LOCAL_RANK": str(local), "HPCRING_LOCAL_SIZE": str(per_node),
        "HPCRING_NODE_RANK": str(node), "HPCRING_NUM_NODES": str(nodes),
        "HPCRING_NODELIST": nodelist, "HPCRING_HOSTNAME": f"local{node}",
        "HPCRING_MASTER_ADDR": "127.0.0.1",
        "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": job_id,
        "SUBMITIT_LOCAL_NTASKS": str(size), "SUBMITIT_LOCAL_JOB_NUM_NODES": str(nodes),
        "SUBMITIT_LOCAL_NODEID": str(node), "SUBMITIT_LOCAL_GLOBALID": str(rank),
        "SUBMITIT_LOCAL_LOCALID": str(local),
    })
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcring.schedulers.local_run")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--tasks-per-node", type=int, required=True)
    ap.add_argument("--folder", required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    job_id = os.environ["HPCRING_LOCAL_JOB_ID"]
    limit = float(os.environ.get("HPCRING_TIME_LIMIT_S", "0")) or None
    folder = Path(a.folder.replace("%j", job_id))
    folder.mkdir(parents=True, exist_ok=True)
    statef = folder / f"{job_id}_local.json"
    size = a.nodes * a.tasks_per_node
    st = {"state": "RUNNING", "pid": os.getpid(), "pgid": os.getpgid(0), "started": time.time(),
          "nodes": f"local[0-{a.nodes - 1}]" if a.nodes > 1 else "local0", "ntasks": size}
    _write(statef, st)

    procs: list[subprocess.Popen] = []
    stopping = {"why": None}

    def on_signal(signum, _frame):
        stopping["why"] = "CANCELLED"

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for node in range(a.nodes):
        for local in range(a.tasks_per_node):
            rank = node * a.tasks_per_node + local
            env = rank_env(os.environ, job_id, a.nodes, a.tasks_per_node, node, local)
            out = open(folder / f"{job_id}_{rank}_log.out", "ab")
            err = open(folder / f"{job_id}_{rank}_log.err", "ab")
            procs.append(subprocess.Popen("exec " + " ".join(cmd), shell=True, env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL))
            out.close()
            err.close()

    first_fail: tuple[int, int] | None = None
    fail_time = None
    t0 = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        if first_fail is None:
            for r, c in enumerate(codes):
                if c not in (None, 0):
                    first_fail, fail_time = (r, c), time.monotonic()
                    break
        if all(c is not None for c in codes):
            break
        if stopping["why"] is None and limit and time.monotonic() - t0 > limit:
            stopping["why"] = "TIMEOUT"
        if stopping["why"] or (fail_time and time.monotonic() - fail_time > GRACE_S):
            _stop(procs)
            break
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    if stopping["why"]:
        final = stopping["why"]
    elif first_fail or any(codes):
        final = "FAILED"
    else:
        final = "COMPLETED"
    exit_code = first_fail[1] if first_fail else next((c for c in codes if c), 0)
    st.update(state=final, ended=time.time(), exit_code=exit_code if exit_code >= 0 else 128 - exit_code,
              rank_exit_codes=codes, first_failed_rank=first_fail[0] if first_fail else None)
    _write(statef, st)
    return 0 if final == "COMPLETED" else 1


def _stop(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
