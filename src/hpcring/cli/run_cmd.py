"""`hpcring run [--nodes N --tasks-per-node K] -- CMD...` (see hpcring.allocation)."""
from __future__ import annotations

from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    from hpcring.cli.common import SiteOpt, command
    from hpcring.cli.jobopts import TIMEOUT_HELP
    from hpcring.config.envvars import MAX_NODES, MAX_TASKS_PER_NODE

    @command(app, "run", context_settings={"allow_interspersed_args": False},
             help="Run CMD on every rank: inside salloc/bsub -Is through the site's launcher, else locally. "
                  "Output is tagged by rank; the exit code is the first failing rank's.")
    def run(cmd: List[str] = typer.Argument(..., help="Command for every rank (after --)."),
            nodes: Optional[int] = typer.Option(None, "--nodes", "-N", min=1, max=MAX_NODES, help="Nodes (default: the allocation's, or 1)."),
            tasks_per_node: Optional[int] = typer.Option(None, "--tasks-per-node", min=1, max=MAX_TASKS_PER_NODE, help="Ranks per node."),
            site: Optional[str] = SiteOpt,
            timeout: Optional[float] = typer.Option(None, "--timeout", help=TIMEOUT_HELP),
            container_image: Optional[str] = typer.Option(None, "--container-image",
                                                          help="Run every rank in this image (the site's runtime)."),
            container_mounts: Optional[List[str]] = typer.Option(None, "--container-mounts",
                                                                 help="SRC[:DST[:OPTS]],... added to the site's mounts."),
            no_container: Optional[bool] = typer.Option(None, "--no-container", help="Run the ranks on the host."),
            elastic: bool = typer.Option(False, "--elastic",
                                         help="CMD is an hpcring.torch.elastic (Horovod Elastic) script: workers lost "
                                              "with their node are replaced from the allocation's spare nodes (those "
                                              "beyond --nodes) and the others go on (docs/from-horovod.md)."),
            min_nodes: Optional[int] = typer.Option(None, "--min-nodes", min=1, max=MAX_NODES,
                                                    help="With --elastic: the fewest nodes to go on with (default: --nodes)."),
            reset_limit: Optional[int] = typer.Option(None, "--reset-limit", min=0,
                                                      help="With --elastic: resets allowed before the job fails "
                                                           "(Horovod's --reset-limit; default none).")):
        import sys

        from hpcring.config.jobspec import parse_field
        from hpcring.config.site import load_site
        from hpcring import allocation
        from hpcring.cli.jobopts import container_of
        parse_field("timeout", timeout, "--timeout")   # refused before anything starts, as submit does
        s = load_site(site)
        box = container_of(s, container_image, list(container_mounts or []), no_container)
        sys.exit(allocation.run(cmd, s, nodes, tasks_per_node, container=box, timeout=timeout,
                                elastic=elastic, min_nodes=min_nodes, reset_limit=reset_limit))
