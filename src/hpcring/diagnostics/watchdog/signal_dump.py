"""The dump-on-signal hook: a real-time signal makes a rank write its flight records and stacks
and keep running, even while its main thread is stuck in C (the work is a thread's)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcring.diagnostics.watchdog.core import Watchdog
from hpcring.diagnostics.stacks import signal_name

# ---------------------------------------------------------------------------------------------
# DUMP_SIGNAL: dump the flight records and keep running
# ---------------------------------------------------------------------------------------------
# A real-time signal nothing else in the stack uses. Not SIGUSR1: Lightning's SLURM requeue
# handler lives there and is installed only when no handler exists yet. Not SIGUSR2: submitit
# and Slurm's --signal=USR2@N time-limit warning. (SIGRTMIN+6 takes stack dumps.)
DUMP_SIGNAL = signal.SIGRTMIN + 7


def install_dump_signal(watchdog: Watchdog, signum: int = DUMP_SIGNAL) -> bool:
    """Make ``signum`` dump ``watchdog``'s flight records and stacks and keep running.
    Never replaces a handler somebody else installed (returns False then).

    A Python signal handler only runs when the main thread returns to the interpreter -- never
    while it is stuck in a collective. So the handler is a no-op and the work is done by a
    thread woken through ``signal.set_wakeup_fd`` (the C-level handler writes the signal number
    there from whatever thread the kernel picked). Must be called from the main thread; returns
    False (and installs nothing) elsewhere or when somebody else (asyncio) owns the wakeup fd.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r), os.close(w)
        return False
    if old != -1:                      # an event loop owns it: give it back
        signal.set_wakeup_fd(old)
        os.close(r), os.close(w)
        return False
    signal.signal(signum, lambda *_: None)

    def pump() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            if signum in data:
                folder = watchdog.dump(f"signal {signal_name(signum)}")
                print(f"hpcring: rank {watchdog.rank}: flight records and stacks written to {folder}",
                      file=sys.stderr, flush=True)

    threading.Thread(target=pump, name="hpcring-sigdump", daemon=True).start()
    return True
