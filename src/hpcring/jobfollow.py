"""Following a job: every rank's log read as it grows, tagged by rank, a traceback that another
rank showed already said once, the state's changes, until the job (or every task of an array) ends
(`hpcring logs [-f]`, `submit --wait`). Nothing here prints: callers pass callbacks for state
changes and log lines.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

from hpcring.errors import UsageError
from hpcring.jobstatus import job_state, outcome
from hpcring.outcome import Outcome
from hpcring.schedulers.base import JobRecord, JobState


# ---- logs ---------------------------------------------------------------------------------

_NOISE = ("submitit INFO",)
# Slurm's own messages are not the ranks' output: srun's land in rank 0's log (the batch script's
# --error is %j_0_log.err, as submitit expects), slurmstepd's ("slurmstepd-node1: error: *** STEP
# 5.0 ON node1 CANCELLED ...") in the log of a rank on that node.
_SRUN_LINE = "srun: "
_STEPD_LINE = "slurmstepd"
LAUNCHER = "slurm"     # the tag of those lines: [slurm]<stderr>:srun: ...


def log_files(rec: JobRecord, rank: int | None = None) -> list[tuple[int, str, Path]]:
    ranks = range(rec.ntasks) if rank is None else [rank]
    if rank is not None and not 0 <= rank < rec.ntasks:
        raise UsageError(f"--rank {rank} is out of range: job {rec.job_id} has ranks 0-{rec.ntasks - 1}",
                         hint=f"pass a rank from 0 to {rec.ntasks - 1}, or drop --rank for every rank")
    folder = Path(rec.folder)
    return [(r, s, folder / f"{rec.job_id}_{r}_log.{ext}") for r in ranks for s, ext in
            (("stdout", "out"), ("stderr", "err"))]


class LogTail:
    """Incremental reader of every rank's log files; yields whole lines tagged by rank (or
    ``LAUNCHER`` for Slurm's own lines)."""

    def __init__(self, rec: JobRecord, rank: int | None = None, raw: bool = False) -> None:
        self.files = log_files(rec, rank)
        self.pos = {p: 0 for _, _, p in self.files}
        self.partial = {p: b"" for _, _, p in self.files}
        self.raw = raw

    def poll(self, final: bool = False) -> Iterator[tuple[int, str, str]]:
        for r, stream, path in self.files:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.pos[path])
                    data = fh.read()
                    self.pos[path] = fh.tell()
            except FileNotFoundError:
                continue
            buf = self.partial[path] + data
            *lines, rest = buf.split(b"\n")
            if final and rest:
                lines, rest = lines + [rest], b""
            self.partial[path] = rest
            for line in lines:
                text = line.decode(errors="replace")
                if not self.raw and text.startswith(_NOISE):
                    continue
                if stream == "stderr" and (text.startswith(_STEPD_LINE) or (r == 0 and text.startswith(_SRUN_LINE))):
                    yield LAUNCHER, stream, text
                    continue
                yield r, stream, text


def tag(rank: int | str, stream: str, line: str) -> str:
    """mpirun --tag-output style: ``[rank]<stdout>:line``."""
    return f"[{rank}]<{stream}>:{line}"


def tagged_lines(rec: JobRecord, rank: int | None = None, raw: bool = False) -> Iterator[str]:
    """Every line the job's ranks wrote so far, tagged (:func:`tag`); an array's task by task,
    tagged ``[task:rank]`` (``hpcring logs`` and ``hpcring.Job.logs()``)."""
    for one in rec.tasks() if rec.array is not None else [rec]:
        for r, stream, line in LogTail(one, rank, raw=raw).poll(final=True):
            yield tag(r if one is rec else f"{one.task_index}:{r}", stream, line)


class SameTracebackOnce:
    """Passes lines on to ``emit``, except a traceback that another rank already showed word for
    word: that one becomes a single line naming the rank and the exception. A failure on every
    rank is then read once, not once per rank."""

    HEADER = "Traceback (most recent call last):"

    def __init__(self, emit: Callable[[int | str, str, str], None]) -> None:
        self.emit = emit
        self.shown: dict[str, int | str] = {}        # traceback text -> the rank that showed it
        self.open: dict[tuple, list[str]] = {}       # (rank, stream) -> a traceback being read

    def __call__(self, rank: int | str, stream: str, line: str) -> None:
        key = (rank, stream)
        block = self.open.get(key)
        if block is None:
            if line == self.HEADER:
                self.open[key] = [line]
            else:
                self.emit(rank, stream, line)
            return
        block.append(line)
        if line and not line[0].isspace():           # the exception line ends the traceback
            self._close(key)

    def flush(self) -> None:
        """Show what is left of tracebacks cut short (a rank killed while printing)."""
        for key in list(self.open):
            self._close(key, complete=False)

    def _close(self, key: tuple, complete: bool = True) -> None:
        block = self.open.pop(key)
        first = self.shown.setdefault("\n".join(block), key[0]) if complete else key[0]
        if first != key[0]:
            self.emit(key[0], key[1], f"Traceback: the same as rank {first}'s ({block[-1]})")
            return
        for line in block:
            self.emit(key[0], key[1], line)


STATE_POLL_MAX_S = 4.0   # follow's longest wait between two scheduler queries while nothing changes


def wait_array(rec: JobRecord, on_change: Callable[[JobState], None], poll_s: float = 1.0) -> JobState:
    """Until every task of the array has ended: one query per round, rounds further apart
    (x1.5, at most STATE_POLL_MAX_S) while nothing changes; ``on_change`` gets each new summary."""
    last, interval = None, poll_s
    while True:
        st = job_state(rec)
        if st.raw != last:
            on_change(st)
            last, interval = st.raw, poll_s
        else:
            interval = min(interval * 1.5, max(poll_s, STATE_POLL_MAX_S))
        if st.finished:
            return st
        time.sleep(interval)


def follow(rec: JobRecord, on_state: Callable[[JobState], None], on_line: Callable[[int, str, str], None],
           poll_s: float = 1.0, rank: int | None = None, tracebacks_once: bool = False) -> Outcome:
    """Stream tagged output and state changes until the job ends; return its outcome.
    ``tracebacks_once``: a traceback that another rank showed already is one line
    (:class:`SameTracebackOnce`). The logs are read every ``poll_s``; the scheduler is asked
    less often while the state stays the same (x1.5 each time, at most STATE_POLL_MAX_S)."""
    if rec.array is not None:
        raise UsageError(f"job {rec.job_id} is an array of {len(rec.array)} tasks: follow one task",
                         hint=f"`hpcring logs -f {rec.job_id}_{rec.array[0]}`; `hpcring status {rec.job_id}` "
                              "summarises them all")
    sink = SameTracebackOnce(on_line) if tracebacks_once else None
    on_line = sink or on_line
    # Lines are read before the state: each state line then goes where it happened. A job seen
    # RUNNING ran while it wrote them (its state first); seen in any other state (ended, requeued),
    # it wrote them before it got there (its state after them).
    tail = LogTail(rec, rank)
    last = None
    interval, next_query, st = poll_s, 0.0, None
    while True:
        lines = list(tail.poll())
        if time.monotonic() < next_query and st is not None:
            for item in lines:
                on_line(*item)
            time.sleep(poll_s)
            continue
        st = job_state(rec)
        interval = poll_s if st.state != last else min(interval * 1.5, max(poll_s, STATE_POLL_MAX_S))
        next_query = time.monotonic() + interval
        if st.finished:
            time.sleep(0.3)  # let the last bytes land on shared storage
            for item in lines + list(tail.poll(final=True)):
                on_line(*item)
            if sink is not None:
                sink.flush()
            on_state(st)
            return outcome(rec, st)
        changed, last = st.state != last, st.state
        if changed and st.state == "RUNNING":
            on_state(st)
        for item in lines:
            on_line(*item)
        if changed and st.state != "RUNNING":
            on_state(st)
        time.sleep(poll_s)
