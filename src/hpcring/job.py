"""What runs inside every rank of a submitted job.

``RunScript`` is the callable submitit pickles: in each rank it sets the variables frameworks
expect (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), runs the user's script as ``__main__``
with its arguments, and records the rank's outcome in ``<folder>/<jobid>_<rank>_status.json``
(plain JSON, read by ``hpcring submit --wait`` and ``hpcring status`` to name failing ranks).
"""
from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
import traceback
import zlib
from pathlib import Path

from hpcring.errors import HpcringError


class RankFailed(HpcringError):
    """The user's script failed on this rank (non-zero exit or an exception)."""


def master_port_for(job_id: str, lo: int = 29500, hi: int = 29999) -> int:
    """A port derived from the job id, so concurrent jobs on shared nodes rarely collide."""
    return lo + zlib.crc32(str(job_id).encode()) % (hi - lo + 1)


def _rank_info() -> dict:
    """Rank, size, local rank, nodes from the launcher env (bootstrap's tables when available)."""
    try:
        from hpcring.bootstrap.launchers import detect
        t = detect()
        hosts = list(t.hosts)
        first = hosts[0] if hosts and hosts[0] != "?" else None
        return dict(rank=t.rank, size=t.size, local_rank=t.local_rank, local_size=t.local_size,
                    node_rank=t.node_rank, num_nodes=t.num_nodes, first_host=first, launcher=t.launcher,
                    job_id=t.job_id, master_addr=t.master_addr, host=t.hosts[t.rank])
    except ImportError:  # bootstrap layer not installed in this build: fall back on submitit's view
        import submitit
        env = submitit.JobEnvironment()
        return dict(rank=env.global_rank, size=env.num_tasks, local_rank=env.local_rank,
                    local_size=max(1, env.num_tasks // max(1, env.num_nodes)), node_rank=env.node,
                    num_nodes=env.num_nodes, first_host=env.hostnames[0] if env.hostnames else None,
                    launcher="submitit", job_id=str(env.job_id), master_addr=None, host=socket.gethostname())


def framework_env(info: dict, gpus_per_node: int = 0) -> dict[str, str]:
    """The torch.distributed / JAX variables for this rank, before any network bootstrap."""
    job_id = info.get("job_id") or "0"
    env = {
        "RANK": str(info["rank"]),
        "WORLD_SIZE": str(info["size"]),
        "LOCAL_RANK": str(info["local_rank"]),
        "LOCAL_WORLD_SIZE": str(info["local_size"]),
        "GROUP_RANK": str(info["node_rank"]),
        "MASTER_ADDR": info.get("master_addr") or info.get("first_host") or "127.0.0.1",
        # +1: the hpcring rendezvous store takes the derived port itself; torch binds the next one.
        "MASTER_PORT": str(master_port_for(job_id) + 1),
    }
    if gpus_per_node and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(info["local_rank"] % gpus_per_node)
    return env


class RunScript:
    """Run ``script`` with ``args`` in ``cwd`` as ``__main__`` on every rank."""

    def __init__(self, script: str, args: list[str], cwd: str, gpus_per_node: int = 0) -> None:
        self.script = script
        self.args = list(args)
        self.cwd = cwd
        self.gpus_per_node = gpus_per_node

    def __call__(self) -> int:
        info = _rank_info()
        for k, v in framework_env(info, self.gpus_per_node).items():
            os.environ.setdefault(k, v)
        os.chdir(self.cwd)
        folder = _job_folder()
        status = {"rank": info["rank"], "size": info["size"], "local_rank": info["local_rank"],
                  "host": info["host"], "launcher": info["launcher"], "pid": os.getpid(),
                  "started": time.time(), "exit_code": None, "error": None}
        code, error = 0, None
        sys.argv = [self.script, *self.args]
        sys.path.insert(0, str(Path(self.script).resolve().parent))
        try:
            runpy.run_path(self.script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException as exc:  # the traceback goes to this rank's stderr log
            traceback.print_exc()
            code, error = 1, f"{type(exc).__name__}: {exc}"
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        status.update(exit_code=code, error=error, ended=time.time())
        _write_status(folder, info, status)
        if code != 0:
            what = error or f"exited with code {code}"
            raise RankFailed(f"rank {info['rank']} on {info['host']}: {self.script} {what}")
        return 0


def _job_folder() -> Path:
    """The job folder with %j resolved (SUBMITIT_FOLDER keeps the placeholder)."""
    try:
        import submitit
        return Path(submitit.JobEnvironment().paths.folder)
    except Exception:  # not under submitit (e.g. `hpcring run`): the current directory
        return Path(os.environ.get("SUBMITIT_FOLDER", ".").replace("%j", os.environ.get("SLURM_JOB_ID", "")))


def _write_status(folder: Path, info: dict, status: dict) -> None:
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("LSB_JOBID") or \
        os.environ.get("SUBMITIT_LOCAL_JOB_ID") or str(info.get("job_id") or "0")
    path = folder / f"{job_id}_{info['rank']}_status.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(status))
        os.replace(tmp, path)
    except OSError as exc:  # never mask the rank's own outcome
        print(f"hpcring: could not write {path}: {exc}", file=sys.stderr)
