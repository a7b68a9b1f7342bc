"""The scale harness (benchmarks/scale_sim.py) at 256 ranks: threads in 4 processes, each rank
running the real bootstrap against the real store (its own process), the real watchdog, the
real straggler watcher and the real C ring over loopback TCP. Asserts correctness only (every allreduce result exact, every rank
through every phase, the frozen rank named by every rank's report), never time: the machine is
shared."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _harness():
    spec = importlib.util.spec_from_file_location("scale_sim", ROOT / "benchmarks" / "scale_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_256_ranks_exact_results_and_the_frozen_rank_is_named():
    sim = _harness()
    row = sim.run_one(256, per_proc=64, per_host=8, deadline=5.0, grace=5.0, timeout=240.0,
                      iters_small=3, iters_big=1, big=1 << 20, straggler_ops=150, straggler_ms=10.0)
    assert row["n_errors"] == 0, row["errors"]
    assert row["ok_ranks"] == 256 and row["procs"] == 4 and row["hosts"] == 32
    assert row["wrong"] == 0                      # every 4 B and 1 MiB result equals the exact sum
    assert row["small_us"] is not None and row["big_ms"] is not None
    assert row["frozen_named"], row["headline"]
    # the straggler phase's slow rank is named by rank 0's watcher while the collectives run
    assert row["straggler_at"] is not None and row["straggler_at"] <= 150, row["straggler_line"]
    assert row["straggler_line"].startswith("straggler: rank 254 (node32) arrived last in "), row["straggler_line"]
    # collective 1 connects, 2-4 are the 4-byte ones, 5 the 1 MiB one, 6-155 the straggler
    # phase's: the frozen rank skips 156
    assert row["headline"] == "allreduce#156: rank 255 (node32) never joined"
    report = row["report"].splitlines()
    assert "  joined    : ranks 0-254 (node[1-32])" in report
    assert any(line.startswith("  missing   : rank 255 (node32): never joined") and "in load_batch" in line
               for line in report), row["report"]
    assert len(report) <= 10                      # one screen
    # the watchdog's steps, in order on every rank that took them, and each rank's CPU per phase
    steps = row["report_steps"]
    assert steps["published"][0] == steps["report"][0] == 256 and steps["triggered"][0] == 255
    assert 5.0 <= steps["triggered"][1] <= steps["published"][1] <= steps["report"][1] <= steps["report"][2]
    assert set(row["rank_cpu_ms"]) == {"cpu_init", "cpu_conn", "cpu_fail"}
    assert all(0 < mean <= worst for mean, worst in row["rank_cpu_ms"].values())
    # the machine's busy cores per second from the frozen collective's start, over the failure
    busy = row["busy_cores"]
    assert len(busy) >= int(row["frozen_to_report_s"]) and all(0 <= b <= (os.cpu_count() or 1) + 0.5 for b in busy)
