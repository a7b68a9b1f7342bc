"""Supervisor of a local-backend job: starts the ranks, watches them, records the outcome.

Each rank gets the environment a real allocation gives (docs/architecture.md): rank, local rank,
size, node rank and the virtual node list, under HPCRING_* names, plus submitit's SUBMITIT_LOCAL_*.
Supervision (schedulers/supervisor.py, shared with ``hpcring run``): like mpirun, when a rank fails
the others get a grace period (HPCRING_LOCAL_GRACE_S, 10 s), then are stopped, frozen ones included,
so a job never waits on ranks blocked in a collective with a dead peer; ranks die with this
supervisor (PR_SET_PDEATHSIG). SIGTERM (hpcring cancel) stops all ranks. The job's secret file is
deleted when the job ends.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcring.bootstrap.auth import delete_secret_file
from hpcring.fsutil import write_json
from hpcring.jobdir import hang_headline
from hpcring.schedulers.supervisor import Supervisor, grace_s, start


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
    write_json(statef, st)

    procs: list[subprocess.Popen] = []
    sup = Supervisor(procs, grace_s=grace_s(), limit_s=limit, diag=folder / "diag")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop("CANCELLED"))
    try:
        for node in range(a.nodes):
            for local in range(a.tasks_per_node):
                rank = node * a.tasks_per_node + local
                env = rank_env(os.environ, job_id, a.nodes, a.tasks_per_node, node, local)
                with open(folder / f"{job_id}_{rank}_log.out", "ab") as out, \
                        open(folder / f"{job_id}_{rank}_log.err", "ab") as err:
                    procs.append(start(["bash", "-c", "exec " + " ".join(cmd)], env, stdout=out, stderr=err))
        ended = sup.wait()
    finally:
        if not os.environ.get("HPCRING_ARRAY_TASK"):   # an array's tasks share it: local_queue deletes it
            delete_secret_file(os.environ.get("HPCRING_SECRET_FILE"))   # the job has ended: no requeue locally
    hang = hang_headline(folder / "diag") if ended.state == "FAILED" else None
    st.update(state=ended.state, ended=time.time(), exit_code=ended.exit_code, rank_exit_codes=ended.codes,
              first_failed_rank=ended.first_failed, stopped_ranks=ended.killed,
              reason=f"collective failure: {hang[0]}" if hang else None)
    write_json(statef, st)
    return 0 if ended.state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
