"""benchmarks/compare_collectives.py on one host, 2 ranks, one small size: every implementation
(ring, Open MPI, Gloo) measures every asked collective with the shared exact check, and the ratio
and Markdown tables come from those rows."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compare_collectives.py"
HAVE_ALL = (importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None
            and importlib.util.find_spec("torch") is not None)


@pytest.mark.skipif(not HAVE_ALL, reason="needs mpi4py + mpirun and torch")
def test_one_host_two_ranks_every_implementation_checked(tmp_path):
    out = tmp_path / "res.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCRING_", "OMPI_"))}
    r = subprocess.run([sys.executable, str(SCRIPT), "--skip", "cluster", "--one-host-ranks", "2", "--sizes", "4K",
                        "--collectives", "reduce_scatter,alltoall,barrier", "--quick", "--markdown",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())["one_host"]["2"]
    assert sorted(res) == ["Open MPI (mpi4py)", "hpcring ring", "torch gloo"]
    for impl, rows in res.items():
        got = sorted((row["collective"], row["size"]) for row in rows)
        # reduce_scatter / alltoall: 4 KiB of float32 over 2 ranks; barrier has no buffer
        assert got == [("alltoall", 4096), ("barrier", 0), ("reduce_scatter", 4096)], (impl, got)
        assert all(row["wrong"] == 0 and row["time"] > 0 and row["n"] == 2 for row in rows), (impl, rows)
    ring_rs = next(row for row in res["hpcring ring"] if row["collective"] == "reduce_scatter")
    assert ring_rs["count"] == 512 and "shared memory" in ring_rs["transport"]
    # the ratio and Markdown tables: one line per collective and size, the three times and two ratios
    line = next(l for l in r.stdout.splitlines() if l.strip().startswith("alltoall") and "KiB" in l)
    cells = line.split()
    assert cells[1:3] == ["4", "KiB"] and cells[-1].endswith("x") and cells[-2].endswith("x"), line
    assert "| 1 host x 2 | 4 KiB |" in r.stdout and "**barrier**" in r.stdout
    assert "# wrong elements in all runs: 0" in r.stdout


def test_rounds_merge_to_each_points_median_with_every_round_kept():
    spec = importlib.util.spec_from_file_location("compare_collectives", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(coll, size, t, wrong=0):
        return {"collective": coll, "size": size, "nominal": size, "time": t, "wrong": wrong}
    rounds = [{"hpcring ring": [row("alltoall", 4096, 3.0), row("barrier", 0, 1.0)], "torch gloo": [row("alltoall", 4096, 9.0)]},
              {"hpcring ring": [row("alltoall", 4096, 1.0, 2), row("barrier", 0, 5.0)], "torch gloo": [row("alltoall", 4096, 7.0)]},
              {"hpcring ring": [row("alltoall", 4096, 2.0), row("barrier", 0, 2.0)]}]
    got = mod.merge_rounds(rounds)
    assert list(got) == ["hpcring ring", "torch gloo"]
    a2a, bar = got["hpcring ring"]
    assert (a2a["collective"], a2a["time"], a2a["times"], a2a["wrong"]) == ("alltoall", 2.0, [3.0, 1.0, 2.0], 2)
    assert (bar["time"], bar["times"]) == (2.0, [1.0, 5.0, 2.0])
    assert got["torch gloo"][0]["time"] == 8.0 and got["torch gloo"][0]["times"] == [9.0, 7.0]
    assert rounds[0]["hpcring ring"][0]["time"] == 3.0            # the rounds' own rows untouched
