"""The dev cluster under test is the Slurm release $HPCRING_DEVCLUSTER_SLURM names (22.05 when unset)."""
from __future__ import annotations

import os
import subprocess

from helpers.release import release_problem


def test_slurm_commands_and_daemons_are_the_named_release() -> None:
    want = os.environ.get("HPCRING_DEVCLUSTER_SLURM") or "22.05"
    for cmd in (["srun", "--version"], ["sinfo", "--version"], ["sacct", "--version"]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        assert out.split()[-1].startswith(want + "."), (cmd, out)
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    version = next(line.split("=", 1)[1].strip() for line in config.splitlines() if line.startswith("SLURM_VERSION"))
    assert version.startswith(want + "."), version  # slurmctld's own


def test_a_release_outside_its_world_is_refused() -> None:
    assert release_problem({}) is None
    assert release_problem({"HPCRING_DEVCLUSTER_SLURM": "22.05"}) is None
    assert release_problem({"HPCRING_DEVCLUSTER_SLURM": "24.11", "HPCRING_DEVCLUSTER_WORLD": "24.11"}) is None
    problem = release_problem({"HPCRING_DEVCLUSTER_SLURM": "24.11"})
    assert problem and "hpcring devcluster login --slurm 24.11" in problem
