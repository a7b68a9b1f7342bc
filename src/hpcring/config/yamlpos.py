"""YAML loading that remembers where each key came from, so errors can say file:line key.path.

Site configs are small, hand-written mappings, so the loader is deliberately narrow and refuses,
each with the file and line, before building anything: anchors and aliases (a 429-byte "billion
laughs" file would otherwise expand to gigabytes; a recursive alias never ends), complex (non-
scalar) and duplicate keys, explicit tags other than YAML's plain types, nesting deeper than
``MAX_DEPTH``, files over ``MAX_BYTES``, bytes that are not UTF-8, and unquoted numbers that YAML 1.1
reads other than people do (``1_000``, ``010`` = 8, ``1:30`` = 90, ``0x1f``) or too long to be one.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from hpcring.errors import ConfigError

MAX_BYTES = 1 << 20     # a site config is a few kilobytes
MAX_DEPTH = 32
MAX_EVENTS = 100_000
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}
_HINT = "site configs are plain YAML mappings: write values out (no &anchors, *aliases or !tags)"
MAX_NUMBER_CHARS = 40   # no bound of the schema needs more digits; a 5000-digit one is an attack
_NUMBER_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)(\.[0-9]*)?([eE][-+]?[0-9]+)?|[-+]?\.[0-9]+([eE][-+]?[0-9]+)?"
                      r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")


def _fail(path: Path, line: int | None, what: str, hint: str = _HINT) -> ConfigError:
    where = f"{path}:{line}" if line else str(path)
    return ConfigError(f"{where}: {what}", hint=hint)


def _read_text(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read site config {path}: {exc.strerror}",
                          hint="check the path and its permissions") from None
    if len(data) > MAX_BYTES:
        raise _fail(path, None, f"file is larger than {MAX_BYTES} bytes; a site config is a few kilobytes",
                    hint="point --site at the right file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _fail(path, line, f"byte {data[exc.start]:#04x} at offset {exc.start} is not UTF-8",
                    hint="save the file as UTF-8") from None


def _number_problem(value: str) -> str | None:
    """Why an unquoted scalar that YAML reads as a number is refused, None if it is a plain decimal."""
    if len(value) > MAX_NUMBER_CHARS:
        return f"the number {value[:20]}... has {len(value)} characters; no setting takes one that large"
    if _DECIMAL.fullmatch(value):
        return None
    why = ("'_' is a digit separator to YAML" if "_" in value else
           "YAML reads a:b as a base-60 number" if ":" in value else
           "YAML reads a leading 0 as octal and 0x/0b as hex/binary")
    return f"{value} is not a plain decimal number ({why}); write the number in decimal digits, or quote it if it is text"


def _check_events(text: str, path: Path) -> None:
    """Walk the event stream once (no nodes built) and refuse what a site config has no use for."""
    depth = 0
    # per open mapping: [expecting a key?, keys seen]
    maps: list[list] = []
    stack: list[str] = []
    where: list = []    # per open collection, its current key or item index: the key path of a value
    resolver = yaml.resolver.Resolver()
    for n, ev in enumerate(yaml.parse(text, Loader=yaml.SafeLoader)):
        line = ev.start_mark.line + 1 if ev.start_mark else None
        if n > MAX_EVENTS:
            raise _fail(path, line, f"more than {MAX_EVENTS} YAML items; a site config is small")
        if isinstance(ev, yaml.AliasEvent):
            raise _fail(path, line, f"alias *{ev.anchor} is not allowed in a site config")
        if isinstance(ev, yaml.NodeEvent) and ev.anchor is not None:
            raise _fail(path, line, f"anchor &{ev.anchor} is not allowed in a site config")
        tag = getattr(ev, "tag", None)
        if isinstance(ev, (yaml.ScalarEvent, yaml.CollectionStartEvent)) and tag not in (None, "!") \
                and not (isinstance(ev, yaml.ScalarEvent) and ev.implicit[0]) and tag not in _PLAIN_TAGS:
            raise _fail(path, line, f"tag {tag} is not allowed in a site config")
        is_node = isinstance(ev, (yaml.ScalarEvent, yaml.CollectionStartEvent))
        is_key = is_node and bool(stack) and stack[-1] == "map" and maps[-1][0]
        if is_node and stack and stack[-1] == "map":
            maps[-1][0] = not maps[-1][0]
        elif is_node and stack:
            where[-1] += 1   # the sequence's item index
        if isinstance(ev, yaml.ScalarEvent) and ev.implicit[0] and ev.style is None \
                and resolver.resolve(yaml.ScalarNode, ev.value, (True, False)) in _NUMBER_TAGS:
            why = _number_problem(ev.value)
            if why:
                key = ".".join(str(k) for k in (where[:-1] if is_key else where)) or "(top level)"
                raise ConfigError(f"{path}:{line} {key}: {why}", hint="fix the value; `hpcring sites validate` re-checks")
        if is_key:
            if not isinstance(ev, yaml.ScalarEvent):
                raise _fail(path, line, "a key must be plain text, not a list or mapping (complex key)")
            if ev.value in maps[-1][1]:
                raise _fail(path, line, f"key {ev.value!r} appears twice in the same mapping "
                                        f"(first on line {maps[-1][1][ev.value]})",
                            hint="remove one of them (YAML would silently keep the last)")
            maps[-1][1][ev.value] = line
            where[-1] = ev.value
        if isinstance(ev, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _fail(path, line, f"nested deeper than {MAX_DEPTH} levels")
            stack.append("map" if isinstance(ev, yaml.MappingStartEvent) else "seq")
            if stack[-1] == "map":
                maps.append([True, {}])
            where.append(None if stack[-1] == "map" else -1)
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1
            where.pop()
            if stack.pop() == "map":
                maps.pop()


def load_with_lines(path: Path) -> tuple[Any, dict[tuple, int]]:
    """Parse ``path`` safely; return (data, {key path tuple: 1-based line}).

    Raises ConfigError naming the file and line on YAML syntax errors and on everything the
    module docstring lists.
    """
    text = _read_text(path)
    try:
        _check_events(text, path)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        lines: dict[tuple, int] = {}
        if node is None:
            return {}, lines
        _index(node, (), lines)
        data = yaml.load(text, Loader=yaml.SafeLoader)
    except (ValueError, OverflowError) as exc:   # a value YAML resolves but Python cannot build (a date 2024-13-45)
        raise _fail(path, None, f"a value cannot be read: {exc}", hint="quote the value if it is text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise _fail(path, mark.line + 1 if mark else None, f"not valid YAML: {getattr(exc, 'problem', None) or exc}",
                    hint="fix the YAML syntax (indentation, quotes, colons)") from None
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
