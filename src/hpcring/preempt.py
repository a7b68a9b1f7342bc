"""Preemption and time-limit warnings, as a training script sees them.

The scheduler warns before it ends a job: Slurm sends ``--signal=USR2@N`` N seconds before the
time limit (site ``slurm.signal``), LSF the ``-wa`` warning action ``-wt`` before the run limit
(site ``lsf.warning_signal``/``warning_time``); a preempting scheduler does the same. submitit
maps that signal to "checkpoint and requeue" at once, in rank 0 only -- which kills rank 0 under
its peers' collectives. hpcring takes the signal over inside its jobs (``install``, called by
job.RunScript after submitit set up its handlers) and leaves the decision to the script::

    comm = hpcring.init().communicator()
    start = load_checkpoint() if hpcring.requeue_count() else 0
    for step in range(start, steps):
        if hpcring.preempted(comm):          # collective: every rank gets the same answer
            save_checkpoint(step)            # bounded by the warning's lead time
            raise hpcring.Preempted(f"stopped at step {step}")
        train_step(step)

``raise hpcring.Preempted`` ends the script on every rank; rank 0 waits (bounded) until every
rank got there, then requeues through submitit (``__submitit_checkpoint__`` of RunScript, then
``scontrol requeue`` / ``brequeue``). A script that ignores the warning runs on until the
limit and ends TIMEOUT (preempted: PREEMPTED), which ``hpcring status`` reports as such --
not as a collective failure.

``on_preempt(fn)`` runs ``fn(signame)`` in the main thread when the warning arrives (between two
Python bytecodes: keep it short, no collectives). Without a scheduler nothing ever fires.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable

from hpcring.fsutil import write_json
from hpcring.errors import SchedulerError

REQUEUE_VAR = "HPCRING_REQUEUE_COUNT"
_warned: dict = {}
_callbacks: list[Callable[[str], None]] = []
_previous: dict[int, object] = {}


def preempted(comm=None) -> bool:
    """True once this job was warned (time limit or preemption).

    Without ``comm``: this rank's own view (ranks get the signal microseconds to seconds apart).
    With ``comm`` it is a collective (a 1-element max-allreduce; call it at the same point on every
    rank): True on every rank if any rank was warned, so all of them stop at the same step."""
    mine = 1.0 if _warned else 0.0
    if comm is None:
        return bool(mine)
    import numpy as np
    return bool(comm.allreduce(np.array([mine], np.float32), op="max")[0])


def on_preempt(fn: Callable[[str], None]) -> None:
    """Call ``fn(signal name)`` when the warning arrives (once; see the module doc)."""
    _callbacks.append(fn)


def requeue_count(environ=None) -> int:
    """How many times this job was requeued: 0 on the first run. hpcring's own count (requeues
    it did), the scheduler's (SLURM_RESTART_COUNT: also ``scontrol requeue`` and node failures) or
    hpcring's restarts on other nodes (HPCRING_RESTART_COUNT, ``submit --max-restarts``)."""
    env = os.environ if environ is None else environ
    # a restart on other nodes after a node fault (hpcring.restarts) resumes like a requeue
    counts = [env.get(REQUEUE_VAR, ""), env.get("SLURM_RESTART_COUNT", ""), env.get("HPCRING_RESTART_COUNT", "")]
    return max([int(c) for c in counts if c.isdigit()] + [0])


def warning_signal(environ=None) -> int:
    """The signal the scheduler warns with (submitit's SUBMITIT_PREEMPT_SIGNAL, default USR2)."""
    env = os.environ if environ is None else environ
    name = "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")
    return int(getattr(signal, name, signal.SIGUSR2))


def install(record: Path | None = None) -> int:
    """Take the warning signal over (main thread only); returns it. ``record``: a JSON file that
    notes the warning (``hpcring status`` says the job was warned)."""
    sig = warning_signal()
    _previous[sig] = signal.getsignal(sig)

    def handler(signum, _frame):
        if _warned:
            return
        _warned.update(signal=signal.Signals(signum).name, at=time.time())
        if record is not None:
            try:
                write_json(record, dict(_warned))
            except OSError:
                pass
        for fn in list(_callbacks):
            fn(_warned["signal"])

    signal.signal(sig, handler)
    return sig


def finished() -> None:
    """The script is over on this rank: a warning from now on (the job's last seconds) is ignored.
    Without this, a warning during interpreter shutdown -- which puts the default action back --
    would kill a rank that has done its work, and the job would end with 128 + the signal."""
    try:
        signal.signal(warning_signal(), signal.SIG_IGN)
    except ValueError:               # not the main thread: nothing was installed from here either
        pass


def requeue_through_submitit() -> None:
    """Rank 0: hand the warning to submitit's handler (checkpoint = RunScript's
    ``__submitit_checkpoint__``, then the scheduler's requeue, then ``sys.exit(-1)``)."""
    sig = warning_signal()
    handler = _previous.get(sig)
    if not callable(handler):
        raise SchedulerError("hpcring.Preempted was raised outside a submitted job: nothing can requeue it",
                             hint="submit with `hpcring submit`; under `hpcring run` checkpoint and exit instead")
    handler(sig, None)


_checkpoints: dict = {}


def checkpoint_saved(step: int | None = None, seconds: float | None = None) -> None:
    """Note that this rank saved a checkpoint (after step ``step``; saving took ``seconds``):
    ``hpcring report`` counts them, and a failed attempt of a restarted job loses only the time
    after its last one. Cheap (a few assignments); call it where the checkpoint is written."""
    c = _checkpoints
    c["count"] = c.get("count", 0) + 1
    c["last_at"] = time.time()
    if step is not None:
        c["last_step"] = int(step)
    if seconds is not None:
        c["seconds"] = c.get("seconds", 0.0) + max(0.0, float(seconds))
