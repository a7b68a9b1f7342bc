"""What text may reach a job script or a terminal (site values, flags, environment variables):
one line without control characters, bounded; numbers as people type them; a value shown in a
message. One definition for the site schema, the job spec, the container settings, the environment
registry and the CLI. Standard library only (a leaf)."""
from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

MAX_TEXT = 4096          # characters in one value; longer is a mistake (or an attack)
# characters a terminal or a shell line would act on: C0/C1 controls (line breaks, ESC of ANSI
# sequences), Unicode line/paragraph separators and bidi overrides (text that reads other than it runs)
_INVISIBLE = {"\u2028", "\u2029"} | {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}

# Numbers as people type them, ASCII only: Python's int()/float() also take "1_0" (10), "١٢"
# (Arabic-Indic digits), "nan" and "infinity", none of which is a sane job size or deadline.
_INT_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_MAX_NUMBER_TEXT = 64     # characters; longer is a typo or an attack, never a value in bounds


def shown(value: Any, limit: int = 60) -> str:
    """``repr`` of a value for a message, cut short (a value may be megabytes; a message stays one
    readable line, and a key path one word)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def control_character(text: str) -> tuple[int, str] | None:
    """(position, character) of the first control character in ``text``, None if it has none."""
    for i, ch in enumerate(text):
        if ch in _INVISIBLE or unicodedata.category(ch) == "Cc":
            return i, ch
    return None


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be a site value (it reaches job scripts and terminals), None if it can."""
    bad = control_character(text)
    if bad:
        i, ch = bad
        what = "a line break" if ch in "\n\r\u2028\u2029\x85" else "an escape" if ch == "\x1b" else "a control character"
        return (f"contains {what} ({ch!r}) at position {i}; values reach job scripts and terminals: "
                "write one line without control characters (a list takes one item per line)")
    if len(text) > MAX_TEXT:
        return f"is {len(text)} characters long; at most {MAX_TEXT}"
    return None


def parse_int_text(text: str) -> int:
    """A whole number written with ASCII digits and an optional sign; ValueError otherwise."""
    if len(text) > _MAX_NUMBER_TEXT:
        raise ValueError(f"too long ({len(text)} characters)")
    if not _INT_TEXT.fullmatch(text):
        raise ValueError("not a whole number" + _why_not_number(text))
    return int(text, 10)


def parse_float_text(text: str) -> float:
    """A finite decimal number (``1``, ``0.5``, ``1e-3``); ValueError for nan, inf, ``1_0``, ``1e400``."""
    if len(text) > _MAX_NUMBER_TEXT:
        raise ValueError(f"too long ({len(text)} characters)")
    if not _FLOAT_TEXT.fullmatch(text):
        raise ValueError("not finite" if text.strip("+-").lower() in ("nan", "inf", "infinity")
                         else "not a number" + _why_not_number(text))
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("out of range (overflows to infinity)")
    return value


def _why_not_number(text: str) -> str:
    if "_" in text:
        return " (no underscores)"
    if not text.isascii():
        return " (ASCII digits only)"
    return ""


def check_text(text: str, max_len: int | None = MAX_TEXT) -> str:
    """Text for a name or path: no control characters (they break job scripts and logs), bounded."""
    bad = control_character(text)
    if bad:
        raise ValueError(f"contains a control character ({bad[1]!r} at position {bad[0]})")
    if max_len is not None and len(text) > max_len:
        raise ValueError(f"too long ({len(text)} characters, at most {max_len})")
    return text
