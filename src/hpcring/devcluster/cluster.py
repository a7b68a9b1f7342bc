"""A real Slurm cluster on one machine: library API behind `hpcring devcluster`.

``up()`` starts munge, a private MariaDB, slurmdbd, slurmctld and N slurmd "nodes". Each node is a
network namespace (``/run/netns/node<i>``, ``eth0`` = 10.99.0.<i>/24 on the bridge ``hpcbr0``,
10.99.0.254) plus persistent mount and UTS namespaces (private ``/tmp`` and ``/dev/shm``, hostname
``node<i>``); its slurmd and every job step it starts live in those namespaces. Every step checks
before it acts, so ``up()`` is idempotent and repairs a half-built cluster. ``down()`` removes all of
it. Nothing here prints; errors are :class:`hpcring.errors.DevClusterError`.
"""
from __future__ import annotations

import fcntl
import json
import os
import pwd
import secrets
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcring.errors import DevClusterError

from . import configs, network
from . import names as n
from .system import (
    log_tail,
    ns_inode,
    ok,
    output,
    pid_is,
    pids_by_exe,
    pids_in_ns,
    proc_cmdline,
    read_pid,
    run,
    terminate,
    wait_for,
)

__all__ = ["ClusterInfo", "NodeInfo", "up", "down", "status", "node_exec_argv"]

REQUIRED_COMMANDS = {
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sinfo": "slurm-wlm", "scontrol": "slurm-wlm",
    "slurmdbd": "slurmdbd", "sacctmgr": "slurm-wlm", "munged": "munge", "munge": "munge",
    "unmunge": "munge", "mariadbd": "mariadb-server", "mariadb": "mariadb-server",
    "mariadb-install-db": "mariadb-server", "ip": "iproute2", "nsenter": "util-linux",
    "unshare": "util-linux", "runuser": "util-linux", "mountpoint": "util-linux",
}
NODE_HEALTHY_STATES = {"idle", "mixed", "allocated", "completing"}
IDLE_DEADLINE_S = 40.0
INSTALL_HINT = "install the system packages first: sudo scripts/install-system-deps.sh"


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


# ---------------------------------------------------------------------------- public API


def node_exec_argv(node: str) -> list[str]:
    """argv prefix that runs a command inside ``node``'s network, mount and UTS namespaces."""
    try:
        i = n.node_index(node)
    except ValueError:
        raise DevClusterError(
            f"no dev cluster node named {node!r}", hint="nodes are named node1 .. nodeN"
        ) from None
    if not network.netns_ok(i) or not (
        network.is_nsfs_mount(n.mnt_ns_file(i)) and network.is_nsfs_mount(n.uts_ns_file(i))
    ):
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
    _check_prerequisites()
    t0 = time.monotonic()
    actions: list[str] = []
    with _lock():
        _up_locked(nodes, dead_interface, actions, list(shares or []))
    info = _info(nodes, dead_interface)
    info.elapsed_s = round(time.monotonic() - t0, 2)
    info.actions = actions
    return info


def down() -> None:
    """Stop every daemon we started and remove namespaces, links, bridge and the /etc/hosts block."""
    _check_root()
    with _lock():
        _down_locked()


def status() -> dict:
    """State of the cluster: ``state`` is 'up', 'down' or 'degraded'; ``problems`` says why."""
    saved = _load_state()
    n_nodes = saved.get("nodes", 0)
    dead_wanted = saved.get("dead_interface", True)
    indices = sorted(set(range(1, n_nodes + 1)) | set(network.existing_node_netns()))
    links = network.root_links()
    daemons = {
        "munged": _daemon_status(_munged_pid(), ["munged"]),
        "mysqld": _daemon_status(_mysqld_pid(), ["mariadbd", "mysqld"]),
        "slurmdbd": _daemon_status(read_pid(n.SLURMDBD_PID_FILE), ["slurmdbd"]),
        "slurmctld": _daemon_status(read_pid(n.SLURMCTLD_PID_FILE), ["slurmctld"]),
    }
    sinfo = _sinfo_states() if daemons["slurmctld"]["alive"] else {}
    node_rows = []
    problems = [f"{name} not running" for name, d in daemons.items() if not d["alive"]]
    bridge_ok = network.bridge_ok(links)
    if not bridge_ok:
        problems.append(f"bridge {n.BRIDGE} missing, down or without {n.BRIDGE_ADDR}")
    for i in indices:
        name = n.node_name(i)
        pid = read_pid(n.slurmd_pid_file(i))
        alive = _slurmd_healthy(i, pid)
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
        elif daemons["slurmctld"]["alive"] and _base_state(sinfo.get(name)) not in NODE_HEALTHY_STATES:
            problems.append(f"{name}: sinfo state {sinfo.get(name)!r}")
    anything = (
        any(d["alive"] for d in daemons.values())
        or bool(network.existing_node_netns())
        or n.BRIDGE in links
        or bool(network.existing_our_links())
    )
    if not anything:
        state = "down"
    elif problems or n_nodes == 0:
        state = "degraded"
    else:
        state = "up"
    return {
        "state": state,
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


# ---------------------------------------------------------------------------- up


def _up_locked(nodes: int, dead_interface: bool, actions: list[str], shares: list[str]) -> None:
    _ensure_dirs()
    controller = n.controller_host()
    password = _db_password()

    # Config files first: the Slurm commands used below read them.
    slurm_conf_changed = _write_if_changed(n.SLURM_CONF, configs.slurm_conf(nodes, controller), 0o644)
    dbd_conf_changed = _write_if_changed(n.SLURMDBD_CONF, configs.slurmdbd_conf(controller, password), 0o600)
    if slurm_conf_changed:
        actions.append(f"wrote {n.SLURM_CONF}")
    if dbd_conf_changed:
        actions.append(f"wrote {n.SLURMDBD_CONF}")
    shares = sorted(set(shares) | set(_load_state().get("shares", [])))
    _save_state({"nodes": nodes, "dead_interface": dead_interface, "shares": shares})
    _ensure_hosts_block(nodes, actions)

    # Nodes beyond the requested count (from an earlier, bigger cluster) go away.
    for i in network.existing_node_netns():
        if i > nodes:
            _remove_node(i)
            actions.append(f"removed {n.node_name(i)}")

    _ensure_munge(actions)
    mysqld_started = _ensure_mysqld_started(actions)

    # Network and node namespaces while MariaDB starts.
    if not network.bridge_ok():
        network.ensure_bridge()
        actions.append(f"created bridge {n.BRIDGE}")
    renewed: set[int] = set()
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
        for path in network.ensure_shares(i, [p for p in shares if os.path.exists(p)]):
            actions.append(f"shared {path} with {n.node_name(i)}")

    _wait_mysqld(started=mysqld_started)
    _ensure_database(password)
    _ensure_slurmdbd(restart=dbd_conf_changed, actions=actions)
    _ensure_cluster_registered(actions)
    _ensure_slurmctld(restart=slurm_conf_changed, actions=actions)
    for i in range(1, nodes + 1):
        _ensure_slurmd(i, restart=slurm_conf_changed or i in renewed, actions=actions)
    _wait_nodes_idle(nodes, actions)
    _wait_accounting_sees_cluster()


def _check_root() -> None:
    if os.geteuid() != 0:
        raise DevClusterError(
            "the dev cluster needs root (network namespaces, mounts, daemons)",
            hint="run it as root, e.g. `sudo hpcring devcluster up`",
        )


def _check_prerequisites() -> None:
    _check_root()
    missing = sorted({pkg for cmd, pkg in REQUIRED_COMMANDS.items() if not shutil.which(cmd)})
    if missing:
        cmds = sorted(cmd for cmd, pkg in REQUIRED_COMMANDS.items() if not shutil.which(cmd))
        raise DevClusterError(
            f"commands missing for the dev cluster: {', '.join(cmds)} (packages {', '.join(missing)})",
            hint=INSTALL_HINT,
        )
    for user in ("munge", "mysql"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise DevClusterError(f"system user {user!r} does not exist", hint=INSTALL_HINT) from None


@contextmanager
def _lock():
    n.STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(n.STATE_DIR / "lock", "w") as f:
        deadline = time.monotonic() + 180
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DevClusterError(
                        f"another `hpcring devcluster` command holds {n.STATE_DIR / 'lock'} for 3 min",
                        hint="wait for it to finish, or find it with `fuser -v "
                        f"{n.STATE_DIR / 'lock'}`",
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_dirs() -> None:
    for d in (n.STATE_DIR, n.RUN_DIR, n.NODES_DIR, n.CTLD_STATE_DIR, n.LOG_DIR, n.SLURM_CONF_DIR):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
    n.SHARED_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(n.SHARED_DIR, 0o1777)


def _write_if_changed(path: Path, text: str, mode: int) -> bool:
    try:
        if path.read_text() == text:
            os.chmod(path, mode)
            return False
    except OSError:
        pass
    tmp = path.with_name(path.name + ".hpcring-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def _load_state() -> dict:
    try:
        return json.loads(n.CLUSTER_STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _save_state(state: dict) -> None:
    _write_if_changed(n.CLUSTER_STATE_FILE, json.dumps(state, indent=1) + "\n", 0o644)


def _db_password() -> str:
    try:
        pw = n.DB_PASSWORD_FILE.read_text().strip()
        if pw:
            return pw
    except OSError:
        pass
    pw = secrets.token_hex(16)
    fd = os.open(n.DB_PASSWORD_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(pw + "\n")
    return pw


# ---------------------------------------------------------------------------- /etc/hosts


def _hosts_without_block(text: str) -> str:
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.strip() == n.HOSTS_BEGIN:
            inside = True
            continue
        if inside and line.strip() == n.HOSTS_END:
            inside = False
            continue
        if not inside:
            out.append(line)
    return "".join(out)


def _rewrite_hosts(new_text: str) -> None:
    # In place (no rename): /etc/hosts is often a bind mount in containers.
    with open(n.HOSTS_FILE, "r+") as f:
        f.seek(0)
        f.write(new_text)
        f.truncate()


def _ensure_hosts_block(nodes: int, actions: list[str]) -> None:
    text = n.HOSTS_FILE.read_text()
    base = _hosts_without_block(text)
    if base and not base.endswith("\n"):
        base += "\n"
    new = base + configs.hosts_block(nodes)
    if new != text:
        _rewrite_hosts(new)
        actions.append(f"updated {n.HOSTS_FILE}")


def _remove_hosts_block() -> None:
    try:
        text = n.HOSTS_FILE.read_text()
    except OSError:
        return
    new = _hosts_without_block(text)
    if new != text:
        _rewrite_hosts(new)


# ---------------------------------------------------------------------------- munge


def _munge_works() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=5, stdin=subprocess.DEVNULL)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=5)
        return dec.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _munged_pid() -> int | None:
    pid = read_pid(n.MUNGE_PID_FILE)
    if pid_is(pid, ["munged"]) and str(n.MUNGE_LOG) in proc_cmdline(pid):  # type: ignore[arg-type]
        return pid
    ours = [p for p in pids_by_exe(["munged"]) if str(n.MUNGE_LOG) in proc_cmdline(p)]
    return ours[0] if ours else None


def _ensure_munge(actions: list[str]) -> None:
    if _munge_works():
        return
    munge_user = pwd.getpwnam("munge")
    uid, gid = munge_user.pw_uid, munge_user.pw_gid
    key = n.MUNGE_KEY
    if not key.exists() or key.stat().st_size < 32:
        key.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        actions.append(f"created {key}")
    os.chown(key.parent, uid, gid)
    os.chmod(key.parent, 0o700)
    os.chown(key, uid, gid)
    os.chmod(key, 0o400)
    for d, mode in ((n.MUNGE_RUN_DIR, 0o755), (Path("/var/lib/munge"), 0o700), (Path("/var/log/munge"), 0o700)):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, uid, gid)
        os.chmod(d, mode)
    if not n.MUNGE_LOG.exists():
        n.MUNGE_LOG.touch(mode=0o640)
    os.chown(n.MUNGE_LOG, uid, gid)
    os.chmod(n.MUNGE_LOG, 0o640)
    stale = _munged_pid()
    if stale:
        terminate([stale], grace=3)
    if n.MUNGE_SOCKET.exists() and not _munge_works():
        # a socket nobody answers on (munged was killed): munged refuses to start over a live one
        for p in (n.MUNGE_SOCKET, Path(str(n.MUNGE_SOCKET) + ".lock")):
            p.unlink(missing_ok=True)
    run(
        ["runuser", "-u", "munge", "--", "munged", f"--log-file={n.MUNGE_LOG}",
         f"--pid-file={n.MUNGE_PID_FILE}", f"--socket={n.MUNGE_SOCKET}"],
        what="starting munged", log=n.MUNGE_LOG, timeout=20,
        hint=f"see {n.MUNGE_LOG}; the key {key} must be owned by munge, mode 0400",
    )
    if not wait_for(_munge_works, timeout=10):
        raise DevClusterError(
            "munged started but `munge -n | unmunge` still fails after 10 s" + log_tail(n.MUNGE_LOG),
            hint=f"see {n.MUNGE_LOG}",
        )
    actions.append("started munged")


# ---------------------------------------------------------------------------- MariaDB


def _mysql_cmd(sql: str | None = None) -> list[str]:
    argv = ["mariadb", "--no-defaults", f"--socket={n.MYSQL_SOCKET}", "-u", "root", "--batch"]
    if sql is not None:
        argv += ["-e", sql]
    return argv


def _mysqld_pid() -> int | None:
    pid = read_pid(n.MYSQL_PID_FILE)
    if pid_is(pid, ["mariadbd", "mysqld"]):
        return pid
    ours = [p for p in pids_by_exe(["mariadbd", "mysqld"]) if str(n.MYSQL_DATA_DIR) in proc_cmdline(p)]
    return ours[0] if ours else None


def _mysqld_responds() -> bool:
    return ok(_mysql_cmd("SELECT 1"), timeout=5)


def _ensure_mysqld_started(actions: list[str]) -> bool:
    """Start our MariaDB if it is not running; True when it was started (wait with _wait_mysqld)."""
    pid = _mysqld_pid()
    if pid and _mysqld_responds():
        return False
    if pid:
        terminate([pid], grace=15)
    mysql = pwd.getpwnam("mysql")
    n.MYSQL_RUN_DIR.mkdir(parents=True, exist_ok=True)
    os.chown(n.MYSQL_RUN_DIR, mysql.pw_uid, mysql.pw_gid)
    if not n.MYSQL_LOG.exists():
        n.MYSQL_LOG.touch(mode=0o640)
    os.chown(n.MYSQL_LOG, mysql.pw_uid, mysql.pw_gid)
    if not (n.MYSQL_DATA_DIR / "mysql").is_dir():
        shutil.rmtree(n.MYSQL_DATA_DIR, ignore_errors=True)
        run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={n.MYSQL_DATA_DIR}", "--user=mysql",
             "--auth-root-authentication-method=socket", "--skip-test-db"],
            what=f"initialising the MariaDB data directory {n.MYSQL_DATA_DIR}", timeout=120,
            hint=f"remove {n.MYSQL_DATA_DIR} and run `up` again",
        )
        actions.append(f"initialised MariaDB in {n.MYSQL_DATA_DIR}")
    log = open(n.MYSQL_LOG, "ab")
    try:
        subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={n.MYSQL_DATA_DIR}", f"--socket={n.MYSQL_SOCKET}",
             f"--pid-file={n.MYSQL_PID_FILE}", f"--port={n.MYSQL_PORT}", "--bind-address=127.0.0.1",
             f"--log-error={n.MYSQL_LOG}", "--user=mysql", "--skip-name-resolve",
             "--innodb-buffer-pool-size=64M", "--performance-schema=OFF"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
        )
    finally:
        log.close()
    actions.append("started mariadbd")
    return True


def _wait_mysqld(started: bool) -> None:
    if not started:
        return
    if not wait_for(_mysqld_responds, timeout=40, interval=0.2):
        raise DevClusterError(
            f"MariaDB (datadir {n.MYSQL_DATA_DIR}, socket {n.MYSQL_SOCKET}, port {n.MYSQL_PORT}) "
            "did not answer within 40 s" + log_tail(n.MYSQL_LOG),
            hint=f"see {n.MYSQL_LOG}; is port {n.MYSQL_PORT} taken (`ss -ltnp`)?",
        )


def _ensure_database(password: str) -> None:
    run(_mysql_cmd(), input=configs.db_setup_sql(password), what="creating the accounting database",
        log=n.MYSQL_LOG)


# ---------------------------------------------------------------------------- slurmdbd


def _sacctmgr_clusters() -> list[list[str]] | None:
    out = output(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster,controlhost"], timeout=10)
    if out is None:
        return None
    return [line.split("|") for line in out.splitlines() if line.strip()]


def _ensure_slurmdbd(restart: bool, actions: list[str]) -> None:
    pid = read_pid(n.SLURMDBD_PID_FILE)
    alive = pid_is(pid, ["slurmdbd"])
    if alive and not restart and _sacctmgr_clusters() is not None:
        return
    terminate([pid] if alive else [], grace=10)  # type: ignore[list-item]
    terminate(pids_by_exe(["slurmdbd"]), grace=10)
    _start_daemon(["slurmdbd"], what="starting slurmdbd", log=n.SLURMDBD_LOG)
    if not wait_for(lambda: _sacctmgr_clusters() is not None, timeout=30, interval=0.3):
        raise DevClusterError(
            f"slurmdbd did not answer `sacctmgr list cluster` within 30 s (port {n.SLURMDBD_PORT})"
            + log_tail(n.SLURMDBD_LOG),
            hint=f"see {n.SLURMDBD_LOG}; check {n.SLURMDBD_CONF} (mode 0600) and MariaDB ({n.MYSQL_LOG})",
        )
    actions.append("started slurmdbd")


def _ensure_cluster_registered(actions: list[str]) -> None:
    clusters = _sacctmgr_clusters() or []
    if any(row[0] == n.CLUSTER_NAME for row in clusters):
        return
    run(["sacctmgr", "-i", "add", "cluster", n.CLUSTER_NAME], what="registering the cluster with slurmdbd",
        log=n.SLURMDBD_LOG)
    actions.append(f"registered cluster {n.CLUSTER_NAME} in slurmdbd")


def _wait_accounting_sees_cluster() -> None:
    def sees() -> bool:
        rows = _sacctmgr_clusters() or []
        return any(row[0] == n.CLUSTER_NAME and len(row) > 1 and row[1].strip() for row in rows)

    if not wait_for(sees, timeout=30, interval=0.5):
        raise DevClusterError(
            f"`sacctmgr list cluster` does not show {n.CLUSTER_NAME} with a control host within 30 s "
            "(slurmctld has not registered with slurmdbd)" + log_tail(n.SLURMCTLD_LOG),
            hint=f"see {n.SLURMCTLD_LOG} and {n.SLURMDBD_LOG}",
        )


# ---------------------------------------------------------------------------- slurmctld / slurmd


def _start_daemon(argv: list[str], *, what: str, log: Path) -> None:
    """Run a self-daemonising command; its early stderr goes to ``log``."""
    with open(log, "ab") as f:
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=30,
                               start_new_session=True)
        except subprocess.TimeoutExpired:
            raise DevClusterError(f"{what}: `{' '.join(argv)}` did not return within 30 s" + log_tail(log),
                                  hint=f"see {log}") from None
    if p.returncode != 0:
        raise DevClusterError(f"{what}: `{' '.join(argv)}` exited with {p.returncode}" + log_tail(log),
                              hint=f"see {log}")


def _ctld_responds() -> bool:
    out = output(["scontrol", "ping"], timeout=5)
    return out is not None and "is UP" in out


def _ensure_slurmctld(restart: bool, actions: list[str]) -> bool:
    pid = read_pid(n.SLURMCTLD_PID_FILE)
    alive = pid_is(pid, ["slurmctld"])
    if alive and not restart and _ctld_responds():
        return False
    terminate(pids_by_exe(["slurmctld"]), grace=10)
    _start_daemon(["slurmctld"], what="starting slurmctld", log=n.SLURMCTLD_LOG)
    if not wait_for(_ctld_responds, timeout=20, interval=0.3):
        raise DevClusterError(
            f"slurmctld did not answer `scontrol ping` within 20 s (port {n.SLURMCTLD_PORT})"
            + log_tail(n.SLURMCTLD_LOG),
            hint=f"see {n.SLURMCTLD_LOG}; check {n.SLURM_CONF}",
        )
    actions.append("started slurmctld")
    return True


def _slurmd_healthy(i: int, pid: int | None) -> bool:
    if not pid_is(pid, ["slurmd"]):
        return False
    inodes = network.ns_inodes(i)
    return (
        inodes["net"] is not None
        and ns_inode(f"/proc/{pid}/ns/net") == inodes["net"]
        and ns_inode(f"/proc/{pid}/ns/mnt") == inodes["mnt"]
        and ns_inode(f"/proc/{pid}/ns/uts") == inodes["uts"]
    )


def _ensure_slurmd(i: int, restart: bool, actions: list[str]) -> None:
    name = n.node_name(i)
    pid = read_pid(n.slurmd_pid_file(i))
    if not restart and _slurmd_healthy(i, pid):
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
    _start_daemon(network.exec_argv(i) + ["slurmd", "-N", name], what=f"starting slurmd of {name}",
                  log=n.slurmd_log(i))
    if not wait_for(lambda: _slurmd_healthy(i, read_pid(n.slurmd_pid_file(i))), timeout=15):
        raise DevClusterError(
            f"slurmd of {name} is not running in its namespaces 15 s after start "
            f"(pid file {n.slurmd_pid_file(i)})" + log_tail(n.slurmd_log(i)),
            hint=f"see {n.slurmd_log(i)}",
        )
    actions.append(f"started slurmd of {name}")


def _base_state(state: str | None) -> str:
    return (state or "").rstrip("*~#!%$@^-+").lower()


def _responding_and_healthy(state: str | None) -> bool:
    return _base_state(state) in NODE_HEALTHY_STATES and not (state or "").endswith("*")


def _sinfo_states() -> dict[str, str]:
    out = output(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10)
    states: dict[str, str] = {}
    for line in (out or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def _wait_nodes_idle(nodes: int, actions: list[str]) -> None:
    names = [n.node_name(i) for i in range(1, nodes + 1)]
    resumed: set[str] = set()
    reconfigured = False
    start = time.monotonic()
    deadline = start + IDLE_DEADLINE_S
    states: dict[str, str] = {}
    while True:
        states = _sinfo_states()
        bad = [x for x in names if not _responding_and_healthy(states.get(x))]
        if not bad:
            return
        not_responding = [x for x in bad if _base_state(states.get(x)) in NODE_HEALTHY_STATES]
        if not_responding and not reconfigured and (resumed or time.monotonic() - start > 2):
            # "idle*" (no response yet, e.g. right after a resume) clears at the next ping, up to
            # SlurmdTimeout/3 later; a reconfigure makes every slurmd answer now.
            ok(["scontrol", "reconfigure"])
            reconfigured = True
        for x in bad:
            # Its slurmd is healthy (checked before), so a node an admin or an earlier fault left
            # drained is resumed at once; a down one only if registering did not bring it back.
            base = _base_state(states.get(x))
            if x not in resumed and (
                base in {"drained", "draining"}
                or (base in {"down", "fail", "failing"} and time.monotonic() - start > 3)
            ):
                if ok(["scontrol", "update", f"NodeName={x}", "State=RESUME"]):
                    actions.append(f"resumed {x} (was {base})")
                resumed.add(x)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.3)
    bad = [x for x in names if not _responding_and_healthy(states.get(x))]
    detail = ", ".join(f"{x}={states.get(x, 'absent')}" for x in bad)
    tails = "".join(log_tail(n.slurmd_log(n.node_index(x)), 10) for x in bad[:2])
    raise DevClusterError(
        f"nodes not idle in sinfo after {IDLE_DEADLINE_S:.0f} s: {detail}" + tails + log_tail(n.SLURMCTLD_LOG, 10),
        hint="see `scontrol show node <name>` (Reason=) and the slurmd logs in " + str(n.LOG_DIR),
    )


# ---------------------------------------------------------------------------- down


def _remove_node(i: int) -> None:
    inodes = network.ns_inodes(i)
    victims: list[int] = []
    for kind in ("net", "mnt"):
        if inodes[kind]:
            victims += pids_in_ns(kind, inodes[kind])  # type: ignore[arg-type]
    terminate(victims, grace=10)
    network.remove_node_links(i)
    network.remove_node_ns(i)
    network.remove_netns(i)
    n.slurmd_pid_file(i).unlink(missing_ok=True)


def _down_locked() -> None:
    saved = _load_state()
    indices = set(range(1, saved.get("nodes", 0) + 1)) | set(network.existing_node_netns())
    for link in network.existing_our_links():
        indices.add(int(link.split("node", 1)[1]))
    # Job steps and slurmds first (everything inside node namespaces), then the controller side.
    node_victims: list[int] = []
    for i in sorted(indices):
        inodes = network.ns_inodes(i)
        for kind in ("net", "mnt"):
            if inodes[kind]:
                node_victims += pids_in_ns(kind, inodes[kind])  # type: ignore[arg-type]
    node_victims += pids_by_exe(["slurmd", "slurmstepd"])
    terminate(node_victims, grace=10)
    terminate(pids_by_exe(["slurmctld"]), grace=15)
    terminate(pids_by_exe(["slurmdbd"]), grace=10)
    mysqld = _mysqld_pid()
    terminate([mysqld] if mysqld else [], grace=20)
    munged = [p for p in pids_by_exe(["munged"]) if str(n.MUNGE_LOG) in proc_cmdline(p)]
    terminate(munged, grace=5)

    for i in sorted(indices):
        network.remove_node_links(i)
        network.remove_node_ns(i)
        network.remove_netns(i)
    network.remove_bridge()
    if network.mount_of(n.NS_DIR):
        ok(["umount", str(n.NS_DIR)]) or ok(["umount", "-l", str(n.NS_DIR)])
    _remove_hosts_block()
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
    if _mysqld_pid():
        left.append(f"mariadbd pid {_mysqld_pid()}")
    munged = [p for p in pids_by_exe(["munged"]) if str(n.MUNGE_LOG) in proc_cmdline(p)]
    if munged:
        left.append(f"munged pids {munged}")
    if network.existing_node_netns():
        left.append(f"network namespaces {['node%d' % i for i in network.existing_node_netns()]}")
    links = network.existing_our_links()
    if links:
        left.append(f"links {links}")
    if n.BRIDGE in network.root_links():
        left.append(f"bridge {n.BRIDGE}")
    if n.HOSTS_BEGIN in n.HOSTS_FILE.read_text():
        left.append(f"block in {n.HOSTS_FILE}")
    return left


# ---------------------------------------------------------------------------- helpers


def _daemon_status(pid: int | None, exe: list[str]) -> dict:
    return {"pid": pid, "alive": pid_is(pid, exe)}


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
