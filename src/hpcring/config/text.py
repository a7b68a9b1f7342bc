"""What text may reach a job script or a terminal (site values, flags, environment variables):
one line without control characters, bounded. One definition for the site schema, the job spec,
the container settings and the environment registry."""
from __future__ import annotations

import unicodedata
from typing import Any

MAX_TEXT = 4096          # characters in one value; longer is a mistake (or an attack)
# characters a terminal or a shell line would act on: C0/C1 controls (line breaks, ESC of ANSI
# sequences), Unicode line/paragraph separators and bidi overrides (text that reads other than it runs)
_INVISIBLE = {"\u2028", "\u2029"} | {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def shown(value: Any, limit: int = 60) -> str:
    """``repr`` of a value for a message, cut short (a value may be megabytes)."""
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
