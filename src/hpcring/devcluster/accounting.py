"""Job accounting: a private MariaDB (port names.MYSQL_PORT, 127.0.0.1 only) and slurmdbd.

sacct works on the dev cluster as on a real one. MariaDB is started early and waited for later
(:func:`start_mysqld` then :func:`wait_mysqld`), so its start overlaps building the node namespaces.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess

from hpcring.errors import DevClusterError

from . import configs
from . import names as n
from .system import (log_tail, ok, output, pid_is, pids_by_exe, proc_cmdline, read_pid, run,
                     start_daemon, terminate, wait_for)

MYSQL_EXES = ["mariadbd", "mysqld"]


def _mysql_cmd(sql: str | None = None) -> list[str]:
    argv = ["mariadb", "--no-defaults", f"--socket={n.MYSQL_SOCKET}", "-u", "root", "--batch"]
    if sql is not None:
        argv += ["-e", sql]
    return argv


def mysqld_pid() -> int | None:
    pid = read_pid(n.MYSQL_PID_FILE)
    if pid_is(pid, MYSQL_EXES):
        return pid
    # A system MariaDB may run too: ours is the one serving our data directory.
    ours = [p for p in pids_by_exe(MYSQL_EXES) if str(n.MYSQL_DATA_DIR) in proc_cmdline(p)]
    return ours[0] if ours else None


def _mysqld_responds() -> bool:
    return ok(_mysql_cmd("SELECT 1"), timeout=5)


def start_mysqld(actions: list[str]) -> bool:
    """Start our MariaDB if it is not running; True when it was started (wait with wait_mysqld)."""
    pid = mysqld_pid()
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


def wait_mysqld(started: bool) -> None:
    if not started:
        return
    if not wait_for(_mysqld_responds, timeout=40, interval=0.2):
        raise DevClusterError(
            f"MariaDB (datadir {n.MYSQL_DATA_DIR}, socket {n.MYSQL_SOCKET}, port {n.MYSQL_PORT}) "
            "did not answer within 40 s" + log_tail(n.MYSQL_LOG),
            hint=f"see {n.MYSQL_LOG}; is port {n.MYSQL_PORT} taken (`ss -ltnp`)?",
        )


def ensure_database(password: str) -> None:
    run(_mysql_cmd(), input=configs.db_setup_sql(password), what="creating the accounting database",
        log=n.MYSQL_LOG)


def _sacctmgr_clusters() -> list[list[str]] | None:
    """``[[cluster, controlhost], ...]`` from slurmdbd; None when slurmdbd does not answer."""
    out = output(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster,controlhost"], timeout=10)
    if out is None:
        return None
    return [line.split("|") for line in out.splitlines() if line.strip()]


def ensure_slurmdbd(restart: bool, actions: list[str]) -> None:
    """(Re)start slurmdbd when it is not answering or ``restart`` (its config changed)."""
    pid = read_pid(n.SLURMDBD_PID_FILE)
    alive = pid_is(pid, ["slurmdbd"])
    if alive and not restart and _sacctmgr_clusters() is not None:
        return
    terminate([pid] if alive else [], grace=10)  # type: ignore[list-item]
    terminate(pids_by_exe(["slurmdbd"]), grace=10)
    start_daemon(["slurmdbd"], what="starting slurmdbd", log=n.SLURMDBD_LOG)
    if not wait_for(lambda: _sacctmgr_clusters() is not None, timeout=30, interval=0.3):
        raise DevClusterError(
            f"slurmdbd did not answer `sacctmgr list cluster` within 30 s (port {n.SLURMDBD_PORT})"
            + log_tail(n.SLURMDBD_LOG),
            hint=f"see {n.SLURMDBD_LOG}; check {n.SLURMDBD_CONF} (mode 0600) and MariaDB ({n.MYSQL_LOG})",
        )
    actions.append("started slurmdbd")


def ensure_cluster_registered(actions: list[str]) -> None:
    clusters = _sacctmgr_clusters() or []
    if any(row[0] == n.CLUSTER_NAME for row in clusters):
        return
    run(["sacctmgr", "-i", "add", "cluster", n.CLUSTER_NAME], what="registering the cluster with slurmdbd",
        log=n.SLURMDBD_LOG)
    actions.append(f"registered cluster {n.CLUSTER_NAME} in slurmdbd")


def wait_accounting_sees_cluster() -> None:
    """Wait until slurmctld has registered with slurmdbd (jobs before that are not accounted)."""
    def sees() -> bool:
        rows = _sacctmgr_clusters() or []
        return any(row[0] == n.CLUSTER_NAME and len(row) > 1 and row[1].strip() for row in rows)

    if not wait_for(sees, timeout=30, interval=0.5):
        raise DevClusterError(
            f"`sacctmgr list cluster` does not show {n.CLUSTER_NAME} with a control host within 30 s "
            "(slurmctld has not registered with slurmdbd)" + log_tail(n.SLURMCTLD_LOG),
            hint=f"see {n.SLURMCTLD_LOG} and {n.SLURMDBD_LOG}",
        )
