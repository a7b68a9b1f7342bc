"""`hpcring report JOB`: where a job's time went, one page (text, --json, --html FILE, --plots DIR).

The work is in :mod:`hpcring.jobreport` (and :mod:`hpcring.jobreport_html`, :mod:`hpcring.jobreport_plots`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from hpcring.errors import HpcringError, UsageError


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import command

    @command(app, "report",
             help="Where a job's time went, one page: wall time, rank-hours, time to the first step, each rank's "
                  "startup / compute / communication / waiting, time lost to hangs and restarts, checkpoints, "
                  "the effective training time ratio. JOB: a job id or a job folder.")
    def report(job: str = typer.Argument(..., help="Job id (or record name), or a job folder."),
               as_json: bool = typer.Option(False, "--json",
                                            help="Print the report as JSON (schema hpcring-report/1, "
                                                 "docs/diagnostics.md) instead of text."),
               html: Optional[str] = typer.Option(None, "--html",
                                                  help="Also write the report as one self-contained HTML file "
                                                       "(inline CSS and SVG, nothing fetched; with matplotlib, "
                                                       "the step-rate and bandwidth pictures too)."),
               plots: Optional[str] = typer.Option(None, "--plots",
                                                   help="Also draw split, rate and bandwidth pictures, each as "
                                                        "PNG and SVG, into this folder (made when missing; "
                                                        "needs matplotlib: pip install 'hpcring[plots]').")):
        from hpcring import jobreport, jobreport_plots
        from hpcring.cli import output
        from hpcring.fsutil import check_output_path
        if html is not None:
            check_output_path(html, "--html")      # before anything is read
        if plots is not None:                       # matplotlib and the folder, before anything is read too
            jobreport_plots.require_matplotlib()
            jobreport_plots.check_folder(plots)
        from hpcring.cli.common import job_target
        rec, folder = job_target(job, "report")
        state, finished, requeues, run_start, notes = None, False, 0, None, []
        if rec is not None:
            from hpcring import jobstatus
            try:
                st = jobstatus.job_state(rec)
                state, finished = st.state, st.finished
            except HpcringError as exc:
                notes.append(f"the scheduler could not say the job's state: {exc.message}")
            requeues = jobstatus.requeues(rec)
            run_start = jobstatus.run_started(rec)
        doc = jobreport.build(rec, folder, state=state, finished=finished, requeues=requeues, run_start=run_start)
        doc["problems"] = notes + doc["problems"]
        if html is not None:
            from hpcring.jobreport_html import render
            figures, why = None, ""
            try:
                figures = [(jobreport_plots.TITLES[d.name], svg, d.missing) for d, svg in jobreport_plots.inline(doc)]
            except UsageError:              # matplotlib is optional: the page says how to get them
                why = ("the step-rate and bandwidth pictures need matplotlib: "
                       f"{jobreport_plots.INSTALL}")
            try:
                Path(html).write_text(render(doc, figures, why))
            except OSError as exc:
                raise HpcringError(f"cannot write the HTML report to {html}: {exc.strerror or exc}",
                                   hint="pass --html FILE in a writable folder") from None
        drawn = jobreport_plots.write_all(doc, plots) if plots is not None else []
        if as_json:
            sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        else:
            sys.stdout.write(jobreport.text(doc))
        if html is not None:
            output.info(f"wrote {html}")
        for d in drawn:
            lacks = f"; missing: {'; '.join(d.missing)}" if d.missing else ""
            output.info(f"wrote {', '.join(str(f) for f in d.files)}{lacks}")
