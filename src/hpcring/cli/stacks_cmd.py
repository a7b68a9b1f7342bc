"""`hpcring stacks JOB`: every rank's Python stack of a running (possibly hung) job, grouped.

The work is in :mod:`hpcring.diagnostics.stacks_collect`; this prints. stdout: one line per group
of ranks with the same main-thread stack (``ranks 0-4: in allreduce at train.py:88 (train_step)``),
then with ``--full`` each distinct stack; ``--json`` prints the same as JSON instead. stderr: where
the stacks were saved, and ranks that could not be dumped.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import command, newest_job
    from hpcring.cli.remote_opts import remote_aware
    from hpcring.config.envvars import MAX_TIMEOUT

    @command(app, "stacks",
             help="Show the Python stack of every rank of a running (possibly hung) job, grouped: ranks with "
                  "the same main-thread stack share one line. Slurm: one probe per node through "
                  "`srun --overlap`; local backend: this machine. Uses py-spy when installed, else the "
                  "ranks' SIGUSR2 stack dump hook. Also saved to <job folder>/diag/stacks-<time>.txt.")
    @remote_aware(newest=True)
    def stacks(job_id: Optional[str] = typer.Argument(None, help="Job id (Slurm or local backend; default: the newest job)."),
               full: bool = typer.Option(False, "--full", help="Also print each distinct stack once."),
               as_json: bool = typer.Option(False, "--json", help="Print the groups and problems as JSON."),
               method: str = typer.Option("auto", "--method",
                                          help="auto (py-spy if installed, else the signal hook), py-spy or signal."),
               timeout: float = typer.Option(60.0, "--timeout", min=0.001, max=MAX_TIMEOUT,
                                             help="Deadline for the whole collection (s).")):
        from hpcring.cli import output
        from hpcring.diagnostics import stacks_collect as sc

        if job_id is None:
            job_id = newest_job().key
        report = sc.collect(job_id, method=method, timeout=timeout)
        groups = report.groups()
        text = sc.render(report, groups, full=True)
        saved = sc.write(report, text)
        if as_json:
            sys.stdout.write(json.dumps(_as_dict(report, groups, saved), indent=1) + "\n")
        else:
            sys.stdout.write(sc.render(report, groups, full=full))
            sys.stdout.flush()
        for problem in report.problems:
            output.info(f"warning: {problem}")
        if saved is not None:
            output.info(f"stacks of {len(report.stacks)} rank(s) saved to {saved}")


def _as_dict(report, groups, saved) -> dict:
    return {"job": report.job_id, "scheduler": report.scheduler, "saved": str(saved) if saved else None,
            "groups": [{"ranks": g.ranks, "where": g.where,
                        "stack": [f"{f.func} ({f.file}:{f.line})" for f in (g.main.frames if g.main else [])]}
                       for g in groups],
            "ranks": {str(r): {"host": s.host, "pid": s.pid, "method": s.method, "error": s.error}
                      for r, s in sorted(report.stacks.items())},
            "problems": report.problems}
