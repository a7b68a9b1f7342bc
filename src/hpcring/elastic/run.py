"""``hpcring run --elastic``: the elastic driver (:mod:`hpcring.elastic.driver`) over this machine or
the current allocation's nodes, for scripts on ``hpcring.torch.elastic`` (Horovod Elastic's API).

- Outside an allocation: ``--nodes x --tasks-per-node`` workers on this machine (the driver's local
  mode).
- Inside a Slurm allocation (``salloc --no-kill``: a lost node must not end the allocation): the
  driver serves the rendezvous from this process; each of the first ``--nodes`` nodes of the
  allocation runs one ``srun`` step of ``--tasks-per-node`` workers (``--kill-on-bad-exit=0``,
  pinned with ``--nodelist``); the allocation's other nodes are spares. When a node's step fails,
  its workers are counted lost at once (not after the heartbeat's silence) and a step starts on
  the next spare, whose workers join the job at the survivors' next commit. With no spare left the
  job goes on while at least ``--min-nodes`` nodes' workers are left.
- Inside an LSF job (``bsub -Is`` or a batch job): the same, with one ``blaunch -z HOST`` per node
  (:func:`hpcring.schedulers.lsf.node_step_argv`, which asks LSF to end only that host's tasks when
  one fails); the hosts are the job's slot list in order (a launch node left out as the site says).
"""
from __future__ import annotations

import argparse
import shutil
import socket

from hpcring.config.envvars import get as env_get
from hpcring.elastic.driver import Driver, Nodes
from hpcring.errors import JobFailedError, SchedulerError, UsageError
from hpcring.schedulers import slurm_steps


def _source_address(host: str) -> str | None:
    """This machine's address on the route to ``host`` (where ``host``'s workers reach the store)."""
    try:
        target = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(target)           # UDP: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return None


def _args(cmd: list[str], np_: int, min_np: int, reset_limit: int | None, address: str | None) -> argparse.Namespace:
    return argparse.Namespace(np=np_, min_np=min_np, max_np=np_, reset_limit=reset_limit,
                              timeout=env_get("HPCRING_ELASTIC_TIMEOUT"), dead_after=env_get("HPCRING_ELASTIC_DEAD_AFTER"),
                              serve=False, bind="0.0.0.0" if address else "127.0.0.1", port=0, address=address,
                              info=None, command=list(cmd))


def check(nodes: int, min_nodes: int | None, reset_limit: int | None) -> int:
    """``min_nodes`` checked against ``nodes`` (a usage error before anything starts); its value."""
    min_nodes = nodes if min_nodes is None else min_nodes
    if not 1 <= min_nodes <= nodes:
        raise UsageError(f"--min-nodes {min_nodes} must be between 1 and --nodes ({nodes})",
                         hint="--min-nodes is the fewest nodes the elastic job may go on with")
    if reset_limit is not None and reset_limit < 0:
        raise UsageError(f"--reset-limit {reset_limit} must be 0 or more")
    return min_nodes


_LAUNCHER = {"slurm": "srun", "lsf": "blaunch"}


def _node_step_argv(scheduler: str):
    """The scheduler's words for one node's step (its module owns them)."""
    if scheduler == "slurm":
        return slurm_steps.node_step_argv
    if scheduler == "lsf":
        from hpcring.schedulers.lsf import node_step_argv  # deferred: submitit (the LSF executor's module)
        return node_step_argv
    raise UsageError(f"hpcring run --elastic does not run inside a {scheduler} allocation",
                     hint="run it inside a Slurm allocation or an LSF job, or outside any")


def run(cmd: list[str], env: dict, nodes: int, per_node: int, min_nodes: int, reset_limit: int | None,
        alloc=None, hosts: list[str] | None = None) -> int:
    """Run the elastic job; 0, or JobFailedError with the driver's exit code. ``alloc``: the
    allocation (None: this machine); ``hosts``: its nodes in order (the first ``nodes`` start)."""
    np_, min_np = nodes * per_node, min_nodes * per_node
    if alloc is None:
        driver = Driver(_args(cmd, np_, min_np, reset_limit, None), environ=env)
    else:
        node_step_argv = _node_step_argv(alloc.scheduler)
        launcher = _LAUNCHER[alloc.scheduler]
        if shutil.which(launcher, path=env.get("PATH")) is None:    # else every node's step fails alike
            raise SchedulerError(f"`{launcher}` is not on PATH inside this {alloc.scheduler} allocation",
                                 hint="load the scheduler's module (LSF: source profile.lsf), then run again")
        if not hosts or len(hosts) < nodes:
            raise UsageError(f"--nodes {nodes} but this {alloc.scheduler} allocation lists {len(hosts or [])} node(s)",
                             hint="lower --nodes, or ask the scheduler for more nodes (spares beyond --nodes)")
        plan = Nodes(hosts=list(hosts), use=nodes, argv=lambda host: node_step_argv(host, per_node, cmd))
        address = _source_address(hosts[0]) or socket.gethostname()
        driver = Driver(_args(cmd, np_, min_np, reset_limit, address), nodes=plan, environ=env)
    code = driver.run()
    if code:
        raise JobFailedError(f"the elastic job failed (exit code {code}): the lines above say why",
                             exit_code=code)
    return 0

