"""Taking the dev cluster apart: one surplus node (a smaller `up`), or everything (`down`).

Processes end before their namespaces go: a job step still inside a node would keep its mount
namespace alive and its veth busy. `down` then checks that nothing is left and says what is.
"""
from __future__ import annotations

from hpcring.errors import DevClusterError

from . import accounting, hosts, munge, network, state
from . import names as n
from .system import mount_of, ok, pids_by_exe, pids_in_ns, terminate


def _node_pids(i: int) -> list[int]:
    """Every process inside node i's network or mount namespace (slurmd, job steps, shells)."""
    inodes = network.ns_inodes(i)
    pids: list[int] = []
    for kind in ("net", "mnt"):
        if inodes[kind]:
            pids += pids_in_ns(kind, inodes[kind])  # type: ignore[arg-type]
    return pids


def remove_node(i: int) -> None:
    """End node i's processes and remove its namespaces, links and slurmd pid file."""
    terminate(_node_pids(i), grace=10)
    network.remove_node(i)
    n.slurmd_pid_file(i).unlink(missing_ok=True)


def down_locked() -> None:
    """Stop every daemon we started and remove all we built; the caller holds the lock."""
    saved = state.load_state()
    indices = set(range(1, saved.get("nodes", 0) + 1)) | set(network.existing_node_netns())
    for link in network.existing_our_links():
        indices.add(int(link.split("node", 1)[1]))
    # Job steps and slurmds first (everything inside node namespaces), then the controller side.
    node_victims: list[int] = []
    for i in sorted(indices):
        node_victims += _node_pids(i)
    node_victims += pids_by_exe(["slurmd", "slurmstepd"])
    terminate(node_victims, grace=10)
    terminate(pids_by_exe(["slurmctld"]), grace=15)
    terminate(pids_by_exe(["slurmdbd"]), grace=10)
    mysqld = accounting.mysqld_pid()
    terminate([mysqld] if mysqld else [], grace=20)
    terminate(munge.our_pids(), grace=5)

    for i in sorted(indices):
        network.remove_node(i)
    network.remove_bridge()
    if mount_of(n.NS_DIR):
        ok(["umount", str(n.NS_DIR)]) or ok(["umount", "-l", str(n.NS_DIR)])
    hosts.remove_block()
    for f in [n.SLURMCTLD_PID_FILE, n.SLURMDBD_PID_FILE, *n.RUN_DIR.glob("slurmd-*.pid")]:
        f.unlink(missing_ok=True)

    left = _leftovers()
    if left:
        raise DevClusterError(
            "dev cluster not fully removed: " + "; ".join(left),
            hint="run `hpcring devcluster down` again; if it persists, remove them by hand "
            "(kill <pid>, ip link del <name>, ip netns del <name>)",
        )


def _leftovers() -> list[str]:
    left = []
    for exe in ("slurmctld", "slurmd", "slurmdbd", "slurmstepd"):
        pids = pids_by_exe([exe])
        if pids:
            left.append(f"{exe} pids {pids}")
    mysqld = accounting.mysqld_pid()
    if mysqld:
        left.append(f"mariadbd pid {mysqld}")
    munged = munge.our_pids()
    if munged:
        left.append(f"munged pids {munged}")
    if network.existing_node_netns():
        left.append(f"network namespaces {['node%d' % i for i in network.existing_node_netns()]}")
    links = network.existing_our_links()
    if links:
        left.append(f"links {links}")
    if n.BRIDGE in network.root_links():
        left.append(f"bridge {n.BRIDGE}")
    if hosts.has_block():
        left.append(f"block in {n.HOSTS_FILE}")
    return left
