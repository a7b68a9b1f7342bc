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


SlurmOption = Annotated[
    Optional[str],
    typer.Option("--slurm", help="Slurm release: 22.05 (this machine's) or 24.11 (in a world of its own, "
                                 "beside 22.05); default $HPCRING_DEVCLUSTER_SLURM or 22.05."),
]


def _elsewhere(slurm: Optional[str]):
    """The Release to run the command in when it is not this process's own; None to run here."""
    from hpcring.devcluster import world  # imported on use: keeps `hpcring --help` fast
    version = world.chosen(slurm)
    if world.runs_here(version):
        return None
    return world.release(version)


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
    slurm: SlurmOption = None,
) -> None:
    """Start the cluster, or repair it (idempotent). Waits until all nodes are idle."""
    try:
        rel = _elsewhere(slurm)
        if rel is not None:
            from hpcring.devcluster import world
            t0 = time.monotonic()
            for a in world.prepare(rel):
                typer.echo(f"  {a}")
            args = ["devcluster", "up", "--nodes", str(nodes),
                    "--dead-interface" if dead_interface else "--no-dead-interface"]
            for path in share or []:
                args += ["--share", path]
            rc = world.run_inside(rel, world.cli_argv(*args), timeout=600)
            if rc == 0:
                typer.echo(f"devcluster (Slurm {rel.version}) up in {time.monotonic() - t0:.1f} s in all; run "
                           f"commands and tests on it with `hpcring devcluster login --slurm {rel.version} -- CMD`")
            raise typer.Exit(rc)
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
def down(slurm: SlurmOption = None) -> None:
    """Stop all daemons, remove namespaces, veths, bridge and the /etc/hosts block."""
    t0 = time.monotonic()
    try:
        rel = _elsewhere(slurm)
        if rel is not None:
            from hpcring.devcluster import world
            rc = 0
            if world.world_ok(rel):
                rc = world.run_inside(rel, world.cli_argv("devcluster", "down"), timeout=300)
            world.take_down(rel)
            typer.echo(f"devcluster (Slurm {rel.version}) down and its world ended in {time.monotonic() - t0:.1f} s")
            raise typer.Exit(rc)
        from hpcring.devcluster import cluster  # imported on use: keeps `hpcring --help` fast
        cluster.down()
    except HpcringError as e:
        raise _fail(e) from None
    typer.echo(f"devcluster down in {time.monotonic() - t0:.1f} s")


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
    slurm: SlurmOption = None,
) -> None:
    """Per-node table (namespace, address, slurmd, sinfo state). Exit code 0 only when up."""
    try:
        rel = _elsewhere(slurm)
        if rel is not None:
            from hpcring.devcluster import world
            if not world.world_ok(rel):
                msg = f"world of Slurm {rel.version} not running ({rel.ns_dir}): `hpcring devcluster up --slurm {rel.version}`"
                typer.echo(json.dumps({"state": "down", "release": rel.version, "problems": [msg]}, indent=1)
                           if as_json else f"devcluster (Slurm {rel.version}): down\n  problem: {msg}")
                raise typer.Exit(1)
            raise typer.Exit(world.run_inside(rel, world.cli_argv("devcluster", "status", *(["--json"] if as_json else [])),
                                              timeout=60))
        from hpcring.devcluster import cluster  # imported on use: keeps `hpcring --help` fast
        st = cluster.status()
    except HpcringError as e:
        raise _fail(e) from None
    if as_json:
        typer.echo(json.dumps(st, indent=1))
    else:
        typer.echo(f"devcluster (Slurm {st.get('slurm', '22.05')}): {st['state']} (cluster {st['cluster']}, "
                   f"partition {st['partition']}, "
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
    slurm: SlurmOption = None,
) -> None:
    """Run a command inside a node's namespaces, e.g. `hpcring devcluster exec node1 -- ip addr`."""
    try:
        rel = _elsewhere(slurm)
        if rel is not None:
            from hpcring.devcluster import world
            inner = cmd[1:] if cmd[:1] == ["--"] else cmd
            argv = world.enter_argv(rel) + world.cli_argv("devcluster", "exec", node, "--", *inner)
            os.execvpe(argv[0], argv, world.world_env(rel))
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



@app.command(
    "login",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def login(
    cmd: Annotated[list[str], typer.Argument(help="Command to run (after --), e.g. pytest tests/devcluster.")],
    slurm: SlurmOption = None,
) -> None:
    """Run a command on the login side of a release's cluster (its Slurm commands, addresses, files),
    with $HPCRING_DEVCLUSTER_SLURM set: `hpcring devcluster login --slurm 24.11 -- srun -N3 hostname`."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        typer.echo("error: no command given; usage: hpcring devcluster login [--slurm 24.11] -- CMD...", err=True)
        raise typer.Exit(2)
    try:
        from hpcring.devcluster import names, world
        rel = _elsewhere(slurm)
        if rel is None:
            os.execvpe(cmd[0], cmd, dict(os.environ, **{names.RELEASE_ENV: world.chosen(slurm)}))
        if not world.world_ok(rel):
            from hpcring.errors import DevClusterError
            raise DevClusterError(f"the Slurm {rel.version} dev cluster's world is not running",
                                  hint=f"start it with `hpcring devcluster up --slurm {rel.version}`")
    except HpcringError as e:
        raise _fail(e) from None
    argv = world.enter_argv(rel) + cmd
    os.execvpe(argv[0], argv, world.world_env(rel))
