"""`hpcring timeline JOB`: merge every rank's hpcring.torch timeline into one Chrome-trace JSON.

The work is in :mod:`hpcring.diagnostics.timeline` (no torch import needed to merge)."""
from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Optional

import typer

from hpcring.errors import HpcringError, UsageError


def _check_text_arg(what: str, value: str) -> None:
    """A path or job id argument: no control characters, not longer than a path can be."""
    from hpcring.config.text import check_text, shown
    try:
        check_text(value)
    except ValueError as exc:
        raise UsageError(f"{what} {shown(value)}: {exc}", hint="pass a job id, a job folder or a timeline path") from None


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:           # a name longer than the filesystem allows names nothing
        return False


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import command

    @command(app, "timeline",
             help="Merge the per-rank timelines of a job run with HPCRING_TIMELINE=PATH (or `hpcring submit "
                  "--timeline`) into one Chrome-trace/Perfetto JSON, one track per rank, clocks aligned to rank 0. "
                  "JOB: a job id, a job folder, or the PATH given to HPCRING_TIMELINE.")
    def timeline(job: str = typer.Argument(..., help="Job id, job folder, or timeline PATH."),
                 out: Optional[str] = typer.Option(None, "--output", "-o",
                                                   help="Merged file (default: <base>, e.g. <job folder>/timeline.json).")):
        from hpcring.cli import output
        from hpcring.diagnostics.timeline import find_rank_files, merge

        _check_text_arg("JOB", job)
        target = job
        if "/" not in job and not _exists(job) and not list(Path(".").glob(glob.escape(job) + ".rank*")):   # a job id
            from hpcring import submit as lib
            target = lib.record(job).folder      # checks that it can be an id at all
        base, files = find_rank_files(target)
        doc = merge(files)
        dest = Path(out or base)
        try:
            dest.write_text(json.dumps(doc))
        except OSError as exc:
            raise HpcringError(f"cannot write the merged timeline to {dest}: {exc.strerror or exc}",
                               hint="pass --output PATH in a writable folder") from None
        n = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
        output.info(f"merged {n} events from {len(files)} rank(s) into {dest} (open in https://ui.perfetto.dev "
                    "or chrome://tracing)")
