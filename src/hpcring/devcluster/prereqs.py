"""What the dev cluster needs from this machine: root, the system packages, the daemon users.

Checked before `up` touches anything, so a missing package is one clear error rather than a
half-built cluster failing in the middle.
"""
from __future__ import annotations

import os
import pwd
import shutil

from hpcring.errors import DevClusterError

# command -> Debian package that provides it (named in the error, for scripts/install-system-deps.sh)
REQUIRED_COMMANDS = {
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sinfo": "slurm-wlm", "scontrol": "slurm-wlm",
    "slurmdbd": "slurmdbd", "sacctmgr": "slurm-wlm", "munged": "munge", "munge": "munge",
    "unmunge": "munge", "mariadbd": "mariadb-server", "mariadb": "mariadb-server",
    "mariadb-install-db": "mariadb-server", "ip": "iproute2", "nsenter": "util-linux",
    "unshare": "util-linux", "runuser": "util-linux", "mountpoint": "util-linux",
}
INSTALL_HINT = "install the system packages first: sudo scripts/install-system-deps.sh"


def check_root() -> None:
    """Raise DevClusterError unless we are root (namespaces, mounts and daemons need it)."""
    if os.geteuid() != 0:
        raise DevClusterError(
            "the dev cluster needs root (network namespaces, mounts, daemons)",
            hint="run it as root, e.g. `sudo hpcring devcluster up`",
        )


def check_prerequisites() -> None:
    """Raise DevClusterError naming every missing command (and its package) or daemon user."""
    check_root()
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
