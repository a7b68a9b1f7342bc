"""A real Slurm cluster on one machine: library API behind `hpcring devcluster`.

``up()`` starts munge, a private MariaDB, slurmdbd, slurmctld and N slurmd "nodes". Each node is a
network namespace (``/run/netns/node<i>``, ``eth0`` = 10.99.0.<i>/24 on the bridge ``hpcbr0``,
10.99.0.254) plus persistent mount and UTS namespaces (private ``/tmp`` and ``/dev/shm``, hostname
``node<i>``); its slurmd and every job step it starts live in those namespaces. Every step checks
before it acts, so ``up()`` is idempotent and repairs a half-built cluster. ``down()`` removes all of
it. Nothing here prints; errors are :class:`hpcring.errors.DevClusterError`.

This module holds the public API and the order of the steps; each step lives with its concern:
``prereqs`` (root, packages), ``state`` (lock, directories, saved state, config writes), ``hosts``
(/etc/hosts block), ``network`` (bridge, namespaces, veths, shares), ``munge``, ``accounting``
(MariaDB, slurmdbd), ``slurm_daemons`` (slurmctld, slurmd), ``readiness`` (sinfo, wait for idle),
``health`` (status), ``teardown`` (down); ``configs`` and ``names`` hold the file texts and names.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

from hpcring.errors import DevClusterError

from . import accounting, configs, hosts, munge, network, prereqs, readiness, slurm_daemons, state, teardown
from . import names as n
from .health import status

__all__ = ["ClusterInfo", "NodeInfo", "up", "down", "status", "node_exec_argv"]


@dataclass
class NodeInfo:
    name: str
    address: str
    namespace: str  # network namespace name (/run/netns/<namespace>)
    veth: str  # root-namespace end of the node's veth pair, on the bridge
    dead_address: str | None
    dead_veth: str | None


@dataclass
class ClusterInfo:
    cluster: str
    partition: str
    bridge: str
    bridge_address: str
    nodes: list[NodeInfo]
    shared_dir: str
    slurm_conf: str
    state_dir: str
    log_dir: str
    elapsed_s: float = 0.0
    actions: list[str] = field(default_factory=list)  # what this `up` had to do ([] = was up)

    def to_dict(self) -> dict:
        return asdict(self)


def node_exec_argv(node: str) -> list[str]:
    """argv prefix that runs a command inside ``node``'s network, mount and UTS namespaces."""
    try:
        i = n.node_index(node)
    except ValueError:
        raise DevClusterError(
            f"no dev cluster node named {node!r}", hint="nodes are named node1 .. nodeN"
        ) from None
    if not network.netns_ok(i) or not network.node_ns_files_ok(i):
        raise DevClusterError(
            f"dev cluster node {node} does not exist (no namespaces at {n.netns_path(i)}, "
            f"{n.mnt_ns_file(i)})",
            hint="start the cluster with `hpcring devcluster up` (see `hpcring devcluster status`)",
        )
    return network.exec_argv(i)


def up(nodes: int = 3, dead_interface: bool = True, shares: list[str] | None = None) -> ClusterInfo:
    """Bring the dev cluster up (or repair it); returns when all nodes are idle in sinfo."""
    if not 1 <= nodes <= n.MAX_NODES:
        raise DevClusterError(
            f"--nodes must be between 1 and {n.MAX_NODES}, got {nodes}", hint="e.g. --nodes 3"
        )
    prereqs.check_prerequisites()
    t0 = time.monotonic()
    actions: list[str] = []
    with state.lock():
        _up_locked(nodes, dead_interface, actions, list(shares or []))
    info = _info(nodes, dead_interface)
    info.elapsed_s = round(time.monotonic() - t0, 2)
    info.actions = actions
    return info


def down() -> None:
    """Stop every daemon we started and remove namespaces, links, bridge and the /etc/hosts block."""
    prereqs.check_root()
    with state.lock():
        teardown.down_locked()


def _up_locked(nodes: int, dead_interface: bool, actions: list[str], shares: list[str]) -> None:
    state.ensure_dirs()
    controller = n.controller_host()
    password = state.db_password()

    # Config files first: the Slurm commands used below read them.
    slurm_conf_changed = state.write_if_changed(n.SLURM_CONF, configs.slurm_conf(nodes, controller), 0o644)
    dbd_conf_changed = state.write_if_changed(
        n.SLURMDBD_CONF, configs.slurmdbd_conf(controller, password), 0o600)
    if slurm_conf_changed:
        actions.append(f"wrote {n.SLURM_CONF}")
    if dbd_conf_changed:
        actions.append(f"wrote {n.SLURMDBD_CONF}")
    shares = sorted(set(shares) | set(state.load_state().get("shares", [])))
    state.save_state({"nodes": nodes, "dead_interface": dead_interface, "shares": shares})
    hosts.ensure_block(nodes, actions)

    # Nodes beyond the requested count (from an earlier, bigger cluster) go away.
    for i in network.existing_node_netns():
        if i > nodes:
            teardown.remove_node(i)
            actions.append(f"removed {n.node_name(i)}")

    munge.ensure(actions)
    mysqld_started = accounting.start_mysqld(actions)

    # Network and node namespaces while MariaDB starts.
    if not network.bridge_ok():
        network.ensure_bridge()
        actions.append(f"created bridge {n.BRIDGE}")
    renewed: set[int] = set()  # nodes whose namespaces are new: their slurmd must restart inside
    for i in range(1, nodes + 1):
        had_netns = network.netns_ok(i)
        if network.node_net_problems(i, dead_interface):
            network.ensure_node_net(i, dead_interface)
            actions.append(f"set up network of {n.node_name(i)}")
            if not had_netns:
                renewed.add(i)
        if network.ensure_node_ns(i):
            actions.append(f"created mount/UTS namespaces of {n.node_name(i)}")
            renewed.add(i)
        if network.ensure_resolver(i):
            actions.append(f"bound the node resolver into {n.node_name(i)}")
        for path in network.ensure_shares(i, [p for p in shares if os.path.exists(p)]):
            actions.append(f"shared {path} with {n.node_name(i)}")

    accounting.wait_mysqld(started=mysqld_started)
    accounting.ensure_database(password)
    accounting.ensure_slurmdbd(restart=dbd_conf_changed, actions=actions)
    accounting.ensure_cluster_registered(actions)
    slurm_daemons.ensure_slurmctld(restart=slurm_conf_changed, actions=actions)
    for i in range(1, nodes + 1):
        slurm_daemons.ensure_slurmd(i, restart=slurm_conf_changed or i in renewed, actions=actions)
    readiness.wait_nodes_idle(nodes, actions)
    accounting.wait_accounting_sees_cluster()


def _info(nodes: int, dead_interface: bool) -> ClusterInfo:
    return ClusterInfo(
        cluster=n.CLUSTER_NAME,
        partition=n.PARTITION,
        bridge=n.BRIDGE,
        bridge_address=f"{n.BRIDGE_ADDR}/{n.PREFIX_LEN}",
        nodes=[
            NodeInfo(
                name=n.node_name(i),
                address=n.node_addr(i),
                namespace=n.netns_name(i),
                veth=n.veth_root(i),
                dead_address=n.dead_addr(i) if dead_interface else None,
                dead_veth=n.dead_root(i) if dead_interface else None,
            )
            for i in range(1, nodes + 1)
        ],
        shared_dir=str(n.SHARED_DIR),
        slurm_conf=str(n.SLURM_CONF),
        state_dir=str(n.STATE_DIR),
        log_dir=str(n.LOG_DIR),
    )
