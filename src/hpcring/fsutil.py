"""One way to write a small state file: JSON, atomically (readers never see half a file); and one
check that an output file named on the command line can be written, before anything starts."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpcring.config.text import check_text, shown
from hpcring.errors import UsageError


def write_json(path: str | os.PathLike, data, *, indent: int | None = None) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``.

    The temporary name carries the pid: ranks of one job sharing a folder never clobber each
    other's temporary file. Raises OSError (callers that must not fail twice catch it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=indent))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)


def check_output_path(path: str, what: str) -> None:
    """``path`` can be written (its folder exists and is writable; it is not a folder), checked
    before any rank starts: a bad --json used to fail on rank 0 after the whole run."""
    hint = f"give {what} a file in an existing, writable folder"
    try:
        check_text(path)
        target = Path(path)
        folder = target.parent
        if target.is_dir():
            raise UsageError(f"{what} {shown(path)} is a folder, not a file", hint=hint)
        if not folder.is_dir():
            raise UsageError(f"{what} {shown(path)}: folder {shown(str(folder))} does not exist", hint=hint)
        if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
            raise UsageError(f"{what} {shown(path)} is not writable", hint=hint)
    except (ValueError, OSError) as exc:       # control characters, a name too long for the OS
        raise UsageError(f"{what} {shown(path)}: {exc}", hint=hint) from None
