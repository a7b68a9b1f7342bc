"""munged: the credential daemon Slurm authenticates with (one key, shared by every node).

Nodes are namespaces on this machine, so one munged (socket /run/munge, not inside any node's
private /tmp) serves the controller and every slurmd.
"""
from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

from hpcring.errors import DevClusterError

from . import names as n
from .system import log_tail, pid_is, pids_by_exe, proc_cmdline, read_pid, run, terminate, wait_for


def works() -> bool:
    """True when a credential round trip (`munge -n | unmunge`) succeeds within 5 s each."""
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=5, stdin=subprocess.DEVNULL)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=5)
        return dec.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def our_pids() -> list[int]:
    # A system munged may run too: ours is the one writing our log file.
    return [p for p in pids_by_exe(["munged"]) if str(n.MUNGE_LOG) in proc_cmdline(p)]


def munged_pid() -> int | None:
    pid = read_pid(n.MUNGE_PID_FILE)
    if pid_is(pid, ["munged"]) and str(n.MUNGE_LOG) in proc_cmdline(pid):  # type: ignore[arg-type]
        return pid
    ours = our_pids()
    return ours[0] if ours else None


def ensure(actions: list[str]) -> None:
    """Start munged (creating the key and its directories) unless credentials already work."""
    if works():
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
    # munged refuses to start unless the key and its directories are its own and private.
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
    stale = munged_pid()
    if stale:
        terminate([stale], grace=3)
    if n.MUNGE_SOCKET.exists() and not works():
        # a socket nobody answers on (munged was killed): munged refuses to start over a live one
        for p in (n.MUNGE_SOCKET, Path(str(n.MUNGE_SOCKET) + ".lock")):
            p.unlink(missing_ok=True)
    run(
        ["runuser", "-u", "munge", "--", "munged", f"--log-file={n.MUNGE_LOG}",
         f"--pid-file={n.MUNGE_PID_FILE}", f"--socket={n.MUNGE_SOCKET}"],
        what="starting munged", log=n.MUNGE_LOG, timeout=20,
        hint=f"see {n.MUNGE_LOG}; the key {key} must be owned by munge, mode 0400",
    )
    if not wait_for(works, timeout=10):
        raise DevClusterError(
            "munged started but `munge -n | unmunge` still fails after 10 s" + log_tail(n.MUNGE_LOG),
            hint=f"see {n.MUNGE_LOG}",
        )
    actions.append("started munged")
