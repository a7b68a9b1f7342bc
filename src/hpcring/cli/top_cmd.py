"""`hpcring top JOB`: a running job's ranks, live, from the ``live.json`` rank 0 rewrites after each
straggler window (its step rate, lateness, compute and time inside collectives per rank).

Thin: the file is checked and the frame built in :mod:`hpcring.diagnostics.liveview`; here the
job is found, its state asked, and the frame drawn in place (``rich.live.Live``) or printed once.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from hpcring.errors import HpcringError

STATE_EVERY = 10.0     # seconds between questions to the scheduler while the view runs (sacct is not free)
_HEAD_LINES = 5        # header, verdict, table heading and rule, a spare line


def _target(job: str):
    """(job record, its folder), or (None, folder) for a job folder's path."""
    from hpcring.cli.common import job_target
    rec, folder = job_target(job, "top")
    return rec, (Path(rec.folder) if rec is not None else folder)


def _state(rec) -> tuple[str | None, bool]:
    """(the scheduler's state, finished); (None, False) when it cannot say (the view goes on)."""
    if rec is None:
        return None, False
    from hpcring import jobstatus
    try:
        st = jobstatus.job_state(rec)
    except HpcringError:
        return None, False
    return st.state, st.finished


def _no_live(rec, folder: Path, job: str, state: str | None, finished: bool) -> HpcringError:
    """Why there is no live view, as precisely as the record and the state allow."""
    path = folder / "live.json"
    report = f"`hpcring report {job}` shows where its time went"
    if finished:
        return HpcringError(f"job {job} has finished ({state}) and left no live view ({path})",
                            hint=report + "; `hpcring top` shows running jobs")
    if state in ("PENDING", "SUSPENDED", "REQUEUED"):
        return HpcringError(f"job {job} has not started yet ({state}): no live view",
                            hint=f"run `hpcring top {job}` again once it runs (`hpcring status {job}`)")
    if rec is not None and rec.ntasks < 2:
        return HpcringError(f"job {job} runs a single rank: it has no live view",
                            hint="the straggler watcher that writes it compares ranks, so it needs 2 or more")
    what = f"job {job}" + (f" ({state})" if state else "")
    return HpcringError(
        f"{what} has no live view yet: no {path}",
        hint="rank 0 writes it after each straggler window (HPCRING_STRAGGLER_WINDOW collectives, default 50). "
             "None yet means: the job has not run its first window (try again in a moment), or it runs with "
             "HPCRING_STRAGGLERS=0, or it makes no hpcring collectives, or (`hpcring run`) it has no job folder "
             "(set HPCRING_JOB_DIR)")


def _max_rows(height: int, width: int = 0, live: dict | None = None) -> int:
    """Table rows that fit a terminal of ``height`` lines: less the header, the verdict line (each
    taking more lines where ``width`` wraps them), the table's heading and a spare line."""
    extra = 0
    if width > 0 and live is not None:
        verdict = (live.get("verdict") or {}).get("line") or ""
        extra = 100 // width + len(verdict) // width        # the header is about 100 characters
    return max(1, height - _HEAD_LINES - extra)


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import command

    @command(app, "top",
             help="A running job's ranks, live: step rate (collectives a second), lateness behind the median "
                  "rank, compute and time inside collectives, over the last straggler window, and the "
                  "straggler verdict; one line per node when the ranks do not fit. JOB: a job id or job folder.")
    def top(job: str = typer.Argument(..., help="Job id (or record name), or a job folder."),
            interval: float = typer.Option(2.0, "--interval", "-i", min=0.1, max=3600.0,
                                           help="Seconds between refreshes."),
            once: bool = typer.Option(False, "--once",
                                      help="Print one frame as plain text and exit (for scripts).")):
        from hpcring.diagnostics import liveview
        rec, folder = _target(job)
        label = rec.job_id if rec is not None else str(folder)
        name = rec.name if rec is not None else None
        state, finished = _state(rec)
        report = f"`hpcring report {label}` shows where its time went"
        if finished and not once:
            raise HpcringError(f"job {label} has finished ({state}): `hpcring top` follows running jobs",
                               hint=report + f"; `hpcring top {label} --once` prints its last frame")
        live = liveview.read_live(folder / liveview.LIVE_FILE)
        if live is None:
            raise _no_live(rec, folder, label, state, finished)
        if once:
            import shutil
            rows = _max_rows(shutil.get_terminal_size((120, 50)).lines)
            frame = liveview.build_frame(live, job=label, name=name, state=state, now=time.time(),
                                         max_rows=rows, final=finished)
            sys.stdout.write(liveview.frame_text(frame))
            sys.stdout.flush()
            if finished:
                raise HpcringError(f"job {label} has finished ({state}): the frame above is its last",
                                   hint=report)
            return
        _follow(rec, folder, label, name, state, interval)


def _follow(rec, folder: Path, label: str, name: str | None, state: str | None, interval: float) -> None:
    """Redraw the frame every ``interval`` seconds until the job ends (exit 0) or Ctrl-C (130)."""
    from rich.console import Console
    from rich.live import Live

    from hpcring.cli import output
    from hpcring.diagnostics import liveview
    console = Console()
    asked, finished = time.monotonic(), False

    def frame():
        live = liveview.read_live(folder / liveview.LIVE_FILE)
        if live is None:            # deleted under us (a requeue starts afresh): say so, keep looking
            raise _no_live(rec, folder, label, state, finished)
        return liveview.render(liveview.build_frame(live, job=label, name=name, state=state, now=time.time(),
                                                    max_rows=_max_rows(console.size.height, console.size.width,
                                                                       live), final=finished))
    try:
        with Live(frame(), console=console, auto_refresh=False, transient=False) as view:
            while not finished:
                time.sleep(interval)
                if rec is not None and time.monotonic() - asked >= max(interval, STATE_EVERY):
                    state, finished = _state(rec)
                    asked = time.monotonic()
                view.update(frame(), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    output.info(f"job {label} has ended ({state}); `hpcring report {label}` shows where its time went")
