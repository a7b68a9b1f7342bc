"""``<folder>/steps.json``: the step loop's record of a job (:mod:`hpcring.steps` writes it); its
name and its readers (``hpcring status``: jobstatus, restarts)."""
from __future__ import annotations

import json
import os
from pathlib import Path

STEPS_FILE = "steps.json"


def read_steps(folder: str | os.PathLike) -> dict | None:
    """The step loop's record of a job (None when the job ran no step loop)."""
    try:
        data = json.loads((Path(folder) / STEPS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("steps"), list) else None


def final_size(folder: str | os.PathLike, default: int) -> int:
    """The ranks of the job's last step (``--min-nodes`` may have shrunk it); ``default`` otherwise."""
    data = read_steps(folder) or {}
    steps = data.get("steps") or []
    size = steps[-1].get("size") if steps and isinstance(steps[-1], dict) else None
    return size if isinstance(size, int) and 0 < size <= default else default


def step_lines(data: dict | None) -> list[str]:
    """``step 0  node[1-2]  4 ranks  FAILED: <cause>  -> restart 1 on node1,node3 (spare node3)``."""
    out = []
    pre = (data or {}).get("preflight")
    if isinstance(pre, dict):
        bad = pre.get("bad") if isinstance(pre.get("bad"), dict) else {}
        out.append(f"preflight  {pre.get('seconds')} s  " + ("ok" if not bad else "left out " + "; ".join(
            f"{h} ({why})" for h, why in bad.items())))
    for s in (data or {}).get("steps") or []:
        if not isinstance(s, dict):
            continue
        hosts = ",".join(map(str, s.get("hosts") or []))
        spare = f" (spare {','.join(s['spares'])})" if s.get("spares") else ""
        end = f"  {s['end']}" if s.get("end") else "  running"
        then = f"  -> {s['decision']}" if s.get("decision") else ""
        lost = f"  ({s['lost_s']:.1f} s from the fault's first sign to the next step)" if isinstance(s.get("lost_s"), (int, float)) else ""
        out.append(f"step {s.get('attempt')}  {hosts}{spare}  {s.get('size')} ranks{end}{then}{lost}")
    return out
