"""The environment torch.distributed (env://), NCCL and Gloo read, from a completed Topology."""
from __future__ import annotations

import os

from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError


def framework_env(topo: Topology, gpus_per_node: int = 0) -> dict[str, str]:
    """Environment for torch.distributed (env://), NCCL and Gloo from a completed Topology.

    NCCL_SOCKET_IFNAME uses the exact form ``=<iface>``; GLOO_SOCKET_IFNAME gets the bare name
    because Gloo compares names literally (it has no ``=`` syntax). CUDA_VISIBLE_DEVICES is set to
    the local rank (modulo ``gpus_per_node``) only when the job has GPUs and it is not set already.
    """
    if topo.master_addr is None or topo.master_port is None:
        raise BootstrapError(f"rank {topo.rank}: Topology has no master address/port yet",
                             hint="call init_bootstrap() first and pass the Topology it returns")
    env = {
        "MASTER_ADDR": topo.master_addr, "MASTER_PORT": str(topo.master_port),
        "RANK": str(topo.rank), "WORLD_SIZE": str(topo.size),
        "LOCAL_RANK": str(topo.local_rank), "LOCAL_WORLD_SIZE": str(topo.local_size),
        "NODE_RANK": str(topo.node_rank),
    }
    if topo.interface:
        env["NCCL_SOCKET_IFNAME"] = f"={topo.interface}"
        env["GLOO_SOCKET_IFNAME"] = topo.interface
    if gpus_per_node > 0 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(topo.local_rank % gpus_per_node)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(topo.local_size))
    return env


def threads_per_rank(local_size: int, environ=None, affinity: set[int] | None = None,
                     cpu_count: int | None = None) -> int:
    """CPU threads one rank should use, so that the ranks of a node do not oversubscribe it:
    ``SLURM_CPUS_PER_TASK`` when Slurm set it; else the CPUs this process may run on, divided by
    the ranks of the node when that set is the whole machine (nobody pinned the ranks: they share
    it), taken whole when a launcher pinned the rank to its own CPUs. At least 1."""
    env = os.environ if environ is None else environ
    per_task = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit() and int(per_task) > 0:
        return int(per_task)
    cpus = affinity if affinity is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                                  else set(range(os.cpu_count() or 1)))
    total = cpu_count if cpu_count is not None else (os.cpu_count() or len(cpus))
    n = len(cpus)
    if n >= total:
        n //= max(1, local_size)
    return max(1, n)


def apply_framework_env(topo: Topology, gpus_per_node: int = 0) -> dict[str, str]:
    """Export :func:`framework_env` into ``os.environ``; returns what was set."""
    env = framework_env(topo, gpus_per_node)
    os.environ.update(env)
    return env
