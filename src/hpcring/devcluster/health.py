"""`hpcring devcluster status`: what runs, what exists, and what is wrong, without changing anything.

Reads the saved state (what the last `up` asked for), the daemons' pid files, the links and
namespaces, and sinfo; ``problems`` lists every difference, one line each, naming the node.
"""
from __future__ import annotations

import os

from . import accounting, munge, network, readiness, state
from . import names as n
from .slurm_daemons import slurmd_healthy
from .system import pid_is, read_pid


def _daemon_status(pid: int | None, exe: list[str]) -> dict:
    return {"pid": pid, "alive": pid_is(pid, exe)}


def status() -> dict:
    """State of the cluster: ``state`` is 'up', 'down' or 'degraded'; ``problems`` says why."""
    saved = state.load_state()
    n_nodes = saved.get("nodes", 0)
    dead_wanted = saved.get("dead_interface", True)
    indices = sorted(set(range(1, n_nodes + 1)) | set(network.existing_node_netns()))
    links = network.root_links()
    daemons = {
        "munged": _daemon_status(munge.munged_pid(), ["munged"]),
        "mysqld": _daemon_status(accounting.mysqld_pid(), accounting.MYSQL_EXES),
        "slurmdbd": _daemon_status(read_pid(n.SLURMDBD_PID_FILE), ["slurmdbd"]),
        "slurmctld": _daemon_status(read_pid(n.SLURMCTLD_PID_FILE), ["slurmctld"]),
    }
    sinfo = readiness.sinfo_states() if daemons["slurmctld"]["alive"] else {}
    node_rows = []
    problems = [f"{name} not running" for name, d in daemons.items() if not d["alive"]]
    bridge_ok = network.bridge_ok(links)
    if not bridge_ok:
        problems.append(f"bridge {n.BRIDGE} missing, down or without {n.BRIDGE_ADDR}")
    for i in indices:
        name = n.node_name(i)
        pid = read_pid(n.slurmd_pid_file(i))
        alive = slurmd_healthy(i, pid)
        net_problems = network.node_net_problems(i, dead_wanted, links)
        row = {
            "name": name,
            "namespace": n.netns_name(i),
            "namespace_exists": network.netns_ok(i),
            "address": n.node_addr(i),
            "dead_address": n.dead_addr(i) if dead_wanted else None,
            "veth": n.veth_root(i),
            "network_ok": not net_problems,
            "slurmd_pid": pid,
            "slurmd_alive": alive,
            "sinfo_state": sinfo.get(name),
        }
        node_rows.append(row)
        if i > n_nodes:
            problems.append(f"{name}: namespace left over from an earlier cluster")
        problems += net_problems
        if not alive:
            problems.append(f"{name}: slurmd not running in its namespaces")
        elif (daemons["slurmctld"]["alive"]
              and readiness.base_state(sinfo.get(name)) not in readiness.NODE_HEALTHY_STATES):
            problems.append(f"{name}: sinfo state {sinfo.get(name)!r}")
    anything = (
        any(d["alive"] for d in daemons.values())
        or bool(network.existing_node_netns())
        or n.BRIDGE in links
        or bool(network.existing_our_links())
    )
    if not anything:
        state_word = "down"
    elif problems or n_nodes == 0:
        state_word = "degraded"
    else:
        state_word = "up"
    return {
        "state": state_word,
        "slurm": os.environ.get(n.WORLD_ENV) or n.HOST_RELEASE,  # which release's cluster this is
        "cluster": n.CLUSTER_NAME,
        "partition": n.PARTITION,
        "nodes_configured": n_nodes,
        "dead_interface": dead_wanted,
        "bridge": {"name": n.BRIDGE, "address": n.BRIDGE_ADDR, "ok": bridge_ok},
        "daemons": daemons,
        "nodes": node_rows,
        "problems": problems,
        "state_dir": str(n.STATE_DIR),
        "log_dir": str(n.LOG_DIR),
    }
