"""One way to write a small state file: JSON, atomically (readers never see half a file)."""
from __future__ import annotations

import json
import os
from pathlib import Path


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

