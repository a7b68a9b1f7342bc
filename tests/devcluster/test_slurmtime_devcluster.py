"""Our Slurm time parser against the installed sbatch: held jobs, TimeLimit from scontrol.

Each accepted string is submitted held (``sbatch -H``, never runs) and cancelled at once; the
limit Slurm stored must be the one we compute. Strings Slurm refuses must be refused by us too.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from hpcring.config.schema import minutes_to_slurm
from hpcring.config.slurmtime import time_to_minutes





# (string, minutes we expect); None: both Slurm and we refuse it
TABLE = [
    ("99:99", 101), ("1:2:3", 63), ("5-", 7200), ("1-2", 1560), ("1-2:3", 1563), ("60", 60),
    ("90:00", 90), ("1-0:0:1", 1441), ("0:1", 1), ("00:30:00", 30), ("2-00:00:00", 2880),
    ("59:61", 61), ("1:60:60", 121), ("007", 7), ("1-23:59:59", 2880),
    ("1:", None), ("1-2:", None), ("abc", None), ("1:2:3:4", None), ("1--2", None), (":5", None),
    ("1.5", None), ("1h", None), ("2:3-1", None),
]


def _slurm_minutes(text: str) -> int | None:
    p = subprocess.run(["sbatch", "-H", "--parsable", f"--time={text}", "--wrap", "true"],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        return None
    job = p.stdout.strip().split(";")[0]
    try:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    limit = re.search(r"TimeLimit=(\S+)", out).group(1)
    days, _, hms = limit.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


@pytest.mark.parametrize("text,expected", TABLE)
def test_time_parsed_as_installed_sbatch_parses_it(text, expected):
    theirs = _slurm_minutes(text)
    assert theirs == expected, f"sbatch --time={text} gave {theirs}, table says {expected}"
    if expected is None:
        with pytest.raises(ValueError):
            time_to_minutes(text)
    else:
        assert time_to_minutes(text) == expected
        assert _slurm_minutes(minutes_to_slurm(expected)) == expected   # what we render round-trips
