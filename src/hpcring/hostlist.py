"""Slurm hostlist expressions: ``expand`` one into host names, ``compress`` host names into one.

Contract
--------
``expand(expr, *, max_hosts=DEFAULT_MAX_HOSTS) -> list[str]``
    Returns the hosts in exactly the order ``scontrol show hostnames EXPR`` prints them, duplicates
    kept. Raises :class:`hpcring.errors.HostlistError` (message: what is wrong, the expression, and
    a caret under the position) for every expression Slurm rejects, and for a few that Slurm
    accepts but mangles (listed below). Pure: no I/O, no subprocess.

``compress(hosts) -> str``
    Returns an expression ``e`` with ``expand(e) == list(hosts)`` (order and duplicates
    preserved). Only trailing numbers are bracketed (``n[1-3,7]``), never a suffix after the
    bracket, so the result is also valid for Slurm releases older than 23.02.5. Raises
    :class:`HostlistError` for a host that no expression can denote (empty, whitespace, comma or
    bracket in the name).

Grammar (what Slurm does, checked against ``scontrol`` 22.05 and the 23.x+ sources)
-------------------------------------------------------------------------------
* Tokens are separated by commas or whitespace, any number of them; separators inside brackets do
  not split (``n[1,3] m2`` is two tokens).
* A token is literal text with bracket groups: ``prefix[ranges]middle[ranges]suffix``. A group is
  a comma list of ``N`` or ``LO-HI`` with decimal digits only. The zero padding is the width of LO
  as written (``n[098-102]`` -> ``n098 .. n102``; ``n[1-03]`` -> ``n1 n2 n3``).
* Several groups form a product in Slurm's (surprising) order: the last group varies fastest, then
  the first, second, ... up to the one before last, which varies slowest. ``a[1-2]b[3-4]`` gives
  ``a1b3 a1b4 a2b3 a2b4``; ``a[1-2]b[3-4]c[5-6]`` gives ``a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 ...``.
* Text after the last group (``node[01-10]-ib``) is a suffix, as in Slurm >= 23.02.5; older Slurm
  rejects it.
* Limits as in Slurm: one ``LO-HI`` range at most ``MAX_RANGE`` hosts; a group that is not the last
  one at most ``MAX_PREFIX_COUNT`` hosts in all. On top of that the whole expression may expand to
  at most ``max_hosts`` hosts, so a typo like ``n[0-60000]x[0-60000]`` fails fast instead of
  allocating billions of strings.

Deliberately stricter than Slurm (Slurm accepts these and returns surprising hosts)
-----------------------------------------------------------------------------------
``n[1`` (22.05 gives ``n]``), ``a]b`` (a host named ``a]b``), ``n[ 1-2]`` (gives ``n01 n02``),
``n[1, 2]`` (``n1 n02``: a space inside brackets counts as a padding digit),
``n[+1]`` (``n01``), ``n[1-]`` (``n1``), numbers >= 2**64 (Slurm clamps them), numbers written
with more than ``MAX_DIGITS`` digits (Slurm keeps any zero padding; no host name is that long), a
bad range in a non-last group of a three-group token (22.05 silently returns no hosts). Newlines,
carriage returns, vertical tabs and form feeds are separators here; Slurm would put them into a
host name.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from hpcring.errors import HostlistError

__all__ = ["expand", "compress", "MAX_RANGE", "MAX_PREFIX_COUNT", "MAX_DIGITS", "DEFAULT_MAX_HOSTS"]

MAX_RANGE = 65536          # Slurm's MAX_RANGE: hosts in one LO-HI range
MAX_PREFIX_COUNT = 65536   # Slurm's MAX_PREFIX_CNT: hosts of one group that is not the last
DEFAULT_MAX_HOSTS = 1 << 20
_MAX_NUMBER = 2**64 - 1    # Slurm parses with strtoul; larger numbers are clamped, so refuse them
# Digits of one number as written, zero padding included: a Linux host name has at most 64
# characters (HOST_NAME_MAX). Checked before int(), which refuses more than 4300 digits.
MAX_DIGITS = 64
_SHOWN = 100               # characters of a long expression shown around the caret

SEPARATORS = frozenset(", \t\n\r\v\f")
_WHITESPACE = frozenset(" \t\n\r\v\f")
_HINT = "hostlist syntax: prefix[1-4,7]suffix, items separated by commas or spaces, e.g. node[01-04],gpu7"
_TRAILING_DIGITS = re.compile(r"(\d*)\Z")


@dataclass(frozen=True)
class _Group:
    """One bracket group: the formatted numbers it yields, in order, and where it starts."""

    values: tuple[str, ...]
    pos: int


@dataclass(frozen=True)
class _Token:
    """``texts[0] groups[0] texts[1] ... groups[-1] texts[-1]`` (len(texts) == len(groups) + 1)."""

    texts: tuple[str, ...]
    groups: tuple[_Group, ...]
    pos: int


# ---------------------------------------------------------------------------------------- errors

def _error(expr: str, pos: int, what: str) -> HostlistError:
    """A HostlistError that shows ``expr`` with a caret under ``pos``."""
    # Control whitespace would shift the caret; show it as spaces (same length).
    shown = "".join(" " if c in _WHITESPACE else c for c in expr)
    pos = max(0, min(pos, len(expr)))
    if len(shown) > _SHOWN:     # a window around the caret, not thousands of characters
        start = max(0, min(pos - _SHOWN // 2, len(shown) - _SHOWN))
        head = "..." if start else ""
        tail = "..." if start + _SHOWN < len(shown) else ""
        shown, pos = head + shown[start:start + _SHOWN] + tail, pos - start + len(head)
    return HostlistError(f"invalid hostlist: {what}\n  {shown}\n  {' ' * pos}^", hint=_HINT)


def _cut(text: str, keep: int = 40) -> str:
    """``text`` quoted, its middle elided when long (messages stay short)."""
    return repr(text if len(text) <= keep else text[:keep // 2] + "..." + text[-keep // 2:])


def _too_long(digits: str, where: str) -> str | None:
    """Why ``digits`` (part of ``where``) is not a number a host name can hold, or None."""
    if len(digits) > MAX_DIGITS:
        return (f"number of {len(digits)} digits in {_cut(where)}; at most {MAX_DIGITS} "
                "(no host name is that long)")
    return None


# ---------------------------------------------------------------------------------------- expand

def expand(expr: str, *, max_hosts: int = DEFAULT_MAX_HOSTS) -> list[str]:
    """Hosts of a Slurm hostlist expression, in Slurm's order, duplicates kept.

    Pre: ``expr`` is a str (empty or all separators gives ``[]``); ``max_hosts >= 0``.
    Post: same list as ``scontrol show hostnames expr`` for every expression Slurm accepts and
    this module does not deliberately refuse (see module docstring).
    Raises: HostlistError with the position of the first problem.
    """
    if not isinstance(expr, str):
        raise TypeError(f"hostlist expression must be a str, not {type(expr).__name__}")
    tokens = _tokenize(expr)
    total = 0
    for tok in tokens:
        total += _token_count(expr, tok)
        if total > max_hosts:
            raise _error(expr, tok.pos, f"expands to more than {max_hosts} hosts (limit max_hosts)")
    hosts: list[str] = []
    for tok in tokens:
        hosts.extend(_expand_token(tok))
    return hosts


def _tokenize(expr: str) -> list[_Token]:
    """Split at separators outside brackets and parse each token."""
    tokens: list[_Token] = []
    i, n = 0, len(expr)
    while i < n:
        if expr[i] in SEPARATORS:
            i += 1
            continue
        tok, i = _parse_token(expr, i)
        tokens.append(tok)
    return tokens


def _parse_token(expr: str, start: int) -> tuple[_Token, int]:
    """Parse the token beginning at ``start``; return it and the index just after it."""
    texts: list[str] = []
    groups: list[_Group] = []
    i = text_start = start
    n = len(expr)
    while i < n and expr[i] not in SEPARATORS:
        c = expr[i]
        if c == "]":
            raise _error(expr, i, "']' without a matching '['")
        if c == "[":
            close = _find_close(expr, i)
            texts.append(expr[text_start:i])
            groups.append(_Group(_parse_ranges(expr, i + 1, close), i))
            i = text_start = close + 1
        else:
            i += 1
    texts.append(expr[text_start:i])
    tok = _Token(tuple(texts), tuple(groups), start)
    if not groups:
        _check_plain_host(expr, start, texts[0])
    return tok, i


def _find_close(expr: str, open_pos: int) -> int:
    """Index of the ']' closing the '[' at ``open_pos``."""
    for j in range(open_pos + 1, len(expr)):
        c = expr[j]
        if c == "]":
            return j
        if c == "[":
            raise _error(expr, j, "'[' inside brackets (brackets do not nest)")
        if c in _WHITESPACE:
            raise _error(expr, j, f"whitespace inside brackets (is the '[' at position {open_pos} "
                                  "missing its ']'?)")
    raise _error(expr, open_pos, "'[' is never closed")


def _parse_ranges(expr: str, begin: int, end: int) -> tuple[str, ...]:
    """Formatted numbers of the comma list ``expr[begin:end]`` (inside one bracket pair)."""
    if begin == end:
        raise _error(expr, begin, "empty brackets")
    values: list[str] = []
    pos = begin
    for item in expr[begin:end].split(","):
        values.extend(_parse_range(expr, pos, item))
        pos += len(item) + 1
    return tuple(values)


def _parse_range(expr: str, pos: int, item: str) -> list[str]:
    """Formatted numbers of one ``N`` or ``LO-HI`` item that starts at ``expr[pos]``."""
    if not item:
        raise _error(expr, pos, "empty item in brackets (two commas, or a comma next to a bracket)")
    for k, c in enumerate(item):
        if not (c.isascii() and c.isdigit()) and c != "-":
            raise _error(expr, pos + k, f"{c!r} in brackets: only digits, '-' and ',' are allowed")
    parts = item.split("-")
    if len(parts) > 2:
        raise _error(expr, pos + len(parts[0]) + len(parts[1]) + 1, f"more than one '-' in {item!r}")
    if not parts[0]:
        raise _error(expr, pos, f"range {item!r} has no start (negative numbers are not allowed)")
    if len(parts) == 2 and not parts[1]:
        raise _error(expr, pos + len(item), f"range {item!r} has no end")
    lo_text = parts[0]
    for k, part in enumerate(parts):
        if why := _too_long(part, item):
            raise _error(expr, pos + (len(parts[0]) + 1 if k else 0), why)
    lo = int(lo_text)
    hi = int(parts[1]) if len(parts) == 2 else lo
    if max(lo, hi) > _MAX_NUMBER:
        raise _error(expr, pos, f"number in {item!r} does not fit in 64 bits")
    if lo > hi:
        raise _error(expr, pos, f"range {item!r} goes backwards ({lo} > {hi})")
    if hi - lo + 1 > MAX_RANGE:
        raise _error(expr, pos, f"range {item!r} has {hi - lo + 1} hosts; Slurm allows at most "
                                f"{MAX_RANGE} in one range")
    width = len(lo_text)  # Slurm pads to the width of LO as written; HI's width is ignored
    return [f"{v:0{width}d}" for v in range(lo, hi + 1)]


def _check_plain_host(expr: str, pos: int, host: str) -> None:
    """Refuse a bracket-free host whose numeric suffix Slurm would clamp."""
    digits = _TRAILING_DIGITS.search(host).group(1)
    if why := _too_long(digits, host):
        raise _error(expr, pos + len(host) - len(digits), why)
    if digits and int(digits) > _MAX_NUMBER:
        raise _error(expr, pos + len(host) - len(digits),
                     f"numeric suffix of {host!r} does not fit in 64 bits (Slurm would change it)")


def _token_count(expr: str, tok: _Token) -> int:
    """Hosts the token expands to; enforces Slurm's per-group limit on non-last groups."""
    for g in tok.groups[:-1]:
        if len(g.values) > MAX_PREFIX_COUNT:
            raise _error(expr, g.pos, f"a bracket group before the last one yields {len(g.values)} "
                                      f"hosts; Slurm allows at most {MAX_PREFIX_COUNT}")
    count = 1
    for g in tok.groups:
        count *= len(g.values)
    return count


def _expand_token(tok: _Token) -> list[str]:
    """Hosts of one token in Slurm's product order (see module docstring)."""
    if not tok.groups:
        return [tok.texts[0]]
    *heads, last = tok.groups
    suffix = tok.texts[-1]
    out: list[str] = []
    # Slurm peels groups off the prefix right to left, recursing, and pushes the last group at the
    # bottom: so the group before last varies slowest, the first group next, the last fastest.
    for picks in itertools.product(*(g.values for g in reversed(heads))):
        chosen = picks[::-1]
        head = "".join(t + v for t, v in zip(tok.texts, chosen)) + tok.texts[len(heads)]
        out.extend(head + v + suffix for v in last.values)
    return out


# -------------------------------------------------------------------------------------- compress

def compress(hosts: Iterable[str]) -> str:
    """A hostlist expression that expands back to ``hosts`` exactly (order, duplicates).

    Pre: an iterable of host names (not a single str). Post: ``expand(compress(h)) == list(h)``.
    Consecutive hosts with the same prefix share one bracket group; runs of consecutive numbers
    with the same zero padding become ``LO-HI``.
    Raises: HostlistError for a name no expression can denote; TypeError for a bare str.
    """
    if isinstance(hosts, str):
        raise TypeError("compress() takes an iterable of host names, not a str; "
                        "to normalise an expression use compress(expand(expr))")
    split = [_split_host(h) for h in hosts]
    tokens: list[str] = []
    i = 0
    while i < len(split):
        prefix, digits = split[i]
        if not digits:
            tokens.append(prefix)
            i += 1
            continue
        items, i = _bracket_items(split, i)
        single = len(items) == 1 and "-" not in items[0]
        tokens.append(prefix + items[0] if single else f"{prefix}[{','.join(items)}]")
    return ",".join(tokens)


def _split_host(host: str) -> tuple[str, str]:
    """(prefix, trailing digits) of a host name that an expression can denote."""
    if not isinstance(host, str):
        raise TypeError(f"host names must be str, not {type(host).__name__}")
    if not host:
        raise HostlistError("cannot compress an empty host name")
    bad = next((c for c in host if c in SEPARATORS or c in "[]"), None)
    if bad is not None:
        raise HostlistError(f"cannot compress host {host!r}: it contains {bad!r}, which a hostlist "
                            "expression cannot express")
    digits = _TRAILING_DIGITS.search(host).group(1)
    if why := _too_long(digits, host):
        raise HostlistError(f"cannot compress host: {why}")
    if digits and int(digits) > _MAX_NUMBER:
        raise HostlistError(f"cannot compress host {host!r}: its number does not fit in 64 bits")
    return host[: len(host) - len(digits)], digits


def _bracket_items(split: list[tuple[str, str]], i: int) -> tuple[list[str], int]:
    """Items (``N`` or ``LO-HI``) for the run of numbered hosts with prefix ``split[i][0]``."""
    prefix = split[i][0]
    items: list[str] = []
    while i < len(split) and split[i][0] == prefix and split[i][1]:
        lo_text = split[i][1]
        width, hi = len(lo_text), int(lo_text)
        i += 1
        # Extend while the next host is exactly what Slurm would print for hi+1 at this width.
        while (i < len(split) and split[i] == (prefix, f"{hi + 1:0{width}d}")
               and hi + 1 - int(lo_text) < MAX_RANGE):
            hi += 1
            i += 1
        items.append(lo_text if hi == int(lo_text) else f"{lo_text}-{hi:0{width}d}")
    return items, i
