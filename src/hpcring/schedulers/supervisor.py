"""The rank supervisor shared by the local backend (local_run) and ``hpcring run`` on this machine.

Like mpirun: the ranks are children of one supervisor; once a rank fails the others get a grace
period (HPCRING_LOCAL_GRACE_S, 10 s; once the watchdog's report is on disk, at most
:data:`DIAGNOSED_GRACE_S` from when it appeared, since its ranks leave together right after their
last lines), then every rank that is left is
stopped -- SIGCONT (a frozen rank must run to take its signal), SIGTERM, and SIGKILL after
``kill_after_s`` (submitit ignores SIGTERM). A stop request (cancel, Ctrl-C) or the time limit
does the same at once. Every rank gets PR_SET_PDEATHSIG=SIGKILL, so it dies with its supervisor
even when that is SIGKILLed: no orphan keeps running (or keeps a port, a GPU, a secret) after it.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from hpcring.config import envvars

PR_SET_PDEATHSIG = 1          # <linux/prctl.h>
KILL_AFTER_S = 3.0
# From the hang report's appearance: the other ranks still have to hear it (a tree hop), print their
# line and acknowledge (the watchdog's ACK_TIMEOUT, 5 s, bounds that round); the ranks left after it
# are frozen or cut off. Counted from the report, not from the first exit: a rank killed at the
# fault exits first, seconds before the report, and its exit time would cut the survivors' lines.
DIAGNOSED_GRACE_S = 5.0
POLL_S = 0.05


def grace_s() -> float:
    """HPCRING_LOCAL_GRACE_S (parsed by the registry: a bad value is a UsageError naming it)."""
    return envvars.get("HPCRING_LOCAL_GRACE_S")


def die_with_parent(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (Linux)."""
    parent = os.getpid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return                        # not Linux: the supervisor's own stop still applies
        if os.getppid() != parent:        # the parent died before prctl: nobody would signal us
            os._exit(1)
    return preexec


def start(argv: list[str], env: dict, *, parent_death: int = signal.SIGKILL, **popen) -> subprocess.Popen:
    """Start one rank that gets ``parent_death`` when this process dies."""
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(parent_death),
                            **popen)


def exit_code(returncode: int) -> int:
    """Popen's returncode in the shell's convention (killed by signal N -> 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass
class Ended:
    """How the ranks ended: codes in the shell's convention, by rank."""
    codes: list[int]
    first_failed: int | None = None     # the first rank seen exiting non-zero
    stopped: str | None = None          # "CANCELLED" / "TIMEOUT" when the supervisor stopped them
    killed: list[int] = field(default_factory=list)   # ranks the supervisor had to stop

    @property
    def state(self) -> str:
        if self.stopped:
            return self.stopped
        return "FAILED" if self.first_failed is not None or any(self.codes) else "COMPLETED"

    @property
    def exit_code(self) -> int:
        if self.first_failed is not None:
            return self.codes[self.first_failed]
        return next((c for c in self.codes if c), 0)


class Supervisor:
    """Waits for ranks (see the module doc). ``stop(why)`` is safe from a signal handler."""

    def __init__(self, procs: list[subprocess.Popen], *, grace_s: float, limit_s: float | None = None,
                 kill_after_s: float = KILL_AFTER_S, diag: Path | None = None) -> None:
        self.procs, self.grace_s, self.limit_s, self.kill_after_s = procs, grace_s, limit_s, kill_after_s
        self.diag = diag        # the job's diag folder: a hang report there means the failure is diagnosed
        self._why: str | None = None
        self._report_at: float | None = None     # when wait() first saw the hang report

    def stop(self, why: str = "CANCELLED") -> None:
        if self._why is None:
            self._why = why

    def wait(self) -> Ended:
        t0 = time.monotonic()
        first, fail_at, term_at, killed = None, None, None, []
        self._report_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            if first is None:
                first = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
                fail_at = time.monotonic() if first is not None else None
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if self._why is None and self.limit_s and now - t0 > self.limit_s:
                self._why = "TIMEOUT"
            if term_at is None and (self._why or (fail_at is not None and self._grace_over(fail_at, now))):
                killed = [r for r, c in enumerate(codes) if c is None]
                self._signal_all(signal.SIGCONT)
                self._signal_all(signal.SIGTERM)
                term_at = now
            if term_at is not None and now - term_at > self.kill_after_s:
                self._signal_all(signal.SIGKILL)
            time.sleep(POLL_S)
        return Ended([exit_code(p.returncode) for p in self.procs], first, self._why, killed)

    def _grace_over(self, fail_at: float, now: float) -> bool:
        """Whether the ranks left after the first failure have had their time: the grace from
        the failure, or :data:`DIAGNOSED_GRACE_S` from the hang report's appearance (the
        watchdog's ranks leave together once they have printed it; the ranks still there then
        are frozen or cut off, and waiting for them longer gains nothing)."""
        if now - fail_at > self.grace_s:
            return True
        if self._report_at is None and self.diag is not None and (self.diag / "hang-report.json").exists():
            self._report_at = now
        return self._report_at is not None and now - self._report_at > DIAGNOSED_GRACE_S

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
