"""``.hpcringignore``: what a copy to the login node leaves out (hpcring.remote's rsync), read from
the script's folder and turned into rsync filter rules that keep what git would keep.

Standard library only (hpcring.remote imports it at start-up).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from hpcring.errors import UsageError

IGNORE_FILE = ".hpcringignore"
# Left out of every copy unless .hpcringignore re-includes them (gitignore order: later lines win).
DEFAULT_EXCLUDES = (".git/", ".hg/", ".svn/", "__pycache__/", "*.pyc", ".venv/", ".tox/", ".mypy_cache/",
                    ".pytest_cache/", ".ipynb_checkpoints/", ".DS_Store", "*.egg-info/")


def ignore_rules(lines: Sequence[str], defaults: Sequence[str] = DEFAULT_EXCLUDES) -> list[str]:
    """gitignore-style patterns (``defaults`` first, then ``lines``) as rsync filter rules.

    git lets the last matching pattern win and rsync the first, so the rules come out in reverse;
    ``!pat`` re-includes (``+``). A pattern with a '/' before its end is anchored at the folder
    (as git does; rsync would match it at any depth), a leading ``**/`` matches at any depth.
    """
    rules = []
    for raw in [*defaults, *lines]:
        text = raw.rstrip("\n").rstrip("\r")
        stripped = re.sub(r"(?<!\\) +$", "", text)       # trailing spaces go unless escaped
        if not stripped or stripped.startswith("#"):
            continue
        include = stripped.startswith("!")
        pat = stripped[1:] if include else stripped
        if pat.startswith(("\\#", "\\!")):
            pat = pat[1:]
        pat = pat.replace("\\ ", " ")
        while pat.startswith("**/"):
            pat = pat[3:]
            if "/" in pat.rstrip("/"):
                pat = "**/" + pat      # still has a slash: rsync matches ** against the full path
                break
        if not pat or pat == "/":
            continue
        if "/" in pat.rstrip("/") and not pat.startswith(("/", "**/")):
            pat = "/" + pat
        rules.append(("+ " if include else "- ") + pat)
    return rules[::-1]


def read_ignore(folder: Path) -> list[str]:
    """The lines of ``folder/.hpcringignore`` (none: an empty list); a file that cannot be read is
    an error naming it."""
    path = folder / IGNORE_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}",
                         hint="fix its permissions or remove it") from None
    if len(data) > 1 << 20:
        raise UsageError(f"{path} is {len(data)} bytes; an ignore file is a list of patterns (at most 1 MiB)",
                         hint="keep one gitignore-style pattern per line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 at byte {exc.start}", hint="save it as UTF-8 text") from None
    for n, line in enumerate(text.splitlines(), 1):
        if any(ord(c) < 0x20 and c != "\t" for c in line):
            raise UsageError(f"{path}:{n}: a control character in a pattern", hint="one plain pattern per line")
    return text.splitlines()
