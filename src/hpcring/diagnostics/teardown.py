"""Ending the whole job once a collective failure is diagnosed, per scheduler.

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
import subprocess
import sys
from collections.abc import Mapping

TIMEOUT_S = 10.0


def end_job_argv(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The command that ends every rank of this job, or None where a supervisor does it."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") not in (None, "", "batch", "extern"):
        return ["scancel", "--signal=KILL", f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"]
    if env.get("LSB_JOBID"):
        return ["bkill", env["LSB_JOBID"]]
    return None


def annotate_argv(headline: str, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The command that writes the report's headline into the scheduler's record of the job
    (Slurm: the job's Comment, shown by ``scontrol show job`` and ``squeue -o %k``)."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        text = " ".join(f"hpcring: {headline}".split())[:250]
        return ["scontrol", "update", f"JobId={env['SLURM_JOB_ID']}", f"Comment={text}"]
    return None


def end_job(rank: int, headline: str = "", environ: Mapping[str, str] | None = None) -> None:
    from hpcring.config import envvars
    from hpcring.errors import UsageError
    argv = end_job_argv(environ)
    try:
        wanted = envvars.get("HPCRING_END_JOB")
    except UsageError:             # on the way out: a typo in the variable must not keep the job alive
        wanted = True
    if argv is None or not wanted:
        return
    from hpcring.schedulers import run_ending
    ending = run_ending(os.environ if environ is None else environ)
    if ending:                     # a requeue's step has the same id: a late kill would hit the next run
        print(f"hpcring: rank {rank}: {ending}: nothing to end", file=sys.stderr, flush=True)
        return
    print(f"hpcring: rank {rank}: ending the job: {' '.join(argv)}", file=sys.stderr, flush=True)
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    annotate = annotate_argv(headline, environ) if headline else None
    for cmd in (annotate, argv):
        if cmd is None:
            continue
        try:
            if cmd is argv and argv[0] == "scancel":   # not waited for (module doc); no descriptor inherited
                subprocess.Popen(cmd, start_new_session=True, close_fds=True, **quiet)
            else:                  # the Comment first: Slurm refuses to update a finished job; bkill only asks
                subprocess.run(cmd, timeout=TIMEOUT_S, check=False, **quiet)
        except (OSError, subprocess.SubprocessError) as exc:   # the launcher's own kill still applies
            print(f"hpcring: rank {rank}: could not run {cmd[0]}: {exc}", file=sys.stderr, flush=True)
