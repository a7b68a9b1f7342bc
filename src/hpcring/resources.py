"""Where the bundled templates and site configs are.

In a wheel they sit inside the package (hpcring/templates, hpcring/site_configs); in a source
checkout or an editable install they are the top-level folders of the repository.
"""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    inside = _PKG / name
    if inside.is_dir():
        return inside
    repo = _PKG.parent.parent / name  # src/hpcring -> repo root
    if repo.is_dir():
        return repo
    raise FileNotFoundError(f"bundled folder {name!r} not found next to {_PKG}")


def templates_dir() -> Path:
    return _find("templates")


def site_configs_dir() -> Path:
    return _find("site_configs")
