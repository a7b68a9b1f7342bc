"""Synthetic rank summaries for the job report's tests: a valid one, and a job's worth from arrival times."""
from __future__ import annotations

import types

from hpcring.diagnostics import rank_summary
from hpcring.collectives.recorder import Totals


def valid_summary(rank=0, **over):
    """One rank's summary that passes the check; ``over`` replaces top-level fields."""
    base = 1.8e9
    d = {"version": 1, "rank": rank, "size": 2, "host": "n1", "pid": 1, "written": base + 10, "why": "exit",
         "process_started": base,
         "comms": [{"name": "ring", "backend": "ring", "rank": rank, "size": 2,
                    "totals": {"done": 2, "failed": 0, "base": base + 1, "first_started": base + 1,
                               "last_ended": base + 3, "sum_started": 1.0, "sum_inside": 0.5, "sum_failed": 0.0},
                    "tail": {"seq": [1, 2], "started": [0.0, 1.0], "ended": [0.2, 1.3]}}]}
    d.update(over)
    return d


def make_summaries(arrivals: dict[int, list[float]], comm_s: float = 0.001, t0: float = 1.8e9,
                   tail: int = rank_summary.TAIL) -> tuple[dict, dict, dict]:
    """Summaries of ranks whose k-th collective starts at t0 + arrivals[r][k] and ends comm_s after
    the last rank arrived; and the true waiting per rank."""
    ranks = sorted(arrivals)
    n = len(arrivals[ranks[0]])
    last = [max(arrivals[r][k] for r in ranks) for k in range(n)]
    out, truth = {}, {}
    for r in ranks:
        tot = Totals()
        for k in range(n):
            tot.add(types.SimpleNamespace(t_started=t0 + arrivals[r][k], t_ended=t0 + last[k] + comm_s, state="done"))
        keep = range(max(0, n - tail), n)
        out[r] = {"version": 1, "rank": r, "size": len(ranks), "host": f"n{r}", "pid": 1, "why": "exit",
                  "written": t0 + last[-1] + 1.0, "process_started": t0 - 1.0,
                  "comms": [{"name": "ring", "backend": "ring", "rank": r, "size": len(ranks), "totals": tot.to_dict(),
                             "tail": {"seq": [k + 1 for k in keep],
                                      "started": [t0 + arrivals[r][k] - tot.base for k in keep],
                                      "ended": [t0 + last[k] + comm_s - tot.base for k in keep]}}]}
        truth[r] = sum(last[k] - arrivals[r][k] for k in range(n))
    statuses = {r: {"rank": r, "host": f"n{r}", "started": t0 - 1.0, "ended": t0 + last[-1] + 1.0, "exit_code": 0}
                for r in ranks}
    return statuses, out, truth
