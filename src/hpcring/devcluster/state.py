"""The dev cluster's own files: the lock, its directories, the saved state and config writes.

``cluster.json`` remembers what the last `up` asked for (node count, dead interface, shares) so
that `status` and `down` know what to look for and a later `up` keeps earlier ``--share`` paths.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

from hpcring.errors import DevClusterError

from . import names as n

LOCK_DEADLINE_S = 180.0


@contextmanager
def lock():
    """Hold the devcluster lock (one `up`/`down` at a time); waits up to 3 min for another."""
    n.STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(n.STATE_DIR / "lock", "w") as f:
        deadline = time.monotonic() + LOCK_DEADLINE_S
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


def ensure_dirs() -> None:
    for d in (n.STATE_DIR, n.RUN_DIR, n.NODES_DIR, n.CTLD_STATE_DIR, n.LOG_DIR, n.SLURM_CONF_DIR):
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
    n.SHARED_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(n.SHARED_DIR, 0o1777)  # every user's jobs write their folders here, like /tmp


def write_if_changed(path: Path, text: str, mode: int) -> bool:
    """Write ``text`` atomically with ``mode``; True when the content changed.

    The answer decides whether daemons reading the file must restart, so an unchanged file is
    not rewritten (only its mode is fixed)."""
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


def load_state() -> dict:
    """What the last `up` asked for ({} when there was none or the file is unreadable)."""
    try:
        return json.loads(n.CLUSTER_STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def save_state(state: dict) -> None:
    write_if_changed(n.CLUSTER_STATE_FILE, json.dumps(state, indent=1) + "\n", 0o644)


def db_password() -> str:
    """The accounting database password: created once (random), then reused across `up`s."""
    try:
        pw = n.DB_PASSWORD_FILE.read_text().strip()
        if pw:
            return pw
    except OSError:
        pass
    pw = secrets.token_hex(16)
    write_if_changed(n.DB_PASSWORD_FILE, pw + "\n", 0o600)
    return pw
