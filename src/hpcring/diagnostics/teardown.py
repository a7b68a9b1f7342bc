"""Ending the whole job once a collective failure is diagnosed, per scheduler (the commands are
the scheduler modules': ``end_job_argv``, ``annotate_argv``; ``schedulers.end_job`` runs them).

Ranks that can exit do (the watchdog's ``os._exit``); what is left is a rank that cannot -- frozen
(SIGSTOP, swap, a hung driver) or cut off -- and the allocation it holds. Whoever starts the
ranks is asked to end them all:

* Slurm step (``srun``): ``scancel --signal=KILL JOB.STEP`` (SIGKILL reaches stopped processes;
  the batch script's srun then fails, so the job ends FAILED, not CANCELLED). Job scripts also
  pass ``--kill-on-bad-exit=1``, which does the same as soon as one rank exits non-zero.
* LSF: ``bkill JOB`` (blaunch waits for every task, so one frozen task holds the job until
  its run limit otherwise); the job ends EXIT.
* local backend and ``hpcring run`` on this machine: nothing here -- their supervisor kills the
  ranks' process group once a rank has failed (schedulers/supervisor.py).

On Slurm the report's headline also goes into the job's Comment (``scontrol show job``,
``squeue -o %k``) before the step is killed. The calls are bounded and never raise: the report
and the stacks are written before them.

On Slurm the kill is started, not waited for, in a session of its own: run from inside the step it ends,
``scancel`` kills its own caller, and while the step is already being torn down (another rank's
exit 1 and ``--kill-on-bad-exit``) it did not return at all: the reporting rank sat in it until
slurmstepd's KillWait escalation SIGKILLed it (5 s on the dev cluster, 30 s by default), the last
rank to go in every Slurm run of the fault matrix. Now the reporter leaves at once and every rank
has ended itself before Slurm's kill escalates; ``scancel`` still reaches frozen ranks.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from hpcring import schedulers
from hpcring.config import envvars
from hpcring.errors import UsageError

TIMEOUT_S = 10.0


def end_job(rank: int, headline: str = "", environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    argv = schedulers.end_job_argv(env)
    try:
        wanted = envvars.get("HPCRING_END_JOB")
    except UsageError:             # on the way out: a typo in the variable must not keep the job alive
        wanted = True
    if argv is None or not wanted:
        return
    ending = schedulers.run_ending(env)
    if ending:                     # a requeue's step has the same id: a late kill would hit the next run
        print(f"hpcring: rank {rank}: {ending}: nothing to end", file=sys.stderr, flush=True)
        return
    print(f"hpcring: rank {rank}: ending the job: {' '.join(argv)}", file=sys.stderr, flush=True)
    schedulers.end_job(rank, argv, schedulers.annotate_argv(headline, env) if headline else None, TIMEOUT_S)
