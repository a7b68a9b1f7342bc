"""``python -m hpcring.bench ...`` == ``hpcring bench ...`` (what the standalone parent spawns)."""
import typer

from hpcring.cli.bench_cmd import register

_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
register(_app)
_app(prog_name="hpcring bench")
