"""``hpcring run``: start ranks inside the current allocation, or locally outside any.

Where the ranks start, in this order:
  - inside a Slurm allocation (SLURM_JOB_ID set, e.g. `salloc -N 2`): one `srun` step through the
    site's launcher settings (`--mpi=...`), `--kill-on-bad-exit=1` so one failing rank ends the step;
  - inside an LSF job (LSB_JOBID set, e.g. `bsub -Is`): `blaunch` over LSB_DJOB_HOSTFILE, or
    `jsrun`/`mpirun` when the site says so;
  - otherwise on this machine, with the local backend's per-rank environment.
Every rank runs ``python -m hpcring.rank_exec`` which bootstraps, exports MASTER_ADDR & co. and
tags CMD's output by rank. The exit code is that of the first failing rank, which is named.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from hpcring.bootstrap import auth
from hpcring.config.site import Site
from hpcring.errors import JobFailedError, SchedulerError, UsageError
from hpcring.outcome import hang_headline, rank_failure, read_statuses, summarize
from hpcring.render import job_env
from hpcring.schedulers import supervisor

def where(environ: Mapping[str, str]) -> str:
    if environ.get("SLURM_JOB_ID"):
        return "slurm"
    if environ.get("LSB_JOBID"):
        return "lsf"
    return "local"


def _alloc_nodes(kind: str, environ: Mapping[str, str]) -> int | None:
    if kind == "slurm" and environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES")):
        return int(environ.get("SLURM_JOB_NUM_NODES") or environ["SLURM_NNODES"])
    if kind == "lsf" and environ.get("LSB_MCPU_HOSTS"):
        return len(environ["LSB_MCPU_HOSTS"].split()) // 2
    return None


def launcher_argv(kind: str, site: Site, nodes: int, per_node: int, rank_cmd: list[str]) -> list[str]:
    """The command that starts ``nodes x per_node`` copies of ``rank_cmd`` in this allocation."""
    lau = site.config.launcher
    if kind == "slurm":
        argv = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={per_node}", f"--ntasks={nodes * per_node}",
                "--kill-on-bad-exit=1", "--unbuffered"]
        if lau.kind == "srun" and lau.mpi:
            argv.append(f"--mpi={lau.mpi}")
        return argv + list(lau.args) + rank_cmd
    if kind == "lsf":
        if lau.kind == "jsrun":
            return ["jsrun", "-n", str(nodes * per_node), "-r", str(per_node), "-a", "1"] + list(lau.args) + rank_cmd
        if lau.kind == "mpirun":
            return ["mpirun", "-np", str(nodes * per_node), "--hostfile", os.environ["LSB_DJOB_HOSTFILE"],
                    "--map-by", f"ppr:{per_node}:node"] + list(lau.args) + rank_cmd
        return ["blaunch", "-u", os.environ.get("LSB_DJOB_HOSTFILE", "")] + list(lau.args) + rank_cmd
    raise UsageError(f"no launcher for {kind!r}")


def run(cmd: list[str], site: Site, nodes: int | None, per_node: int | None,
        environ: Mapping[str, str] | None = None) -> int:
    """Start the ranks, wait for them, and return 0 or raise JobFailedError naming the first failure."""
    env_in = dict(os.environ if environ is None else environ)
    if not cmd:
        raise UsageError("nothing to run: give a command after --, e.g. hpcring run -- python train.py")
    kind = where(env_in)
    alloc = _alloc_nodes(kind, env_in)
    nodes = nodes or alloc or 1
    if alloc and nodes > alloc:
        raise UsageError(f"--nodes {nodes} but this allocation has {alloc} node(s)")
    if per_node is None:  # one rank per GPU, as submit does
        per_node = max(1, site.config.gpus_per_node)
    base = Path(os.path.expanduser(site.config.job_dir)) if kind != "local" else Path(tempfile.gettempdir())
    run_dir = base / f"hpcring-run-{os.getpid()}-{secrets.token_hex(3)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    secret = auth.write_secret_file(run_dir / "secret.key", exclusive=True)
    env = dict(env_in)
    from hpcring.config.jobspec import resolve_job
    env.update({k: v for k, v in job_env(site, resolve_job(site, "run", [], {}, environ={})).items()
                if k not in env_in})
    env["HPCRING_SECRET_FILE"] = str(secret)
    rank_cmd = [sys.executable, "-m", "hpcring.rank_exec", "--status-dir", str(run_dir / "status"), "--", *cmd]
    try:
        if kind == "local":
            procs = _start_local(rank_cmd, env, nodes, per_node)
        else:
            argv = launcher_argv(kind, site, nodes, per_node, rank_cmd)
            if shutil.which(argv[0]) is None:
                raise SchedulerError(f"`{argv[0]}` is not on PATH inside this {kind} allocation",
                                     hint="load the scheduler's module, or check the site's launcher")
            procs = [supervisor.start(argv, env)]
        from hpcring.diagnostics.jobdir import diag_dir
        diag = diag_dir({**env, "HPCRING_JOB_ID": _local_job_id()} if kind == "local" else env, create=False)
        codes = _wait_all(procs, diag)
        return _verdict(run_dir / "status", nodes * per_node, codes, cmd, diag)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _local_job_id() -> str:
    return f"run{os.getpid()}"


def _start_local(rank_cmd: list[str], env: dict, nodes: int, per_node: int) -> list[subprocess.Popen]:
    from hpcring.schedulers.local_run import rank_env
    job_id = _local_job_id()
    # SIGTERM, not SIGKILL, on our death: rank_exec then kills its CMD and removes the secret
    return [supervisor.start(rank_cmd, rank_env(env, job_id, nodes, per_node, n, l), parent_death=signal.SIGTERM)
            for n in range(nodes) for l in range(per_node)]


def _wait_all(procs: list[subprocess.Popen], diag: Path | None = None) -> list[int]:
    """Wait for every process (the shared rank supervisor); Ctrl-C or SIGTERM ends them all."""
    sup = supervisor.Supervisor(procs, grace_s=supervisor.grace_s(), diag=diag)
    old = {s: signal.signal(s, lambda *_: sup.stop("CANCELLED")) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return sup.wait().codes
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _verdict(status_dir: Path, size: int, codes: list[int], cmd: list[str], diag: Path | None = None) -> int:
    oc = summarize(read_statuses({r: status_dir / f"{r}.json" for r in range(size)}), size)
    if oc.clean and not any(codes):
        return 0
    hang = hang_headline(diag) if diag is not None else None
    if hang:         # the watchdog's diagnosis says more than "every rank exited with 1"
        raise JobFailedError(f"collective failure: {hang[0]} (report: {hang[1]})",
                             exit_code=oc.failed[0]["exit_code"] if oc.failed else 1)
    if oc.failed:
        s = oc.failed[0]
        raise JobFailedError(rank_failure(s, f"{' '.join(cmd)} exited with code {s['exit_code']}")
                             + (f" (first of {len(oc.failed)} failing ranks)" if len(oc.failed) > 1 else ""),
                             exit_code=s["exit_code"])
    code = next((c for c in codes if c), 1)
    raise JobFailedError(f"ranks {oc.missing} ended without reporting (launcher exit code {code})",
                         exit_code=code if code > 0 else 128 - code)
