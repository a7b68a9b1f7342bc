"""`hpcring devcluster up|down|status|exec`: thin commands over hpcring.devcluster.cluster."""
from __future__ import annotations

import json
import os
import time
from typing import Annotated, List, Optional

import typer

from hpcring.cli.common import exit_for
from hpcring.errors import HpcringError


app = typer.Typer(
    name="devcluster",
    help="A real Slurm cluster on this machine (nodes are network namespaces). Needs root.",
    no_args_is_help=True,
    add_completion=False,
)


def _fail(e: HpcringError) -> typer.Exit:
    return exit_for(e)


@app.command()
def up(
    nodes: Annotated[int, typer.Option("--nodes", "-N", help="Number of slurmd nodes (node1..nodeN).")] = 3,
    dead_interface: Annotated[
        bool,
        typer.Option("--dead-interface/--no-dead-interface",
                     help="Give each node a 'dead0' interface (10.98.0.i) that is up but routes nowhere."),
    ] = True,
    share: Annotated[
        Optional[List[str]],
        typer.Option("--share", help="A path under /tmp to show at the same path on every node "
                                     "(a checkout or venv; the rest of the filesystem is shared already)."),
    ] = None,
) -> None:
    """Start the cluster, or repair it (idempotent). Waits until all nodes are idle."""
    try:
        from hpcring.devcluster import cluster  # imported on use: keeps `hpcring --help` fast
        info = cluster.up(nodes=nodes, dead_interface=dead_interface, shares=share)
    except HpcringError as e:
        raise _fail(e) from None
    if info.actions:
        for a in info.actions:
            typer.echo(f"  {a}")
    else:
        typer.echo("  already up, nothing to do")
    typer.echo(
        f"devcluster up in {info.elapsed_s:.1f} s: cluster {info.cluster}, partition {info.partition}, "
        f"{len(info.nodes)} nodes on {info.bridge} ({info.bridge_address})"
    )
    for node in info.nodes:
        dead = f", dead0 {node.dead_address} (root end {node.dead_veth})" if node.dead_address else ""
        typer.echo(f"  {node.name}: eth0 {node.address} (root end {node.veth}, netns {node.namespace}){dead}")
    typer.echo(f"  shared dir {info.shared_dir}; logs {info.log_dir}; try: srun -N{len(info.nodes)} hostname")


@app.command()
def down() -> None:
    """Stop all daemons, remove namespaces, veths, bridge and the /etc/hosts block."""
    t0 = time.monotonic()
    try:
        from hpcring.devcluster import cluster  # imported on use: keeps `hpcring --help` fast
        cluster.down()
    except HpcringError as e:
        raise _fail(e) from None
    typer.echo(f"devcluster down in {time.monotonic() - t0:.1f} s")


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
) -> None:
    """Per-node table (namespace, address, slurmd, sinfo state). Exit code 0 only when up."""
    try:
        from hpcring.devcluster import cluster  # imported on use: keeps `hpcring --help` fast
        st = cluster.status()
    except HpcringError as e:
        raise _fail(e) from None
    if as_json:
        typer.echo(json.dumps(st, indent=1))
    else:
        typer.echo(f"devcluster: {st['state']} (cluster {st['cluster']}, partition {st['partition']}, "
                   f"{st['nodes_configured']} nodes configured)")
        daemons = ", ".join(
            f"{name} {'pid ' + str(d['pid']) if d['alive'] else 'NOT RUNNING'}" for name, d in st["daemons"].items()
        )
        typer.echo(f"  daemons: {daemons}")
        typer.echo(f"  bridge {st['bridge']['name']} {st['bridge']['address']}: "
                   f"{'ok' if st['bridge']['ok'] else 'MISSING/BROKEN'}")
        if st["nodes"]:
            rows = [("NODE", "NETNS", "ADDRESS", "NETWORK", "SLURMD", "SINFO")]
            for r in st["nodes"]:
                rows.append((
                    r["name"],
                    r["namespace"] if r["namespace_exists"] else "missing",
                    r["address"],
                    "ok" if r["network_ok"] else "broken",
                    f"{r['slurmd_pid']} alive" if r["slurmd_alive"] else "dead",
                    r["sinfo_state"] or "-",
                ))
            widths = [max(len(str(row[c])) for row in rows) for c in range(len(rows[0]))]
            for row in rows:
                typer.echo("  " + "  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
        for p in st["problems"]:
            typer.echo(f"  problem: {p}")
    raise typer.Exit(0 if st["state"] == "up" else 1)


@app.command(
    "exec",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def exec_(
    node: Annotated[str, typer.Argument(help="Node name, e.g. node1.")],
    cmd: Annotated[list[str], typer.Argument(help="Command to run inside the node (after --).")],
) -> None:
    """Run a command inside a node's namespaces, e.g. `hpcring devcluster exec node1 -- ip addr`."""
    try:
        from hpcring.devcluster import cluster  # imported on use: keeps `hpcring --help` fast
        prefix = cluster.node_exec_argv(node)
    except HpcringError as e:
        raise _fail(e) from None
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        typer.echo("error: no command given; usage: hpcring devcluster exec NODE -- CMD...", err=True)
        raise typer.Exit(2)
    argv = prefix + cmd
    os.execvp(argv[0], argv)

