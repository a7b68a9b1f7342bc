"""A node's preflight file, ``DIR/<host>.json``: its one writer and its one reader.

The file is an envelope written atomically (:func:`hpcring.fsutil.write_json`)::

    {"format": "hpcring-preflight-v1", "host": "node2", "mac": "<hex>", "body": "<JSON text>"}

``mac`` is HMAC-SHA256 with the job secret over the format, the host and the body text, so a file
from another job, one renamed to another host's name, or one edited by hand is refused; the body
is parsed only after its MAC matched. The body is a JSON object whose ``state`` is
``"listening"`` (written first: where the node listens) or ``"done"`` (everything it measured).
"""
from __future__ import annotations

import hmac
import json
import os
import re
from pathlib import Path

from hpcring.bootstrap import auth
from hpcring.fsutil import write_json

FORMAT = "hpcring-preflight-v1"
MAX_FILE_BYTES = 1 << 20          # a node's record is a few KiB; anything bigger is not ours
_HOST_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class BadRecord(Exception):
    """A file that exists but cannot be used; ``str()`` is a one-line reason."""


def check_host(host: str) -> str:
    """``host`` as a file name component, or ValueError (no separators, no leading dot)."""
    if not isinstance(host, str) or not _HOST_OK.fullmatch(host):
        raise ValueError(f"host name {host!r} cannot name a preflight file "
                         "(letters, digits, '.', '_', '-'; not starting with '.' or '-')")
    return host


def path_of(folder: str | os.PathLike, host: str) -> Path:
    return Path(folder) / f"{check_host(host)}.json"


def _mac(secret: bytes, host: str, body: str) -> str:
    return auth.mac(secret, FORMAT.encode(), b"\0", host.encode(), b"\0", body.encode()).hex()


def write_record(folder: str | os.PathLike, host: str, body: dict, secret: bytes) -> None:
    """Sign and write ``body`` as ``DIR/<host>.json``, atomically. OSError propagates."""
    text = json.dumps({**body, "host": host}, separators=(",", ":"), allow_nan=False)
    write_json(path_of(folder, host), {"format": FORMAT, "host": host, "mac": _mac(secret, host, text), "body": text})


def read_record(folder: str | os.PathLike, host: str, secret: bytes) -> dict | None:
    """The verified body of ``host``'s file; None when it does not exist (yet).

    Raises BadRecord (never anything else) for a file that is unreadable, too big, not the
    envelope, signed with another secret or for another host, or whose body is not an object."""
    path = path_of(folder, host)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadRecord(f"cannot read {path.name}: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise BadRecord(f"{path.name} is larger than {MAX_FILE_BYTES} bytes")
    try:
        env = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadRecord(f"{path.name} is not JSON ({type(e).__name__})") from None
    if not isinstance(env, dict) or env.get("format") != FORMAT:
        raise BadRecord(f"{path.name} is not a {FORMAT} file")
    mac, body, named = env.get("mac"), env.get("body"), env.get("host")
    if not isinstance(mac, str) or not isinstance(body, str) or not isinstance(named, str):
        raise BadRecord(f"{path.name}: its mac, host or body is missing or not text")
    if named != host:
        raise BadRecord(f"{path.name} was written for host {named[:64]!r}")
    if not hmac.compare_digest(mac.encode("ascii", "replace"), _mac(secret, host, body).encode()):
        raise BadRecord(f"{path.name} is not signed with this job's secret (another job's, or edited)")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise BadRecord(f"{path.name}: its body is not JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise BadRecord(f"{path.name}: its body is not an object")
    return data
