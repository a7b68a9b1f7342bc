"""Which Slurm release the dev cluster tests mean, and whether this pytest can reach it."""
from __future__ import annotations

from collections.abc import Mapping


def release_problem(environ: Mapping[str, str]) -> str | None:
    """Why these tests cannot run on the release $HPCRING_DEVCLUSTER_SLURM names (None: they can).
    A release other than the machine's runs in its own world; outside it, srun is 22.05's."""
    want = environ.get("HPCRING_DEVCLUSTER_SLURM") or "22.05"
    if want == "22.05" or environ.get("HPCRING_DEVCLUSTER_WORLD") == want:
        return None
    return (f"HPCRING_DEVCLUSTER_SLURM={want}, but this pytest runs outside that release's world: run it "
            f"as `hpcring devcluster login --slurm {want} -- python -m pytest ...` "
            f"(after `hpcring devcluster up --slurm {want}`)")
