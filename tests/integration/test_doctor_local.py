"""`hpcring doctor` as a job's command: two local ranks through `hpcring run` (the checks themselves,
in-process, are in tests/unit/test_doctor.py)."""
from __future__ import annotations

import json
import os
import sys


def test_local_run_of_the_cli_on_two_ranks(hpcring, tmp_path):
    # an allocation or launcher of the developer's would change what `run` starts
    env = {k: None for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI"))}
    out = tmp_path / "doctor.json"
    r = hpcring("run", "--nodes", "2", "--tasks-per-node", "1", "--",
                sys.executable, "-m", "hpcring", "doctor", "--json", str(out), "--bw-seconds", "0.2",
                env=env, drop_hpcring_env=True, timeout=120)
    report = json.loads(out.read_text())
    # Loopback bandwidth on a shared 2-core machine is noisy, so the bandwidth verdict is not asserted;
    # the exit code must follow the verdict either way.
    assert r.returncode == report["exit_code"], r.stderr[-3000:] + r.stdout[-3000:]
    assert "[0]<stdout>:hpcring doctor: 2 ranks on 2 hosts: local0 (rank 0), local1 (rank 1)" in r.stdout
    assert f"[0]<stdout>:verdict: {report['verdict']}" in r.stdout and "[1]<stdout>" not in r.stdout  # rank 0 prints
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {"interfaces": "OK", "names/MTU": "OK", "env": "OK", "connectivity lo": "OK",
                        "bandwidth": statuses["bandwidth"]}
    assert len(report["links"]) == 2 and all(lk.get("rate", 0) > 0 for lk in report["links"])
