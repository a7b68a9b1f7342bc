"""slurmctld on the machine, and one slurmd per node inside that node's namespaces.

A slurmd counts as running only when it lives in its node's current network, mount and UTS
namespaces: after a namespace is rebuilt, an old slurmd would serve the wrong /tmp and address.
"""
from __future__ import annotations

from hpcring.errors import DevClusterError

from . import names as n
from . import network
from .system import log_tail, ns_inode, output, pid_is, pids_by_exe, read_pid, start_daemon, terminate, wait_for


def _ctld_responds() -> bool:
    out = output(["scontrol", "ping"], timeout=5)
    return out is not None and "is UP" in out


def ensure_slurmctld(restart: bool, actions: list[str]) -> bool:
    """(Re)start slurmctld when it does not answer `scontrol ping` or ``restart``; True if started."""
    pid = read_pid(n.SLURMCTLD_PID_FILE)
    alive = pid_is(pid, ["slurmctld"])
    if alive and not restart and _ctld_responds():
        return False
    terminate(pids_by_exe(["slurmctld"]), grace=10)
    start_daemon(["slurmctld"], what="starting slurmctld", log=n.SLURMCTLD_LOG)
    if not wait_for(_ctld_responds, timeout=20, interval=0.3):
        raise DevClusterError(
            f"slurmctld did not answer `scontrol ping` within 20 s (port {n.SLURMCTLD_PORT})"
            + log_tail(n.SLURMCTLD_LOG),
            hint=f"see {n.SLURMCTLD_LOG}; check {n.SLURM_CONF}",
        )
    actions.append("started slurmctld")
    return True


def slurmd_healthy(i: int, pid: int | None) -> bool:
    """``pid`` is a live slurmd in node i's current network, mount and UTS namespaces."""
    if not pid_is(pid, ["slurmd"]):
        return False
    inodes = network.ns_inodes(i)
    return (
        inodes["net"] is not None
        and ns_inode(f"/proc/{pid}/ns/net") == inodes["net"]
        and ns_inode(f"/proc/{pid}/ns/mnt") == inodes["mnt"]
        and ns_inode(f"/proc/{pid}/ns/uts") == inodes["uts"]
    )


def ensure_slurmd(i: int, restart: bool, actions: list[str]) -> None:
    """(Re)start node i's slurmd inside its namespaces unless a healthy one runs (and no ``restart``)."""
    name = n.node_name(i)
    pid = read_pid(n.slurmd_pid_file(i))
    if not restart and slurmd_healthy(i, pid):
        return
    # Any slurmd of this node: by pid file, or any slurmd process inside its network namespace.
    net = network.ns_inodes(i)["net"]
    victims = [p for p in pids_by_exe(["slurmd"]) if net and ns_inode(f"/proc/{p}/ns/net") == net]
    if pid_is(pid, ["slurmd"]):
        victims.append(pid)  # type: ignore[arg-type]
    terminate(victims, grace=10)
    spool = n.node_dir(i) / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    n.slurmd_pid_file(i).unlink(missing_ok=True)
    start_daemon(network.exec_argv(i) + ["slurmd", "-N", name], what=f"starting slurmd of {name}",
                 log=n.slurmd_log(i))
    if not wait_for(lambda: slurmd_healthy(i, read_pid(n.slurmd_pid_file(i))), timeout=15):
        raise DevClusterError(
            f"slurmd of {name} is not running in its namespaces 15 s after start "
            f"(pid file {n.slurmd_pid_file(i)})" + log_tail(n.slurmd_log(i)),
            hint=f"see {n.slurmd_log(i)}",
        )
    actions.append(f"started slurmd of {name}")
