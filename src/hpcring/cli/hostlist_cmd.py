"""``hpcring hostlist``: expand and compress Slurm hostlist expressions (thin wrapper over
:mod:`hpcring.bootstrap.hostlist`). Errors: ``error: <message>`` on stderr, the error's exit code."""
from __future__ import annotations

import typer

from hpcring.bootstrap import hostlist
from hpcring.cli.common import command

app = typer.Typer(help="Expand and compress Slurm hostlist expressions.", no_args_is_help=True)


@command(app)
def expand(expr: str = typer.Argument(..., help="Hostlist expression, e.g. 'node[01-04],gpu7'.")) -> None:
    """Print the hosts of EXPR, one per line, in Slurm's order."""
    for host in hostlist.expand(expr):
        typer.echo(host)


@command(app)
def compress(hosts: list[str] = typer.Argument(..., help="Host names, in order.")) -> None:
    """Print one expression that expands to HOST... (order and duplicates kept)."""
    typer.echo(hostlist.compress(hosts))
