"""The fault matrix's runner (benchmarks/fault_matrix.py, loaded from its path) and the checks every
fault's run must pass: the fault seen, the victim named, the job FAILED and gone within the deadline + 30 s."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fault_matrix", ROOT / "benchmarks" / "fault_matrix.py")
fault_matrix = importlib.util.module_from_spec(_spec)
sys.modules["fault_matrix"] = fault_matrix      # dataclasses look their module up there
_spec.loader.exec_module(fault_matrix)

DEADLINE = 6.0


def check(res: fault_matrix.Result) -> None:
    print(f"\n[{res.where}/{res.backend}/{res.fault}] ->report {fault_matrix._fmt(res.dt(res.report_at))} s, "
          f"->gone {fault_matrix._fmt(res.dt(res.gone_at))} s, ->queue {fault_matrix._fmt(res.dt(res.queue_at))} s")
    assert res.fault_at is not None, res.out[-3000:]
    assert res.named, (res.headline, res.out[-3000:])
    assert res.state == "FAILED", (res.state, res.out[-3000:])
    assert res.dt(res.gone_at) is not None and res.dt(res.gone_at) <= DEADLINE + 30, res.out[-3000:]
    assert res.dt(res.queue_at) is not None and res.dt(res.queue_at) <= DEADLINE + 30, res.out[-3000:]
    assert res.rc != 0
