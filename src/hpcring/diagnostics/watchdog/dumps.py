"""What a rank writes about itself: its flight records, stacks and time summary (on a failure, a
signal, its work raising, at exit), its exit record, and the hang report's files. A mixin of the
Watchdog: ``dump`` stays the watchdog's own, replaceable per instance (tests, the scale harness)."""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time

from hpcring import jobdir
from hpcring.diagnostics import fr_trace, rank_summary
from hpcring.diagnostics.report import Report
from hpcring.diagnostics.watchdog.settings import log
from hpcring.collectives.recorder import locate

EXIT_DUMP_S = 5.0            # a rank ending on an exception waits at most this long for its dumps


class DumpWriter:
    """The Watchdog's writes to ``<job folder>/diag`` and its exit record (reads ``rank``,
    ``size``, ``host``, ``_comms``, ``_lock``, ``_handled``, ``_raised`` of the Watchdog)."""

    def dump(self, reason: str) -> str | None:
        """Flight records (hpcring's JSON and, unless HPCRING_FR_TRACE=0, torch's Flight Recorder
        format in ``fr-trace/``: :mod:`hpcring.diagnostics.fr_trace`) and all threads' stacks to
        ``<job folder>/diag``; returns the folder (None when it cannot be written: diagnostics
        never fail the job twice)."""
        try:
            folder = jobdir.diag_dir()
            for i, comm in enumerate(self._comms):
                suffix = "" if i == 0 else f"-comm{i}"
                comm.recorder.dump(folder / f"flight-rank{self.rank}{suffix}.json", {"reason": reason})
            self._dump_fr_trace(folder, reason)
            self.write_summary(folder, f"dump: {reason}")
            with open(folder / f"stacks-rank{self.rank}.txt", "w") as f:
                f.write(f"# rank {self.rank} ({self.host}) pid {os.getpid()}: {reason}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            return str(folder)
        except OSError as e:
            print(f"hpcring: rank {self.rank}: could not write diagnostics: {e}", file=sys.stderr)
            return None

    def write_summary(self, folder, why: str) -> None:
        """This rank's time summary (:mod:`hpcring.diagnostics.rank_summary`: fixed size, for
        ``hpcring report``) into ``folder``; a failure is one line, never the rank's end."""
        try:
            rank_summary.write(folder, self.rank, self.size, self.host, self._comms, why)
        except Exception as e:  # noqa: BLE001 - a summary must not fail a rank that is ending anyway
            print(f"hpcring: rank {self.rank}: could not write its time summary: {e}", file=sys.stderr)

    def _exit_summary(self) -> None:
        """At exit: the summary into the job folder's ``diag/``, for a submitted job only (submitit
        set SUBMITIT_FOLDER: its folder is the job's and stays); ``hpcring run``, ``hpcring bench``
        and ranks started by hand keep a folder only for a report, so a clean run leaves nothing."""
        if os.environ.get("SUBMITIT_FOLDER"):
            raised = self._raised
            why = "exit" if raised is None else f"exit: raised {raised['error']}"
            self.write_summary(jobdir.job_folder() / "diag", why)

    def _dump_fr_trace(self, folder, reason: str) -> None:
        if not self._comms or not fr_trace.enabled():
            return
        try:
            fr_trace.write(folder / fr_trace.FOLDER, self.rank, self._comms, host=self.host, reason=reason)
        except Exception as e:  # noqa: BLE001 - the JSON records are written; this copy must not stop the rest
            print(f"hpcring: rank {self.rank}: could not write the Flight Recorder dump: {e}", file=sys.stderr)

    # -- a rank whose work raised -------------------------------------------------------------
    def note_raised(self, exc: BaseException | None = None, error: str | None = None, where: str | None = None) -> None:
        """This rank's work raised ``exc`` (or failed with ``error``, raised ``where``) and the
        rank is about to end: write its flight records and stacks now (bounded: at most
        :data:`EXIT_DUMP_S`), before anything tears the job down, and keep the error for the exit
        record (:meth:`_on_exit`), so a hang report of the ranks left behind names this rank and
        what it raised. Once per process; nothing when this rank's own failure is being handled."""
        with self._lock:
            if self._handled or self._raised is not None:
                return
            if exc is not None:
                error, where = _raised_text(exc)
            self._raised = {"error": error or "?", "where": where}
        self._bounded(lambda: self.dump(f"rank {self.rank} raised {self._raised['error']}"), EXIT_DUMP_S)

    @staticmethod
    def _bounded(fn, seconds: float) -> None:
        """``fn()`` in a daemon thread, waited for at most ``seconds`` (a hung file system must not
        keep an ending rank alive); inline where no thread can start (interpreter shutdown)."""
        try:
            t = threading.Thread(target=fn, name="hpcring-exit-dump", daemon=True)
            t.start()
        except RuntimeError:
            fn()
            return
        t.join(seconds)

    def _on_exit(self) -> None:
        """Interpreter exit: leave an exit record so a later hang names this rank as exited; a
        rank ending on an exception (noted by :meth:`note_raised`, or uncaught: ``sys.last_value``)
        first writes its dumps, and its record says what it raised and where."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        if self._handled:
            return
        if self._raised is None:
            exc = getattr(sys, "last_value", None)   # set by the interpreter for an uncaught exception
            if isinstance(exc, BaseException):
                self.note_raised(exc)
        self._bounded(self._exit_summary, EXIT_DUMP_S)     # hpcring report's numbers (a hung FS: bounded)
        try:
            rec = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "time": time.time(),
                   "last_done": max((c.recorder.last_done() for c in self._comms), default=0),
                   **(self._raised or {})}
            client = self._client or self._store(timeout=2.0)
            try:
                client.set(f"diag/exit/{self.rank}", json.dumps(rec).encode())
                client.add("diag/nexit", 1)
            finally:
                client.close()
        except Exception:  # noqa: BLE001 - exiting anyway; the store may be gone
            pass


def note_raised(exc: BaseException) -> None:
    """The session's watchdog's :meth:`Watchdog.note_raised` (nothing without a session or a
    watchdog): for a rank entry that catches the work's exception itself (``hpcring submit``'s
    script or function). The session is looked up, not imported: it sits above this layer."""
    session = sys.modules.get("hpcring.session")
    current = session.current() if session is not None else None
    wd = getattr(current, "watchdog", None)
    if wd is not None and not isinstance(exc, (SystemExit, GeneratorExit)):
        try:
            wd.note_raised(exc)
        except Exception:  # noqa: BLE001 - the rank is failing already: never fail it twice
            log.exception("rank %d: could not record the exception", wd.rank)


def _raised_text(exc: BaseException) -> tuple[str, str | None]:
    """(``ValueError: x`` (first line), where it was raised: ``in load at train.py:12 (main)``)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] if str(exc) else type(exc).__name__
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    where = None
    if last is not None:
        found = locate(last.tb_frame)
        where = None if found == "?" else found
    return text, where


def _publish(report: Report, folder: str | None) -> None:
    if folder is None:
        return
    try:
        base = os.path.join(folder, "hang-report")
        with open(base + ".json", "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        with open(base + ".txt", "w") as f:
            f.write(report.text() + "\n")
    except OSError as e:
        print(f"hpcring: could not save the hang report in {folder}: {e}", file=sys.stderr)
