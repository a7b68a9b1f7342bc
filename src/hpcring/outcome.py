"""One outcome model, shared by ``hpcring submit --wait``/``status``/``logs``, restarts and ``hpcring run``,
and the one status record format it is built from.

The status record: each rank of a submitted job or of ``hpcring run`` leaves one JSON file,
``<folder>/<job id>_<rank>_status.json`` (folder: the job folder, ``jobdir.job_folder``,
of a submitted job; the run's ``status/`` folder for ``hpcring run``; job id: ``jobdir.job_id`` of
the rank's environment). Written only by :func:`write_record` (through ``rank_life``), read only by
:func:`read_records`. Fields:

=============  =================================================================================
rank           global rank (the launcher's when the bootstrap failed: the topology never formed)
host           the rank's host (the launcher's name for it)
pid, started   the rank entry's process id and start (epoch s)
cmd            what the rank runs: the script and its arguments, or ``hpcring run``'s CMD
exit_code      the rank's exit code (0: it succeeded)
error          what went wrong in words (``ValueError: x``, the bootstrap's error, the watchdog's
               headline), or None (none, or only a non-zero exit)
ended          when the rank ended (epoch s); failures are ordered by it
size, local_rank, address, interface, launcher
               the topology, once the bootstrap succeeded
preempted      the rank stopped for a requeue (``hpcring.Preempted``'s text); exit_code is 0
=============  =================================================================================

From those and the job's size follow the failing ranks (first failure first: later ones are
usually its consequences) and the ranks that never reported (killed, frozen, never started).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcring.fsutil import write_json

if TYPE_CHECKING:
    from hpcring.schedulers.base import JobState


def record_path(folder: Path | str, job_id: str, rank: int | None) -> Path:
    return Path(folder) / f"{job_id}_{rank}_status.json"


def write_record(folder: Path, job_id: str, record: dict) -> None:
    """Write one rank's record (atomically; the folder is created). Never raises: a record that
    cannot be written must not mask the rank's own outcome (the rank then counts as missing)."""
    path = record_path(folder, job_id, record.get("rank"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, record)
    except OSError as exc:
        print(f"hpcring: could not write {path}: {exc}", file=sys.stderr)


def read_records(folder: Path | str, job_id: str, size: int, problems: list[str] | None = None) -> dict[int, dict]:
    """{rank: record} for the ranks 0..size-1 whose record exists and parses (a rank killed
    mid-write has none). ``problems``: a record that exists but cannot be read, is no JSON or no
    record object is added to it as ``<path>: <what is wrong>``."""
    out = {}
    for rank in range(size):
        path = record_path(folder, job_id, rank)
        try:
            rec = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            if problems is not None:
                what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                problems.append(f"{path}: {'cannot be read' if isinstance(exc, OSError) else 'not JSON'}: {what}")
            continue
        if not isinstance(rec, dict):
            if problems is not None:
                problems.append(f"{path}: a JSON {type(rec).__name__}, not a status record")
            continue
        out[rank] = rec
    return out


@dataclass
class Outcome:
    state: JobState | None      # the scheduler's word; None for `hpcring run` (no job of its own)
    failed: list[dict]          # status records of failing ranks, first failure first
    missing: list[int]          # ranks that left no record

    @property
    def clean(self) -> bool:
        """Every rank reported, none failed."""
        return not self.failed and not self.missing

    @property
    def ok(self) -> bool:
        return self.clean and (self.state is None or self.state.state == "COMPLETED")

    @property
    def exit_code(self) -> int | None:
        """The first failing rank's own code (what --wait exits with); the scheduler's otherwise.
        The scheduler's is often hpcring's teardown, not the script: on Slurm the failing rank
        ends the step with SIGKILL, which sacct reports as 9."""
        if self.failed:
            return self.failed[0]["exit_code"]
        return self.state.exit_code if self.state is not None else None


def summarize(records: dict[int, dict], size: int, state: JobState | None = None) -> Outcome:
    failed = sorted((s for s in records.values() if s.get("exit_code")), key=lambda s: s.get("ended") or 0)
    return Outcome(state, failed, [r for r in range(size) if r not in records])


def rank_failure(s: dict, what: str | None = None) -> str:
    """``rank 3 on node2: ValueError: ...`` (or ``... exited with code N``)."""
    text = s.get("error") or what or f"exited with code {s.get('exit_code')}"
    return f"rank {s['rank']} on {s.get('host', '?')}: {text}"
