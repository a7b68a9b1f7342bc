"""One outcome model for a finished job, shared by ``hpcring submit --wait``/``status`` and ``hpcring run``.

Each rank leaves a status record (``{"rank", "host", "exit_code", "error", "ended", ...}``: job.py
for submitted jobs, rank_exec.py for ``hpcring run``). From those and the job's size follow the
failing ranks (first failure first: later ones are usually its consequences) and the ranks that
never reported (killed, frozen, never started).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RankOutcome:
    failed: list[dict]          # status records of failing ranks, first failure first
    missing: list[int]          # ranks that left no record

    @property
    def clean(self) -> bool:
        return not self.failed and not self.missing


def read_statuses(paths: dict[int, Path]) -> dict[int, dict]:
    """{rank: record} for the records that exist and parse (a rank killed mid-write has none)."""
    out = {}
    for rank, path in paths.items():
        try:
            out[rank] = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            pass
    return out


def summarize(stats: dict[int, dict], size: int) -> RankOutcome:
    failed = sorted((s for s in stats.values() if s.get("exit_code")), key=lambda s: s.get("ended", 0))
    return RankOutcome(failed, [r for r in range(size) if r not in stats])


def rank_failure(s: dict, what: str | None = None) -> str:
    """``rank 3 on node2: ValueError: ...`` (or ``... exited with code N``)."""
    text = s.get("error") or what or f"exited with code {s.get('exit_code')}"
    return f"rank {s['rank']} on {s.get('host', '?')}: {text}"


def bootstrap_failure(exc: BaseException, *, first_line: bool = False) -> dict:
    """The status record of a rank whose ``hpcring.init()`` failed: the launcher's rank and host
    (the topology never formed), exit code 1, the error (its first line only when asked)."""
    import time

    from hpcring.bootstrap.launchers import detect
    t = detect()
    error = str(exc).splitlines()[0] if first_line and str(exc) else str(exc)
    return {"rank": t.rank, "host": t.hosts[t.rank], "exit_code": 1, "error": error, "ended": time.time()}


def hang_headline(diag: Path, since: float | None = None) -> tuple[str, Path] | None:
    """(headline, text report) of the watchdog's report in the job's ``diag`` folder, if any;
    with ``since`` (a file mtime), only a report written at or after it."""
    path = Path(diag) / "hang-report.json"
    try:
        if since is not None and path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())["headline"], path.with_suffix(".txt")
    except (OSError, ValueError, KeyError, TypeError):
        return None
