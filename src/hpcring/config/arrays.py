"""Job arrays, sweeps and dependencies: what ``--array``, ``--sweep``, ``--dependency`` and
``--after`` mean, parsed and checked once, written for each scheduler by the templates.

Indices are hpcring's, 0-based, as Slurm's ``--array``: ``0-15``, ``0-15:2`` (a step), ``1,3,8``
(a list), mixed ``0-3,8``, and ``%4`` after any of them (at most 4 tasks run at once). LSF's
indices start at 1 (``-J "name[1-16]%4"``): hpcring task ``i`` is LSF index ``i + 1``, and every rank
sees ``HPCRING_ARRAY_TASK=i`` on every scheduler.

A sweep (``--sweep lr=0.1,0.01 --sweep bs=32,64``) is one array task per combination, the first
``--sweep`` varying slowest: task 0 ``--lr 0.1 --bs 32``, task 1 ``--lr 0.1 --bs 64``, task 2
``--lr 0.01 --bs 32``, ... The values are appended to the script's arguments as ``--NAME VALUE``.

Standard library only (the CLI imports it).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from hpcring.errors import UsageError
from hpcring.ranks import rank_ranges

MAX_ARRAY_INDEX = 999_999       # Slurm's own ceiling for MaxArraySize is 4000001; far above any sane job
MAX_ARRAY_TASKS = 10_000        # tasks in one array (a typo must not queue a million jobs)
MAX_SWEEP_VALUE = 1000          # characters of one sweep value
ARRAY_HINT = ("give indices as Slurm does: 0-15, 0-15:2 (a step), 1,3,8 (a list), 0-3,8, "
              "each optionally followed by %N (at most N tasks at once), e.g. --array 0-15%4")
_ITEM = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?\Z", re.ASCII)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z", re.ASCII)
DEPENDENCY_KINDS = ("afterok", "afterany", "afternotok", "after")
_JOB_ID = re.compile(r"\d+(?:_\d+)?\Z", re.ASCII)


@dataclass(frozen=True)
class ArraySpec:
    indices: tuple[int, ...]     # sorted, distinct, 0-based
    limit: int | None = None     # at most this many tasks at once

    def slurm(self) -> str:
        """``0-15%4`` (ranges compressed; Slurm's syntax)."""
        return _ranges(self.indices) + (f"%{self.limit}" if self.limit else "")

    def lsf(self) -> str:
        """``[1-16]%4``: LSF's indices start at 1 (module doc)."""
        return f"[{_ranges([i + 1 for i in self.indices])}]" + (f"%{self.limit}" if self.limit else "")


def _ranges(indices) -> str:
    return rank_ranges(indices)


def parse_array(spec: str, where: str = "--array", tasks: int | None = None) -> ArraySpec:
    """``spec`` -> ArraySpec; UsageError naming ``where`` and the bad part. ``tasks``: the sweep's
    number of combinations: indices must lie below it, and ``%N`` alone means all of them."""
    text = str(spec)
    body, pct, limit_text = text.partition("%")
    limit = None
    if pct:
        if not limit_text.isascii() or not limit_text.isdigit():
            raise UsageError(f"{where} {text!r}: the limit after '%' must be a whole number, got {limit_text!r}",
                             hint=ARRAY_HINT)
        limit = int(limit_text)
        if not 1 <= limit <= MAX_ARRAY_TASKS:
            raise UsageError(f"{where} {text!r}: the limit %{limit} must be from 1 to {MAX_ARRAY_TASKS}",
                             hint=ARRAY_HINT)
    if not body:
        if pct and tasks is not None:          # --sweep ... --array %4: every combination, 4 at a time
            return ArraySpec(tuple(range(tasks)), limit)
        raise UsageError(f"{where} {text!r}: no indices" + (" (%N alone needs --sweep)" if pct else ""),
                         hint=ARRAY_HINT)
    out: list[int] = []
    for item in body.split(","):
        m = _ITEM.match(item)
        if not m:
            raise UsageError(f"{where} {text!r}: {item!r} is not an index, a range A-B or a stepped range A-B:S",
                             hint=ARRAY_HINT)
        lo, hi, step = int(m.group(1)), int(m.group(2) or m.group(1)), int(m.group(3) or 1)
        if hi > MAX_ARRAY_INDEX:
            raise UsageError(f"{where} {text!r}: index {hi} is above {MAX_ARRAY_INDEX}", hint=ARRAY_HINT)
        if lo > hi:
            raise UsageError(f"{where} {text!r}: the range {item!r} runs backwards ({lo} > {hi})", hint=ARRAY_HINT)
        if step < 1:
            raise UsageError(f"{where} {text!r}: the step in {item!r} must be at least 1", hint=ARRAY_HINT)
        if (hi - lo) // step + 1 + len(out) > MAX_ARRAY_TASKS:
            raise UsageError(f"{where} {text!r}: more than {MAX_ARRAY_TASKS} tasks", hint=ARRAY_HINT)
        out.extend(range(lo, hi + 1, step))
    dup = sorted({i for i in out if out.count(i) > 1}) if len(set(out)) != len(out) else []
    if dup:
        raise UsageError(f"{where} {text!r}: index {dup[0]} is given twice", hint=ARRAY_HINT)
    if tasks is not None and max(out) >= tasks:
        raise UsageError(f"{where} {text!r}: index {max(out)} but the sweep has {tasks} combination(s), "
                         f"0-{tasks - 1}", hint="pick indices of combinations, or --array %N for all of them")
    return ArraySpec(tuple(sorted(out)), limit)


def parse_sweep(items: list[str], where: str = "--sweep") -> list[dict[str, str]]:
    """``["lr=0.1,0.01", "bs=32,64"]`` -> one dict per combination (module doc for the order)."""
    axes: dict[str, list[str]] = {}
    for item in items:
        name, eq, values = str(item).partition("=")
        hint = "give NAME=V1,V2,... (NAME: letters, digits, '_' and '-'; values without ',' or control characters)"
        if not eq or not _NAME.match(name):
            raise UsageError(f"{where} {item!r}: expected NAME=V1,V2,... with NAME a word such as lr", hint=hint)
        if name in axes:
            raise UsageError(f"{where} {item!r}: {name!r} is swept twice", hint="give each name in one --sweep")
        vals = values.split(",")
        for v in vals:
            if not v or v != v.strip():
                raise UsageError(f"{where} {item!r}: an empty value or one with spaces around it", hint=hint)
            if len(v) > MAX_SWEEP_VALUE or any(ord(c) < 32 or ord(c) == 127 for c in v):
                raise UsageError(f"{where} {item!r}: a value holds a control character or is over "
                                 f"{MAX_SWEEP_VALUE} characters", hint=hint)
        if len(set(vals)) != len(vals):
            raise UsageError(f"{where} {item!r}: a value of {name!r} is given twice", hint=hint)
        axes[name] = vals
    combos = [dict(zip(axes, c)) for c in itertools.product(*axes.values())]
    if len(combos) > MAX_ARRAY_TASKS:
        raise UsageError(f"{where}: {len(combos)} combinations, more than {MAX_ARRAY_TASKS} array tasks",
                         hint="sweep fewer values")
    return combos


def sweep_args(values: dict[str, str]) -> list[str]:
    """``{"lr": "0.1", "bs": "32"}`` -> ``["--lr", "0.1", "--bs", "32"]`` (after the script's own)."""
    return [w for name, value in values.items() for w in (f"--{name}", value)]


@dataclass(frozen=True)
class Dependency:
    kind: str                    # afterok, afterany, afternotok, after
    jobs: tuple[str, ...]        # job ids; an array task as JOB_TASK

    def slurm(self) -> str:
        return ":".join((self.kind, *self.jobs))

    def lsf(self) -> str:
        """LSF's -w expression: done/ended/exit/started, an array task as ``JOB[i+1]``."""
        word = {"afterok": "done", "afterany": "ended", "afternotok": "exit", "after": "started"}[self.kind]
        return " && ".join(f"{word}({_lsf_job(j)})" for j in self.jobs)


def _lsf_job(job: str) -> str:
    head, sep, task = job.partition("_")
    return f"{head}[{int(task) + 1}]" if sep else head


def parse_dependency(spec: str | None, after: list[str] | None = None) -> Dependency | None:
    """``--dependency KIND:JOB[:JOB...]`` and ``--after JOB`` (= afterok) -> one Dependency."""
    after = list(after or [])
    hint = ("give --dependency afterok:JOB (or afterany, afternotok, after; several jobs as afterok:38:39) "
            "or --after JOB; JOB is a job id such as 38, an array task as 38_2")
    if spec is None and not after:
        return None
    kind, jobs = "afterok", []
    if spec is not None:
        kind, colon, rest = str(spec).partition(":")
        if kind not in DEPENDENCY_KINDS:
            raise UsageError(f"--dependency {spec!r}: unknown kind {kind!r} (one of {', '.join(DEPENDENCY_KINDS)})",
                             hint=hint)
        if not colon or not rest:
            raise UsageError(f"--dependency {spec!r}: no job id after {kind!r}", hint=hint)
        jobs = rest.split(":")
        if after and kind != "afterok":
            raise UsageError(f"--after is afterok, --dependency {spec!r} is {kind}: one kind per job", hint=hint)
    for j, where in [(j, f"--dependency {spec!r}") for j in jobs] + [(a, "--after") for a in after]:
        if not _JOB_ID.match(str(j)) or len(str(j)) > 40:
            raise UsageError(f"{where}: {str(j)!r} is not a job id (digits, an array task as JOB_TASK)", hint=hint)
    return Dependency(kind, tuple(dict.fromkeys([*jobs, *after])))
