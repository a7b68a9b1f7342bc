"""Small helpers over subprocess, /proc and mounts. Every wait has a deadline."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from hpcring.errors import DevClusterError

from .names import NETNS_DIR


def log_tail(path: Path | str, lines: int = 25) -> str:
    """Last ``lines`` lines of a log file, indented, for error messages ('' when unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    tail = text.splitlines()[-lines:]
    if not tail:
        return ""
    return f"\n  last lines of {path}:\n" + "\n".join(f"    {line}" for line in tail)


def run(
    argv: Sequence[str],
    *,
    what: str,
    check: bool = True,
    timeout: float = 30.0,
    input: str | None = None,
    log: Path | None = None,
    hint: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command with a deadline; on failure raise DevClusterError naming ``what``."""
    try:
        proc = subprocess.run(
            list(argv),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except FileNotFoundError as e:
        raise DevClusterError(
            f"{what}: command not found: {argv[0]}",
            hint="install the system packages: sudo scripts/install-system-deps.sh",
        ) from e
    except subprocess.TimeoutExpired as e:
        raise DevClusterError(
            f"{what}: `{shlex.join(argv)}` did not finish within {timeout:.0f} s"
            + (log_tail(log) if log else ""),
            hint=hint,
        ) from e
    if check and proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise DevClusterError(
            f"{what}: `{shlex.join(argv)}` exited with {proc.returncode}"
            + (f": {out}" if out else "")
            + (log_tail(log) if log else ""),
            hint=hint,
        )
    return proc


def ok(argv: Sequence[str], timeout: float = 10.0) -> bool:
    """True when the command exits 0 within the deadline (never raises)."""
    try:
        return (
            subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def output(argv: Sequence[str], timeout: float = 10.0) -> str | None:
    """stdout of the command, or None when it fails or misses the deadline (never raises)."""
    try:
        p = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def wait_for(
    cond: Callable[[], bool], *, timeout: float, interval: float = 0.2
) -> bool:
    """Poll ``cond`` until it is true or ``timeout`` seconds pass; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def start_daemon(argv: list[str], *, what: str, log: Path) -> None:
    """Run a self-daemonising command; its early stderr goes to ``log``.

    Not :func:`run`: the daemon inherits stdout/stderr, so pipes would never reach EOF."""
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


# ---------------------------------------------------------------------------- processes


def read_pid(pid_file: Path) -> int | None:
    try:
        text = pid_file.read_text().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def proc_exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def proc_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def pid_is(pid: int | None, exe_names: Iterable[str]) -> bool:
    """True when ``pid`` is alive and its executable's basename is one of ``exe_names``."""
    if not proc_alive(pid):
        return False
    exe = proc_exe(pid)  # type: ignore[arg-type]
    if exe is None:
        return False
    # Debian installs the Slurm daemons as alternatives: /usr/sbin/slurmd -> slurmd-wlm.
    base = os.path.basename(exe.removesuffix(" (deleted)")).removesuffix("-wlm")
    return base in set(exe_names)


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def our_net_inodes() -> set[int]:
    """Network namespaces of this cluster: ours and its nodes' (the namespaces bound in NETNS_DIR)."""
    inodes = {ns_inode("/proc/self/ns/net")}
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        names = []
    inodes |= {ns_inode(NETNS_DIR / name) for name in names}
    return {i for i in inodes if i is not None}


def pids_by_exe(exe_names: Iterable[str]) -> list[int]:
    """Processes of this cluster running one of ``exe_names``. A second Slurm release's cluster
    runs the same programs in network namespaces of its own: they are not ours to stop."""
    names = set(exe_names)
    nets = our_net_inodes()
    return [p for p in all_pids()
            if p != os.getpid() and pid_is(p, names) and ns_inode(f"/proc/{p}/ns/net") in nets]


def ns_inode(path: Path | str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in_ns(kind: str, inode: int) -> list[int]:
    """Processes whose namespace of ``kind`` ('net', 'mnt', 'uts') has inode ``inode``."""
    me = os.getpid()
    return [p for p in all_pids() if p != me and ns_inode(f"/proc/{p}/ns/{kind}") == inode]


def proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def terminate(pids: Iterable[int], *, grace: float = 10.0) -> list[int]:
    """SIGTERM, wait up to ``grace`` s, then SIGKILL what is left; returns pids still alive."""
    pids = [p for p in set(pids) if proc_alive(p)]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    wait_for(lambda: not any(proc_alive(p) for p in pids), timeout=grace, interval=0.1)
    left = [p for p in pids if proc_alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not any(proc_alive(p) for p in left), timeout=5.0, interval=0.05)
    return [p for p in left if proc_alive(p)]


# ---------------------------------------------------------------------------- mounts


def mountinfo() -> list[dict[str, str]]:
    """Our mount table: mount point, fs type and optional fields per line."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            mnt_point = fields[4].replace("\\040", " ")
            optional = " ".join(fields[6:])
            fstype = right.split()[0] if right else ""
            rows.append({"target": mnt_point, "fstype": fstype, "optional": optional})
    return rows


def mount_of(path: Path | str) -> dict[str, str] | None:
    """The topmost mount exactly at ``path`` (None when ``path`` is not a mount point)."""
    found = None
    for row in mountinfo():
        if row["target"] == str(path):
            found = row
    return found


def is_nsfs_mount(path: Path | str) -> bool:
    m = mount_of(path)
    return bool(m and m["fstype"] == "nsfs")
