"""YAML loading that remembers where each key came from, so errors can say file:line key.path."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hpcring.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that records the line of every mapping key and sequence item."""


def load_with_lines(path: Path) -> tuple[Any, dict[tuple, int]]:
    """Parse ``path`` safely; return (data, {key path tuple: 1-based line}).

    Raises ConfigError naming the file and line on YAML syntax errors.
    """
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}",
                          hint="fix the YAML syntax (indentation, quotes, colons)") from None
    lines: dict[tuple, int] = {}
    if node is None:
        return {}, lines
    _index(node, (), lines)
    data = yaml.load(text, Loader=yaml.SafeLoader)
    return data, lines


def _index(node: yaml.Node, path: tuple, lines: dict[tuple, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            lines[path + (key,)] = key_node.start_mark.line + 1
            _index(value_node, path + (key,), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _index(item, path + (i,), lines)


def line_of(lines: dict[tuple, int], loc: tuple) -> int | None:
    """Line of the deepest known prefix of ``loc`` (pydantic locations may go below YAML keys)."""
    loc = tuple(loc)
    while loc:
        if loc in lines:
            return lines[loc]
        loc = loc[:-1]
    return lines.get(())
