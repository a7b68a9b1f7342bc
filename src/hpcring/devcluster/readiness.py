"""Node states as sinfo reports them, and the wait until every node is idle.

`up` returns only when jobs can start on every node: a node that registered but is still
marked not responding (``idle*``), drained by an earlier fault, or down is brought back here.
"""
from __future__ import annotations

import time

from hpcring.errors import DevClusterError

from . import names as n
from .system import log_tail, ok, output

NODE_HEALTHY_STATES = {"idle", "mixed", "allocated", "completing"}
IDLE_DEADLINE_S = 40.0


def base_state(state: str | None) -> str:
    """sinfo's state without its flag suffixes (``idle*`` -> ``idle``), lower case."""
    return (state or "").rstrip("*~#!%$@^-+").lower()


def _responding_and_healthy(state: str | None) -> bool:
    return base_state(state) in NODE_HEALTHY_STATES and not (state or "").endswith("*")


def sinfo_states() -> dict[str, str]:
    """``{node name: sinfo state}``; {} when sinfo does not answer."""
    out = output(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10)
    states: dict[str, str] = {}
    for line in (out or "").splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def wait_nodes_idle(nodes: int, actions: list[str]) -> None:
    """Wait up to IDLE_DEADLINE_S for node1..node<nodes> to be healthy and responding in sinfo."""
    names = [n.node_name(i) for i in range(1, nodes + 1)]
    resumed: set[str] = set()
    reconfigured = False
    start = time.monotonic()
    deadline = start + IDLE_DEADLINE_S
    states: dict[str, str] = {}
    while True:
        states = sinfo_states()
        bad = [x for x in names if not _responding_and_healthy(states.get(x))]
        if not bad:
            return
        not_responding = [x for x in bad if base_state(states.get(x)) in NODE_HEALTHY_STATES]
        if not_responding and not reconfigured and (resumed or time.monotonic() - start > 2):
            # "idle*" (no response yet, e.g. right after a resume) clears at the next ping, up to
            # SlurmdTimeout/3 later; a reconfigure makes every slurmd answer now.
            ok(["scontrol", "reconfigure"])
            reconfigured = True
        for x in bad:
            # Its slurmd is healthy (checked before), so a node an admin or an earlier fault left
            # drained is resumed at once; a down one only if registering did not bring it back.
            base = base_state(states.get(x))
            if x not in resumed and (
                base in {"drained", "draining"}
                or (base in {"down", "fail", "failing"} and time.monotonic() - start > 3)
            ):
                if ok(["scontrol", "update", f"NodeName={x}", "State=RESUME"]):
                    actions.append(f"resumed {x} (was {base})")
                resumed.add(x)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.3)
    bad = [x for x in names if not _responding_and_healthy(states.get(x))]
    detail = ", ".join(f"{x}={states.get(x, 'absent')}" for x in bad)
    tails = "".join(log_tail(n.slurmd_log(n.node_index(x)), 10) for x in bad[:2])
    raise DevClusterError(
        f"nodes not idle in sinfo after {IDLE_DEADLINE_S:.0f} s: {detail}" + tails + log_tail(n.SLURMCTLD_LOG, 10),
        hint="see `scontrol show node <name>` (Reason=) and the slurmd logs in " + str(n.LOG_DIR),
    )
