"""`hpcring doctor`: check interfaces, all-pairs connectivity, ring-link bandwidth and the framework
environment of a job, on every rank (see hpcring.diagnostics.doctor)."""
from __future__ import annotations

from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import command
    from hpcring.config.envvars import MAX_TIMEOUT

    @command(app, "doctor",
             help="Check the job's network on every rank: configured interfaces exist and are up on every node, "
                  "all pairs of ranks connect (latency), ring links are not slow (bandwidth), NCCL/Gloo/MPI "
                  "variables agree with the site config and between ranks. Run it as every rank "
                  "(hpcring run -- hpcring doctor, srun, mpirun); alone it checks this machine as one rank. "
                  "Rank 0 prints one table and a verdict; every rank exits 1 when a check FAILs.")
    def doctor(timeout: float = typer.Option(60.0, "--timeout", min=0.001, max=MAX_TIMEOUT,
                                             help="Seconds by which every rank finishes or fails (every wait)."),
               json_path: Optional[str] = typer.Option(None, "--json", help="Rank 0 writes the full report here."),
               bw_seconds: float = typer.Option(0.6, "--bw-seconds", help="Bulk-transfer time per ring link.")):
        import sys

        import hpcring
        from hpcring.diagnostics.doctor import Options, ensure_secret_when_alone, run_doctor, write_json
        from hpcring.fsutil import check_output_path
        opts = Options(timeout=timeout, bw_seconds=bw_seconds).check()
        if json_path:        # before any rank waits: written by rank 0 only at the end
            check_output_path(json_path, "--json")
        ensure_secret_when_alone()
        session = hpcring.init(timeout=timeout)

        def emit(report) -> None:   # rank 0, before the others learn the verdict and may exit
            print(report.format(), flush=True)
            if json_path:
                write_json(report, json_path)

        report = run_doctor(session, opts, emit=emit)
        if session.topology.rank != 0 and report.exit_code:
            print(f"hpcring doctor: {report.verdict_line()} (rank 0 prints the report)", file=sys.stderr, flush=True)
        raise typer.Exit(report.exit_code)
