"""The tests here need the real Slurm dev cluster (`hpcring devcluster up`, as root): each is marked
`devcluster` and skipped when the cluster does not answer (asked once per session)."""
from __future__ import annotations

import os
import functools
import time
from pathlib import Path

import pytest

from helpers.jobs import cluster_up, sinfo_states
from helpers.release import release_problem

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.devcluster)


@pytest.fixture(scope="session")
def devcluster_up() -> None:
    """Skips unless the dev cluster has a usable node, waiting out a moment when every node is
    between jobs ('completing', seen right after a previous test's srun); no Slurm: at once.
    Fails when the variable asks for a release this pytest cannot reach (never tests another)."""
    problem = release_problem(os.environ)
    if problem:
        pytest.fail(problem, pytrace=False)
    for _ in range(10):
        if cluster_up():
            return
        if sinfo_states() is None:
            break
        time.sleep(2)
    pytest.skip("dev cluster is not up (hpcring devcluster up)")


@pytest.fixture(autouse=True)
def _needs_devcluster(devcluster_up) -> None:
    pass


@pytest.fixture(scope="session")
def hpcring(hpcring):
    """The conftest runner with a 300 s bound here: a dev-cluster job may queue behind another first."""
    return functools.partial(hpcring, timeout=300)
