"""Reading one launcher table (launcher_tables.py) from the environment, checked: the fields and the
variable each came from; Slurm's task layout and the local backend's block order give the hosts.
Used by launchers.py (detection) and launcher_corroborate.py."""
from __future__ import annotations

from collections.abc import Mapping

from hpcring import hostlist
from hpcring.bootstrap.launcher_tables import SLURM_MAX_TASK_STEP, UNKNOWN, LauncherTable, env_get, first
from hpcring.bootstrap.slurm_layout import block, cyclic, parse_tasks_per_node
from hpcring.errors import BootstrapError, HostlistError

_INT_FIELDS = ("rank", "size", "local_rank", "local_size", "node_rank", "num_nodes")
_RANK_FIELDS = ("rank", "size", "local_rank", "local_size")


class _Reading:
    """Fields read from one table so far, with the variable each came from."""

    def __init__(self, launcher: str) -> None:
        self.launcher = launcher
        self.values: dict[str, object] = {}
        self.sources: dict[str, str] = {}

    def set(self, name: str, value: object, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def get(self, name: str, default: object = None) -> object:
        return self.values.get(name, default)

    def known(self, name: str) -> bool:
        return self.values.get(name, UNKNOWN) not in (UNKNOWN, None)


def _matches(table: LauncherTable, env: Mapping[str, str]) -> bool:
    """Whether the table's marker variables are set (and, for ``local``, have the pinned value)."""
    if not all(env_get(env, v) is not None for v in table.marker):
        return False
    if table.marker_value is not None and env[table.marker[0]] != table.marker_value:
        return False
    if table.step_id:
        return _is_task_step(env[table.step_id[0]])
    return True


def _is_task_step(step_id: str) -> bool:
    """SLURM_STEP_ID of a real srun step (not batch/extern/interactive pseudo-steps)."""
    return step_id.isdigit() and int(step_id) < SLURM_MAX_TASK_STEP


def _marker_text(table: LauncherTable, env: Mapping[str, str]) -> str:
    return " ".join(f"{v}={env[v]}" for v in table.marker)


def _parse_int(var: str, value: str, table: str) -> int:
    """Non-negative int from a variable, or BootstrapError naming it."""
    text = value.strip()
    if not text.isdigit():
        raise BootstrapError(f"{table}: {var}={value!r} is not a non-negative integer",
                             hint="the launcher environment is damaged or was set by hand")
    return int(text)


def _read(table: LauncherTable, env: Mapping[str, str]) -> _Reading:
    """Read and check one table. Raises BootstrapError for partial/contradictory variables."""
    r = _Reading(table.name)
    for f in (*_INT_FIELDS, "master_port"):
        found = first(env, getattr(table, f))
        if found:
            r.set(f, _parse_int(*found, table.name), found[0])
    if table.rank_base and r.known("rank"):
        if r.get("rank") < table.rank_base:
            raise BootstrapError(f"{table.name}: {r.sources['rank']}={r.get('rank')} but it counts from "
                                 f"{table.rank_base}", hint="the launcher environment is damaged or was set by hand")
        r.set("rank", r.get("rank") - table.rank_base, f"{r.sources['rank']}-{table.rank_base}")
    for f in ("job_id", "master_addr", "nodelist", "tasks_per_node", "hostname"):
        found = first(env, getattr(table, f))
        if found:
            r.set(f, found[1].strip(), found[0])
    missing = [f for f in table.required if f not in r.values]
    if missing:
        present = ", ".join(f"{v}={env[v]}" for v in table.marker)
        wanted = ", ".join("/".join(getattr(table, f)) for f in missing)
        raise BootstrapError(f"{table.name}: {present} is set but {wanted} "
                             f"{'is' if len(missing) == 1 else 'are'} missing",
                             hint="a launcher that sets some of these sets all of them; "
                                  "was the environment copied or edited by hand?")
    _check_ranges(r)
    if table.name == "slurm":
        _slurm_hosts(r, env)
    elif table.name == "local":
        _local_hosts(r)
    return r


def _check_ranges(r: _Reading) -> None:
    """rank < size, local_rank < local_size, node_rank < num_nodes, local_size <= size."""
    for small, big in (("rank", "size"), ("local_rank", "local_size"), ("node_rank", "num_nodes")):
        if r.known(small) and r.known(big) and r.get(small) >= r.get(big):
            raise BootstrapError(f"{r.launcher}: {r.sources[small]}={r.get(small)} is not below "
                                 f"{r.sources[big]}={r.get(big)}")
    if r.known("local_size") and r.known("size") and r.get("local_size") > r.get("size"):
        raise BootstrapError(f"{r.launcher}: {r.sources['local_size']}={r.get('local_size')} is "
                             f"larger than {r.sources['size']}={r.get('size')}")


def _expand_nodes(r: _Reading) -> list[str]:
    """Nodes of the reading's nodelist; HostlistError becomes BootstrapError naming the variable."""
    try:
        return hostlist.expand(str(r.get("nodelist")))
    except HostlistError as e:
        raise BootstrapError(f"{r.launcher}: {r.sources['nodelist']} is not a valid hostlist: "
                             f"{e.message}") from None


# --------------------------------------------------------------------------------------- slurm

def _slurm_hosts(r: _Reading, env: Mapping[str, str]) -> None:
    """Check the step's node and task layout; set local_size, num_nodes and (if derivable) hosts."""
    nodes = _expand_nodes(r)
    if r.known("num_nodes") and len(nodes) != r.get("num_nodes"):
        raise BootstrapError(f"slurm: {r.sources['nodelist']}={r.get('nodelist')} has {len(nodes)} "
                             f"hosts but {r.sources['num_nodes']}={r.get('num_nodes')}")
    if not r.known("num_nodes"):
        r.set("num_nodes", len(nodes), r.sources["nodelist"])
    tpn_var, tpn = r.sources["tasks_per_node"], str(r.get("tasks_per_node"))
    try:
        counts = parse_tasks_per_node(tpn)
    except ValueError as e:
        raise BootstrapError(f"slurm: {tpn_var}={tpn!r} is malformed ({e}); expected e.g. 2(x3),1") from None
    if len(counts) != len(nodes):
        raise BootstrapError(f"slurm: {tpn_var}={tpn} describes {len(counts)} nodes but "
                             f"{r.sources['nodelist']}={r.get('nodelist')} has {len(nodes)}")
    if sum(counts) != r.get("size"):
        raise BootstrapError(f"slurm: {tpn_var}={tpn} adds up to {sum(counts)} tasks but "
                             f"{r.sources['size']}={r.get('size')}")
    node = r.get("node_rank")
    if node >= len(nodes):
        raise BootstrapError(f"slurm: SLURM_NODEID={node} but the step has {len(nodes)} nodes "
                             f"({r.sources['nodelist']}={r.get('nodelist')})")
    r.set("local_size", counts[node], f"{tpn_var}[SLURM_NODEID]")
    _check_ranges(r)
    if r.get("hostname") is not None and r.get("hostname") != nodes[node]:
        raise BootstrapError(f"slurm: SLURMD_NODENAME={r.get('hostname')} but node SLURM_NODEID={node} "
                             f"of {r.sources['nodelist']}={r.get('nodelist')} is {nodes[node]}")
    _slurm_rank_hosts(r, env, nodes, counts)


def _slurm_rank_hosts(r: _Reading, env: Mapping[str, str], nodes: list[str], counts: list[int]) -> None:
    """Host of every rank from Slurm's task distribution, if it is block or cyclic and checks out."""
    dist = (env_get(env, "SLURM_DISTRIBUTION") or "block").split(":")[0]
    layout = {"block": block, "cyclic": cyclic}.get(dist)
    how = f"{r.sources['nodelist']}+{r.sources['tasks_per_node']} ({dist} distribution)"
    if layout is None:
        r.sources["hosts"] = f"unknown: SLURM_DISTRIBUTION={dist} is neither block nor cyclic"
        r.set("own_host", nodes[r.get("node_rank")], r.sources["nodelist"])
        return
    rank_nodes = layout(counts)
    rank, node = r.get("rank"), r.get("node_rank")
    same_node = [q for q, n in enumerate(rank_nodes) if n == node]
    # Why check: a distribution Slurm did not announce (plane, arbitrary) shows up right here.
    if rank_nodes[rank] != node or same_node.index(rank) != r.get("local_rank"):
        r.sources["hosts"] = (f"unknown: {how} does not put SLURM_PROCID={rank} at "
                              f"SLURM_NODEID={node}, SLURM_LOCALID={r.get('local_rank')}")
        r.set("own_host", nodes[node], r.sources["nodelist"])
        return
    r.set("hosts", tuple(nodes[n] for n in rank_nodes), how)


# --------------------------------------------------------------------------------------- local

def _local_hosts(r: _Reading) -> None:
    """hpcring's local backend: ``num_nodes x local_size`` ranks in block order over the nodelist."""
    nodes = _expand_nodes(r)
    if len(nodes) != r.get("num_nodes"):
        raise BootstrapError(f"local: HPCRING_NODELIST={r.get('nodelist')} has {len(nodes)} hosts but "
                             f"HPCRING_NUM_NODES={r.get('num_nodes')}")
    per = r.get("local_size")
    if per * len(nodes) != r.get("size"):
        raise BootstrapError(f"local: HPCRING_SIZE={r.get('size')} is not HPCRING_NUM_NODES={len(nodes)} "
                             f"x HPCRING_LOCAL_SIZE={per}")
    if r.get("rank") != r.get("node_rank") * per + r.get("local_rank"):
        raise BootstrapError(f"local: HPCRING_RANK={r.get('rank')} does not match HPCRING_NODE_RANK="
                             f"{r.get('node_rank')} x {per} + HPCRING_LOCAL_RANK={r.get('local_rank')}")
    own = nodes[r.get("node_rank")]
    if r.get("hostname") is not None and r.get("hostname") != own:
        raise BootstrapError(f"local: HPCRING_HOSTNAME={r.get('hostname')} but node HPCRING_NODE_RANK="
                             f"{r.get('node_rank')} of HPCRING_NODELIST={r.get('nodelist')} is {own}")
    r.set("hosts", tuple(nodes[q // per] for q in range(r.get("size"))), "HPCRING_NODELIST (block)")
