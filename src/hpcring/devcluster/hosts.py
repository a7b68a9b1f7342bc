"""The dev cluster's block in /etc/hosts: node names resolve on the machine and in every node.

Only the lines between ``names.HOSTS_BEGIN`` and ``names.HOSTS_END`` are ours; the rest of the
file is left as it was.
"""
from __future__ import annotations

from . import configs
from . import names as n


def without_block(text: str) -> str:
    """``text`` (of /etc/hosts) without our block."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.strip() == n.HOSTS_BEGIN:
            inside = True
            continue
        if inside and line.strip() == n.HOSTS_END:
            inside = False
            continue
        if not inside:
            out.append(line)
    return "".join(out)


def _rewrite(new_text: str) -> None:
    # In place (no rename): /etc/hosts is often a bind mount in containers.
    with open(n.HOSTS_FILE, "r+") as f:
        f.seek(0)
        f.write(new_text)
        f.truncate()


def ensure_block(nodes: int, actions: list[str]) -> None:
    """Make our block name node1..node<nodes> (rewrites the file only when that changes it)."""
    text = n.HOSTS_FILE.read_text()
    base = without_block(text)
    if base and not base.endswith("\n"):
        base += "\n"
    new = base + configs.hosts_block(nodes)
    if new != text:
        _rewrite(new)
        actions.append(f"updated {n.HOSTS_FILE}")


def remove_block() -> None:
    try:
        text = n.HOSTS_FILE.read_text()
    except OSError:
        return
    new = without_block(text)
    if new != text:
        _rewrite(new)


def has_block() -> bool:
    return n.HOSTS_BEGIN in n.HOSTS_FILE.read_text()
