"""Text of the Slurm config files the dev cluster writes (pure functions, no I/O)."""
from __future__ import annotations

from . import names as n


def slurm_conf(nodes: int, controller: str) -> str:
    node_lines = "\n".join(
        f"NodeName={n.node_name(i)} NodeAddr={n.node_addr(i)} NodeHostname={n.node_name(i)} "
        f"CPUs={n.NODE_CPUS} RealMemory={n.NODE_REAL_MEMORY_MB} State=UNKNOWN"
        for i in range(1, nodes + 1)
    )
    nodelist = "node1" if nodes == 1 else f"node[1-{nodes}]"
    return f"""{n.CONF_MARKER} -- edits are overwritten.
# A real Slurm cluster on one machine: each slurmd runs in its own network namespace
# (/run/netns/nodeN) with its own address on the bridge {n.BRIDGE} ({n.BRIDGE_ADDR}/{n.PREFIX_LEN}).
ClusterName={n.CLUSTER_NAME}
SlurmctldHost={controller}({n.BRIDGE_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort={n.SLURMCTLD_PORT}
SlurmdPort={n.SLURMD_PORT}
StateSaveLocation={n.CTLD_STATE_DIR}
SlurmdSpoolDir={n.NODES_DIR}/%n/spool
SlurmctldPidFile={n.SLURMCTLD_PID_FILE}
SlurmdPidFile={n.RUN_DIR}/slurmd-%n.pid
SlurmctldLogFile={n.SLURMCTLD_LOG}
SlurmdLogFile={n.LOG_DIR}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# The machine has fewer cores than the nodes declare; no cgroup confinement here.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
TmpFS=/tmp
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=300
# Accounting through slurmdbd (so that sacct works); reachable from every node namespace.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={n.BRIDGE_ADDR}
AccountingStoragePort={n.SLURMDBD_PORT}
JobCompType=jobcomp/none

{node_lines}
PartitionName={n.PARTITION} Nodes={nodelist} Default=YES MaxTime={n.PARTITION_MAX_TIME} State=UP
"""


def slurmdbd_conf(controller: str, db_password: str) -> str:
    return f"""{n.CONF_MARKER} -- edits are overwritten. Mode 0600 (holds a password).
AuthType=auth/munge
DbdHost={controller}
DbdAddr={n.BRIDGE_ADDR}
DbdPort={n.SLURMDBD_PORT}
SlurmUser=root
DebugLevel=info
LogFile={n.SLURMDBD_LOG}
PidFile={n.SLURMDBD_PID_FILE}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={n.MYSQL_PORT}
StorageUser={n.ACCT_DB_USER}
StoragePass={db_password}
StorageLoc={n.ACCT_DB}
"""


def db_setup_sql(db_password: str) -> str:
    pw = db_password.replace("\\", "\\\\").replace("'", "\\'")
    return f"""
CREATE DATABASE IF NOT EXISTS {n.ACCT_DB};
CREATE USER IF NOT EXISTS '{n.ACCT_DB_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}';
CREATE USER IF NOT EXISTS '{n.ACCT_DB_USER}'@'localhost' IDENTIFIED BY '{pw}';
ALTER USER '{n.ACCT_DB_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}';
ALTER USER '{n.ACCT_DB_USER}'@'localhost' IDENTIFIED BY '{pw}';
GRANT ALL ON {n.ACCT_DB}.* TO '{n.ACCT_DB_USER}'@'127.0.0.1';
GRANT ALL ON {n.ACCT_DB}.* TO '{n.ACCT_DB_USER}'@'localhost';
FLUSH PRIVILEGES;
"""


def hosts_block(nodes: int) -> str:
    """Every address the dev cluster creates, with a name: the nodes, the machine's end of the
    bridge and the fault-injection addresses. torch (c10d) and MPI look up the peer of every
    connection; an address without a line here went to DNS, which no node can reach."""
    named = [(n.node_addr(i), n.node_name(i)) for i in range(1, nodes + 1)]
    named.append((n.BRIDGE_ADDR, n.BRIDGE_HOSTNAME))
    named += [(n.dead_addr(i), n.dead_name(i)) for i in range(1, nodes + 1)]
    lines = [n.HOSTS_BEGIN]
    lines += [f"{addr}\t{name}" for addr, name in named]
    # A dual-stack listener (torch's TCPStore) sees IPv4 clients as ::ffff:a.b.c.d, and glibc's
    # files backend does not map those back to the IPv4 line. After the IPv4 lines, so forward
    # lookups keep answering the IPv4 address first.
    lines += [f"::ffff:{addr}\t{name}" for addr, name in named]
    lines.append(n.HOSTS_END)
    return "\n".join(lines) + "\n"


def resolv_conf() -> str:
    return (f"{n.RESOLV_MARKER} (bound over /etc/resolv.conf inside each node by `hpcring devcluster up`)\n"
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
