"""``hpcring hostlist``: expand and compress Slurm hostlist expressions (thin wrapper over
:mod:`hpcring.hostlist`). Errors: ``error: <message>`` on stderr, the error's exit code."""
from __future__ import annotations

import typer

from hpcring import hostlist
from hpcring.cli.common import command

app = typer.Typer(help="Expand and compress Slurm hostlist expressions.", no_args_is_help=True)


_WHITESPACE_AS_SPACE = str.maketrans("\t\n\r\v\f", "     ")


def _check(what: str, text: str) -> str:
    """No control characters but whitespace (a separator, as in Slurm): no host name has one, and a
    terminal would act on it when printed."""
    from hpcring.config.text import check_text, shown
    from hpcring.errors import HostlistError
    try:
        check_text(text.translate(_WHITESPACE_AS_SPACE), max_len=None)   # a big job's node list is long, and fine
        return text
    except ValueError as exc:
        raise HostlistError(f"{what} {shown(text)}: {exc}",
                            hint="host names are letters, digits, '-', '_' and '.'") from None


@command(app)
def expand(expr: str = typer.Argument(..., help="Hostlist expression, e.g. 'node[01-04],gpu7'.")) -> None:
    """Print the hosts of EXPR, one per line, in Slurm's order."""
    for host in hostlist.expand(_check("hostlist", expr)):
        typer.echo(host)


@command(app)
def compress(hosts: list[str] = typer.Argument(..., help="Host names, in order.")) -> None:
    """Print one expression that expands to HOST... (order and duplicates kept)."""
    typer.echo(hostlist.compress([_check("host", h) for h in hosts]))
