"""``hpcring nodes list|clear``: the site's node history (:mod:`hpcring.nodehistory`), which leaves
nodes blamed again and again out of new jobs. Thin: the library reads, decides and writes."""
from __future__ import annotations

from typing import List, Optional

import typer

from hpcring.cli.common import SITE_HELP, command

app = typer.Typer(no_args_is_help=True,
                  help="Nodes that failed jobs blamed (the site's node history): list them, clear them.")


def _site(ref: Optional[str]):
    from hpcring.config.site import load_site
    return load_site(ref)


@command(app, "list", help="Each node a finished job blamed: blames within the window, in all, the last time "
                           "(UTC), job and reason, and whether new jobs leave it out.")
def nodes_list(site: Optional[str] = typer.Option(None, "--site", "-s", help=SITE_HELP)):
    from hpcring import nodehistory as nh
    from hpcring.cli import output
    s = _site(site)
    root, _ = nh.site_root(s)
    pol = nh.policy(s)
    rows = nh.summarize(nh.read(root, nh.site_word(s)), pol)
    output.nodes_table(nh.history_path(root), s.name, pol, rows)


@command(app, "clear", help="Forget NODE... (or --all) in the site's node history: new jobs use them again.")
def nodes_clear(nodes: Optional[List[str]] = typer.Argument(None, help="Node names, as `hpcring nodes list` shows."),
                every: bool = typer.Option(False, "--all", help="Forget every node (also repairs a corrupt history)."),
                site: Optional[str] = typer.Option(None, "--site", "-s", help=SITE_HELP)):
    from hpcring import nodehistory as nh
    from hpcring.cli import output
    from hpcring.config.text import shown
    from hpcring.errors import HpcringError, UsageError
    from hpcring.restarts import is_host_name
    nodes = list(nodes or [])
    if every == bool(nodes):
        raise UsageError("name the nodes to clear, or --all, not both" if every else "which nodes? none was named",
                         hint="`hpcring nodes clear node2 node5`, or `hpcring nodes clear --all`; "
                              "`hpcring nodes list` shows them")
    for n in nodes:
        if not is_host_name(n):
            raise UsageError(f"node {shown(n)} is no host name", hint="host names are letters, digits, '.', '_' "
                                                                     "and '-'; `hpcring nodes list` shows them")
    s = _site(site)
    root, _ = nh.site_root(s)
    path = nh.history_path(root)
    removed, dropped = nh.clear(root, nodes or None, nh.site_word(s))
    cleared = {n: k for n, k in removed.items() if k}
    junk = f"{dropped} corrupt line{'s' if dropped > 1 else ''} dropped" if dropped else ""
    if cleared:
        output.info(f"node history {path}: cleared " + ", ".join(f"{n} ({k} blame{'s' if k > 1 else ''})"
                                                                for n, k in cleared.items())
                    + (f" ({junk})" if junk else "") + "; new jobs use them again")
    elif every:
        output.info(f"node history {path}: " + (f"emptied ({junk})" if junk else "nothing to clear: no node "
                                                "is recorded"))
    unknown = [n for n, k in removed.items() if not k]
    if unknown and not every:
        raise HpcringError(f"node{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                           f"{'are' if len(unknown) > 1 else 'is'} not in the node history {path}: nothing to clear",
                           hint=f"`hpcring nodes list{' --site ' + nh.site_word(s) if site else ''}` shows the "
                                "recorded nodes")
