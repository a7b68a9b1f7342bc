"""``hpcring hostlist``: expand and compress Slurm hostlist expressions (thin wrapper over
:mod:`hpcring.bootstrap.hostlist`). Errors: ``error: <message>`` on stderr, exit code 1."""
from __future__ import annotations

import typer

from hpcring.bootstrap import hostlist
from hpcring.errors import HostlistError

app = typer.Typer(help="Expand and compress Slurm hostlist expressions.", no_args_is_help=True)


@app.command()
def expand(expr: str = typer.Argument(..., help="Hostlist expression, e.g. 'node[01-04],gpu7'.")) -> None:
    """Print the hosts of EXPR, one per line, in Slurm's order."""
    try:
        hosts = hostlist.expand(expr)
    except HostlistError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    for host in hosts:
        typer.echo(host)


@app.command()
def compress(hosts: list[str] = typer.Argument(..., help="Host names, in order.")) -> None:
    """Print one expression that expands to HOST... (order and duplicates kept)."""
    try:
        expr = hostlist.compress(hosts)
    except HostlistError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(expr)
