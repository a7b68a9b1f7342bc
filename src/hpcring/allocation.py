"""``hpcring run``: start ranks inside the current allocation, or locally outside any.

Where the ranks start, in this order:
  - inside a Slurm allocation (SLURM_JOB_ID set, e.g. `salloc -N 2`): one srun step, the words of
    ``schedulers.slurm.launch_argv`` (the job script's line, sized to ``--nodes x --tasks-per-node``);
  - inside an LSF job (LSB_JOBID set, e.g. `bsub -Is`): ``schedulers.lsf.launch_argv`` (jsrun
    resource sets, or blaunch/mpirun over a host file written into the run folder: the first
    ``--nodes`` hosts of the job's slot list, launch node left out, ``--tasks-per-node`` lines each);
  - otherwise on this machine, with the local backend's per-rank environment.
The allocation's size comes from the launcher tables (``allocation_size.allocation``). Every rank
runs ``python -m hpcring.rank_exec`` which bootstraps, exports MASTER_ADDR & co. and tags CMD's
output by rank. The exit code is that of the first failing rank, which is named.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from hpcring import jobdir
from hpcring.bootstrap import allocation_size, auth, lsf_slots
from hpcring.config.jobspec import JobSpec, check_local_ranks, resolve_job
from hpcring.config.schema import Fabric, Launcher
from hpcring.config.site import Site
from hpcring.errors import JobFailedError, SchedulerError, UsageError
from hpcring.jobdir import hang_headline
from hpcring.outcome import rank_failure, read_records, summarize
from hpcring.schedulers.render import job_env
from hpcring.schedulers import supervisor, get
from hpcring.schedulers.launch_words import LaunchRequest, LaunchWords
from hpcring.elastic import run as elastic_run
from hpcring.schedulers.local_run import rank_env
from hpcring.schedulers.slurm_steps import allocation_hosts

_PLAIN_LAUNCHER = {"slurm": "srun", "lsf": "blaunch"}


def for_allocation(site: Site, alloc: allocation_size.Allocation) -> Site:
    """``site`` as used inside ``alloc``. A site of another scheduler (the ``local`` default inside
    salloc or bsub -Is, when no site names this cluster) describes another machine: its launcher
    becomes the allocation's plain one (srun, blaunch) and its fabric the automatic interface
    choice (the local site pins ``lo``, which links no two nodes)."""
    if site.config.scheduler == alloc.scheduler:
        return site
    cfg = site.config.model_copy(update={"launcher": Launcher(kind=_PLAIN_LAUNCHER[alloc.scheduler]),
                                         "fabric": Fabric(kind="tcp")})
    return replace(site, config=cfg)


def launch_words(alloc: allocation_size.Allocation, site: Site, job: JobSpec, nodes: int, per_node: int,
                 rank_cmd: list[str], run_dir: Path, container=None) -> tuple[LaunchWords, dict[str, str]]:
    """The scheduler's launcher line for ``nodes x per_node`` ranks in ``alloc``, and the variables
    the ranks need besides (LSF: the host file, written into ``run_dir``).

    A site of another scheduler (the default ``local`` site inside salloc or bsub -Is) gets that
    allocation's plain launcher: srun, or blaunch (:func:`for_allocation`).
    """
    cfg = for_allocation(site, alloc).config
    req = LaunchRequest(nodes=nodes, tasks_per_node=per_node, command=tuple(rank_cmd),
                        cpus_per_task=job.cpus_per_task, gpus_per_node=job.gpus_per_node, size_step=True,
                        container=container)
    extra: dict[str, str] = {}
    if alloc.scheduler == "lsf" and cfg.launcher.kind in ("blaunch", "mpirun"):
        if not alloc.slots:
            raise SchedulerError("this LSF job lists no slots (LSB_DJOB_HOSTFILE, LSB_MCPU_HOSTS and "
                                 "LSB_HOSTS are unset)", hint="run `hpcring run` inside `bsub -Is`")
        hostfile = run_dir / "hosts"
        lines = lsf_slots.host_file(list(alloc.slots), nodes, per_node, alloc.source)
        hostfile.write_text("".join(f"{h}\n" for h in lines))
        req = replace(req, hostfile=str(hostfile))
        extra["HPCRING_LSF_HOSTFILE"] = str(hostfile)
    return get(alloc.scheduler).launch_argv(cfg, req), extra


def run(cmd: list[str], site: Site, nodes: int | None, per_node: int | None,
        environ: Mapping[str, str] | None = None, container=None, timeout: float | None = None,
        elastic: bool = False, min_nodes: int | None = None, reset_limit: int | None = None) -> int:
    """Start the ranks, wait for them, and return 0 or raise JobFailedError naming the first failure.
    ``elastic`` (--elastic, with --min-nodes and --reset-limit): workers of an hpcring.torch.elastic
    script under the elastic driver instead (:mod:`hpcring.elastic.run`).
    ``timeout`` (--timeout): the collective deadline, applied as submit does (CLI > HPCRING_TIMEOUT >
    site > default) and handed to the ranks as HPCRING_TIMEOUT.
    ``container`` (config.container.ContainerRun): every rank, hpcring's rank_exec included,
    runs in that image, with the run folder (status files, the secret) bound at its own path."""
    env_in = dict(os.environ if environ is None else environ)
    if not cmd:
        raise UsageError("nothing to run: give a command after --, e.g. hpcring run -- python train.py")
    drop = site.config.scheduler == "lsf" and site.config.lsf.drop_launch_node
    alloc = allocation_size.allocation(env_in, lsf_drop_launch_node=drop)
    if alloc is not None:
        site = for_allocation(site, alloc)
    if container is not None and container.runtime == "pyxis" and (alloc is None or alloc.scheduler != "slurm"):
        raise UsageError(f"site {site.name}'s container runtime pyxis is a plugin of Slurm's srun; outside a "
                         "Slurm allocation the ranks would run on the host",
                         hint="run inside salloc, or add --no-container")
    nodes = nodes or (alloc.num_nodes if alloc else None) or 1
    if alloc and alloc.num_nodes and nodes > alloc.num_nodes:
        raise UsageError(f"--nodes {nodes} but this allocation has {alloc.num_nodes} node(s) ({alloc.source})")
    if per_node is None:  # one rank per GPU, as submit does
        per_node = max(1, site.config.gpus_per_node)
    if alloc is None:
        check_local_ranks(nodes, per_node, hint="lower --nodes or --tasks-per-node, or run inside an allocation "
                                                "(salloc, bsub -Is) to start the ranks on its nodes")
    if elastic:
        min_nodes = elastic_run.check(nodes, min_nodes, reset_limit)
        if container is not None:
            raise UsageError("--elastic runs its workers on the host: a container is not supported with it yet",
                             hint="add --no-container")
    elif min_nodes is not None or reset_limit is not None:
        raise UsageError("--min-nodes and --reset-limit are options of --elastic", hint="add --elastic")
    # only the deadline takes the caller's environment: the job's size comes from the allocation;
    # resolved (and a bad value refused) before the run folder and its secret exist
    job = resolve_job(site, "run", [], {"timeout": timeout},
                      environ={k: env_in[k] for k in ("HPCRING_TIMEOUT",) if k in env_in})
    base = Path(os.path.expanduser(site.config.job_dir)) if alloc else Path(tempfile.gettempdir())
    run_dir = base / f"hpcring-run-{os.getpid()}-{secrets.token_hex(3)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    secret = auth.write_secret_file(run_dir / "secret.key", exclusive=True)
    env = dict(env_in)
    env.update({k: v for k, v in job_env(site, job).items() if k not in env_in or k == "HPCRING_TIMEOUT"})
    env["HPCRING_SECRET_FILE"] = str(secret)
    # inside an image, the interpreter the site names (hpcring installed there); else this one
    python = site.config.python if container is not None and site.config.python else sys.executable
    rank_cmd = [python, "-m", "hpcring.rank_exec", "--status-dir", str(run_dir / "status"), "--", *cmd]
    if container is not None:   # CMD may name files relative to here: the ranks start here too
        container = container.with_bind(str(run_dir))
        if container.workdir is None:
            container = replace(container.with_bind(os.getcwd()), workdir=os.getcwd())
    # the job id the ranks see (rank_env's, locally): it names their diag folder and records
    ranks_env = {**env, "HPCRING_JOB_ID": _local_job_id(), "SUBMITIT_LOCAL_JOB_ID": _local_job_id()} \
        if alloc is None else env
    diag = jobdir.diag_dir(ranks_env, create=False)
    try:
        if elastic:
            return elastic_run.run(cmd, env, nodes, per_node, min_nodes, reset_limit, alloc,
                                   _hosts(alloc, env_in) if alloc is not None else None)
        if alloc is None:
            pre = LaunchRequest(nodes, per_node, (), gpus_per_node=job.gpus_per_node,
                                container=container).container_prefix()
            procs = _start_local([*pre, *rank_cmd], env, nodes, per_node)
        else:
            words, extra = launch_words(alloc, site, job, nodes, per_node, rank_cmd, run_dir, container)
            argv = words.argv
            if shutil.which(argv[0]) is None:
                raise SchedulerError(f"`{argv[0]}` is not on PATH inside this {alloc.scheduler} allocation",
                                     hint="load the scheduler's module, or check the site's launcher")
            procs = [supervisor.start(argv, {**env, **extra})]
        codes = _wait_all(procs, diag)
        records = read_records(run_dir / "status", jobdir.job_id(ranks_env), nodes * per_node)
        return _verdict(records, nodes * per_node, codes, cmd, diag)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if alloc is None:     # run<pid> is this run's alone: kept only when it holds a report
            jobdir.remove_if_empty(diag.parent)


def _hosts(alloc: allocation_size.Allocation, environ: Mapping[str, str]) -> list[str]:
    """The allocation's nodes in the scheduler's order: Slurm's node list, or an LSF job's slot
    list as :func:`allocation_size.allocation` read it (a launch node left out), once per host."""
    if alloc.scheduler == "lsf":
        if not alloc.slots:
            raise SchedulerError("this LSF job lists no slots (LSB_DJOB_HOSTFILE, LSB_MCPU_HOSTS and "
                                 "LSB_HOSTS are unset)", hint="run `hpcring run --elastic` inside `bsub -Is` or a batch job")
        return list(dict.fromkeys(alloc.slots))
    return allocation_hosts(environ)


def _local_job_id() -> str:
    return f"run{os.getpid()}"


def _start_local(rank_cmd: list[str], env: dict, nodes: int, per_node: int) -> list[subprocess.Popen]:
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


def _verdict(records: dict[int, dict], size: int, codes: list[int], cmd: list[str], diag: Path | None = None) -> int:
    oc = summarize(records, size)
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
