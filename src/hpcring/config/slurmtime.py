"""Slurm time limits, parsed exactly as Slurm 22.05's ``time_str2mins`` parses them.

Slurm (src/common/parse_time.c) first checks the characters: only digits, ``-`` and ``:``; at
most one ``-``, never after a ``:``; at most two ``:``; enough digit groups for the colons (with a
``-``: 3 groups for one colon, 4 for two; without: 2 and 3). Then, with a ``-``, it reads
``D-H:M:S`` left to right (missing fields are 0: ``5-`` is five days, ``1-2`` one day two hours);
without one it reads ``H:M:S`` when there are three fields, else ``M[:S]`` (so ``99:99`` is 99
minutes 99 seconds). Seconds round the total up to the next minute (``99:99`` -> 101 minutes).

Where Slurm's answer is not a usable limit, hpcring refuses with a clear error instead of passing
it on: ``0`` (Slurm: no limit), ``-1``/``INFINITE``/``UNLIMITED``, a leading ``-`` (sbatch turns
``-5`` into a 2982611-day limit) and totals that overflow Slurm's 32-bit seconds.
Checked against the installed sbatch by tests/devcluster/test_slurmtime_devcluster.py.
"""
from __future__ import annotations

import re

MAX_SECONDS = 2**31 - 1   # Slurm sums the fields into a C int

_FIELD = re.compile(r"\d+")


def _valid_timespec(s: str) -> bool:
    digits = dash = colon = 0
    in_digits = False
    for ch in s:
        if ch.isdigit() and ch.isascii():
            if not in_digits:
                digits += 1
                in_digits = True
        elif ch == "-":
            in_digits = False
            dash += 1
            if colon:
                return False
        elif ch == ":":
            in_digits = False
            colon += 1
        else:
            return False
    if not digits or dash > 1 or colon > 2:
        return False
    need = {1: 3, 2: 4} if dash else {1: 2, 2: 3}
    return digits >= need.get(colon, 0)


def _scan(text: str, seps: str) -> list[int]:
    """C's sscanf("%d<sep>%d<sep>...") on an already validated string: the fields it converts."""
    out: list[int] = []
    pos = 0
    for i in range(len(seps) + 1):
        m = _FIELD.match(text, pos)
        if not m:
            break
        out.append(int(m.group()))
        pos = m.end()
        if i == len(seps) or not text.startswith(seps[i], pos):
            break
        pos += 1
    return out


def time_to_minutes(value: str | int) -> int:
    """A Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) or int minutes -> minutes.

    Raises ValueError saying what is wrong and what is accepted.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"time must be minutes or a Slurm time string, got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"time must be positive minutes, got {value}")
        if value * 60 > MAX_SECONDS:
            raise ValueError(f"time {value} minutes is too large (Slurm's limit is {MAX_SECONDS // 60} minutes)")
        return value
    text = value.strip()
    if text.lower() in ("-1", "infinite", "unlimited"):
        raise ValueError(f"time {value!r} means no limit; hpcring needs a finite time limit")
    if text.startswith("-") or not _valid_timespec(text):
        raise ValueError(f"not a time: {value!r} (use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    if "-" in text:
        d, h, m, s = (_scan(text, "-::") + [0, 0, 0, 0])[:4]
        secs = d * 86400 + h * 3600 + m * 60 + s
    else:
        fields = _scan(text, "::")
        if len(fields) == 3:
            secs = fields[0] * 3600 + fields[1] * 60 + fields[2]
        else:
            secs = fields[0] * 60 + (fields[1] if len(fields) > 1 else 0)
    if secs > MAX_SECONDS:
        raise ValueError(f"time {value!r} is too large (Slurm's limit is {MAX_SECONDS} seconds)")
    mins = (secs + 59) // 60
    if mins <= 0:
        raise ValueError(f"time {value!r} is zero (Slurm reads 0 as no limit); give a positive time")
    return mins
