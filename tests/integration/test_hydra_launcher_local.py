"""hydra/launcher=hpcring with real Hydra on the local backend: every point of a multirun is an
hpcring job (examples/hydra_app, 2 ranks a point) and returns to Hydra; a failing point is
reported as Hydra reports its own launchers' failures while the others complete; the parallel
limit holds; a bad launcher config is refused before anything is queued; and Hydra's own launcher
test suites (hydra.test_utils.launcher_common_tests) pass."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")

from hydra.core.utils import JobStatus  # noqa: E402
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, LauncherTestSuite  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import hpcring  # noqa: E402
from hpcring.errors import JobFailedError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "hydra_app" / "app.py"
CONF = ROOT / "examples" / "hydra_app" / "conf"


@pytest.fixture
def env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("HPCRING_SITE", "local")
    monkeypatch.setenv("HPCRING_LOCAL_GRACE_S", "1")   # a failed rank's partners are stopped after 1 s, not 10
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def app(tmp_path, *overrides, timeout=300, env=None):
    """``python examples/hydra_app/app.py -m OVERRIDES`` with its sweep in ``tmp_path/sweep``."""
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **(env or {}))
    return subprocess.run([sys.executable, str(APP), "-m", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          capture_output=True, text=True, env=e, timeout=timeout, cwd=str(tmp_path),
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def hpcring_cli(request):
    """The conftest `hpcring` runner (here `hpcring` names the library) with a 120 s bound."""
    return functools.partial(request.getfixturevalue("hpcring"), timeout=120)


def result(sweep: Path, num: int) -> dict:
    return json.loads((sweep / str(num) / "result.json").read_text())


def at_most_two_at_once(spans):
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 2, spans
    assert max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans) == 2, spans   # and 2 did run together


def test_every_point_runs_as_an_hpcring_job(hpcring_cli, env):
    r = app(env, "hydra/launcher=hpcring", "x=1,2,3,4", "sleep=2")
    assert r.returncode == 0, r.stdout + r.stderr
    sweep = env / "sweep"
    points = [result(sweep, n) for n in range(4)]
    array = points[0]["job_id"].split("_")[0]
    for n, got in enumerate(points):
        x = n + 1
        # the allreduce of x*(rank+1) over 2 ranks: every point ran on both ranks of its own job
        assert (got["x"], got["sum"], got["size"], got["host"]) == (x, 3.0 * x, 2, "local0"), got
        assert (got["job_id"], got["num"]) == (f"{array}_{n}", n)         # hydra.job.id is hpcring's job id
        assert OmegaConf.load(sweep / str(n) / ".hydra" / "config.yaml").x == x
        assert OmegaConf.load(sweep / str(n) / ".hydra" / "overrides.yaml") == [f"x={x}", "sleep=2"]
        job_cfg = OmegaConf.load(sweep / str(n) / ".hydra" / "hydra.yaml").hydra.job
        assert (job_cfg.id, job_cfg.num) == (f"{array}_{n}", n)
        log = (sweep / str(n) / "app.log").read_text()                  # every rank logs into the point's log
        assert f"x={x}: rank 0 of 2 on local0: sum {3 * x}" in log and f"x={x}: rank 1 of 2" in log
    assert OmegaConf.load(sweep / "multirun.yaml").hydra.overrides.task == ["x=1,2,3,4", "sleep=2"]
    assert f"hpcring launcher: job array {array} (local-{array})" in r.stdout
    # array_parallelism: 2 (conf/config.yaml): the jobs' own spans and the tasks' spans
    jobs = [hpcring.Job(f"{array}_{n}") for n in range(4)]
    states = [json.loads((j.folder / f"{j.job_id}_local.json").read_text()) for j in jobs]
    at_most_two_at_once([(s["started"], s["ended"]) for s in states])
    at_most_two_at_once([(p["started"], p["ended"]) for p in points])
    st = hpcring_cli("status", array)
    assert "array of 4 tasks (at most 2 at once)" in st.stdout and "4 COMPLETED" in st.stdout, st.stdout
    assert jobs[1].name == "app"                                    # Hydra's job name
    assert [j.result().return_value for j in jobs] == [3.0, 6.0, 9.0, 12.0]    # rank 0's JobReturn per point


def test_a_failing_point_is_reported_and_the_others_complete(hpcring_cli, env):
    r = app(env, "x=1,2,3,4", "fail_on=3")
    assert r.returncode == 1, r.stdout + r.stderr
    sweep = env / "sweep"
    assert [result(sweep, n)["sum"] for n in (0, 1, 3)] == [3.0, 6.0, 12.0]
    assert not (sweep / "2" / "result.json").exists()
    array = result(sweep, 0)["job_id"].split("_")[0]
    err = r.stderr
    # Hydra's own words for a failed job, then hpcring's: the point, its job, the rank and host, the exception
    assert "Error executing job with overrides: ['x=3', 'fail_on=3']" in err, err
    assert (f"sweep point #2 (x=3 fail_on=3): job {array}_2 (app) FAILED: rank 1 on local0: "
            f"ValueError: x=3 is refused on rank 1") in err, err
    assert f'File "{APP}", line' in err and 'raise ValueError(f"x={cfg.x} is refused on rank {session.rank}")' in err
    assert f"hpcring logs {array}_2 --rank 1" in err
    # printed as Hydra prints a compact error: the rank's traceback only, no stack of the launcher's or Hydra's
    assert err.count("Traceback (most recent call last)") == 1 and "hydra/_internal" not in err, err
    assert f"#2 : x=3 fail_on=3 FAILED (job {array}_2, rank 1 on local0)" in r.stdout
    st = hpcring_cli("status", array)
    assert "3 COMPLETED" in st.stdout and "1 FAILED" in st.stdout, st.stdout


# --- the Launcher contract, called as Hydra's sweepers call it ------------------------------------

def point_task(cfg):
    """A task for launch(): fails on rank 1 of the point whose x is cfg.fail_on."""
    session = hpcring.init()
    if cfg.x == cfg.fail_on and session.rank == 1:
        raise ArithmeticError(f"point x={cfg.x} cannot go on")
    session.communicator().barrier()
    return {"x": cfg.x, "rank": session.rank}


def launcher_for(tmp_path, task, overrides):
    """Hydra composed for a multirun of examples/hydra_app's config and its launcher set up, as
    Hydra.multirun and the basic sweeper do."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode
    hydra = Hydra.create_main_hydra2(task_name="app", config_search_path=create_config_search_path(str(CONF)))
    cfg = hydra.compose_config("config", overrides + [f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                               run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    HydraConfig.instance().set_config(cfg)
    ctx = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
    return Plugins.instance().instantiate_launcher(hydra_context=ctx, task_function=task, config=cfg)


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_launch_returns_one_job_return_per_point_in_order(env):
    ln = launcher_for(env, point_task, ["hydra.launcher.array_parallelism=4"])
    points = [[f"x={x}", "fail_on=3"] for x in (1, 2, 3, 4)]      # as the sweeper hands them: every override
    rets = ln.launch(points, initial_job_idx=10)
    assert [r.status for r in rets] == [JobStatus.COMPLETED, JobStatus.COMPLETED, JobStatus.FAILED,
                                        JobStatus.COMPLETED]
    assert [rets[i].return_value for i in (0, 1, 3)] == [{"x": x, "rank": 0} for x in (1, 2, 4)]
    assert [r.overrides for r in rets] == points
    assert [r.hydra_cfg.hydra.job.num for r in rets] == [10, 11, 12, 13]
    assert [r.cfg.x for r in rets] == [1, 2, 3, 4] and "hydra" not in rets[2].cfg
    assert rets[2].task_name == "app" and rets[0].task_name == "app"
    for n in (10, 11, 13):                 # run_job's output dirs: hydra.sweep.dir/hydra.sweep.subdir
        assert (env / "sweep" / str(n) / ".hydra" / "config.yaml").is_file()
    with pytest.raises(JobFailedError) as info:
        rets[2].return_value                # Hydra's sweepers read it so: it raises the point's failure
    exc = info.value
    array = rets[0].hydra_cfg.hydra.job.id.split("_")[0]
    assert (exc.rank, exc.host, exc.job_num, exc.job_id, exc.overrides) == (1, "local0", 12, f"{array}_2",
                                                                             ["x=3", "fail_on=3"])
    assert str(exc).startswith(f"sweep point #12 (x=3 fail_on=3): job {array}_2 (app) FAILED: rank 1 on local0: "
                               "ArithmeticError: point x=3 cannot go on")
    assert "in point_task\n    raise ArithmeticError" in exc.traceback and "run_job" not in exc.traceback
    assert "hpcring_launcher.py" not in exc.traceback


# --- refusals before anything is queued -----------------------------------------------------------

@pytest.mark.parametrize("override, said", [
    ("hydra.launcher.nodez=2", "Key 'nodez' not in 'HpcringLauncherConf'"),                 # Hydra's schema
    ("hydra.launcher.timeout_min=30", "Key 'timeout_min' not in 'HpcringLauncherConf'"),
    ("hydra.launcher.nodes=0", "hydra.launcher.nodes=0: out of range; nodes must be a whole number (int) from 1"),
    ("hydra.launcher.time=soon", "hydra.launcher.time='soon': not a time"),
    ("hydra.launcher.gpus_per_node=2",                                                     # the site's refusal
     "hydra/launcher=hpcring: nothing was submitted: gpus_per_node=2 but site 'local' has 0 GPUs per node"),
    ("hydra.launcher.site=no-such-site", "hydra/launcher=hpcring: nothing was submitted: no site config named"),
])
def test_a_bad_launcher_config_is_refused_before_anything_is_queued(env, override, said):
    r = app(env, "x=1,2", override)
    assert r.returncode == 1 and said in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr                      # a message, not a stack
    assert not (env / "state").exists() and not (env / "jobs").exists()   # no job record, no job folder
    assert not (env / "sweep" / "0").exists()


def test_the_sites_limits_are_checked_before_anything_is_queued(env):
    """A Slurm site's partition limit (slurm-tcp's cpu: 16 nodes). No Slurm command is on PATH, so
    nothing could reach a scheduler even if the check were missing."""
    site = env / "cluster.yaml"
    site.write_text((ROOT / "site_configs" / "slurm-tcp.yaml").read_text())
    (env / "no-bin").mkdir()
    r = app(env, "x=1,2", f"hydra.launcher.site={site}", "hydra.launcher.nodes=20", "hydra.launcher.partition=cpu",
            env={"PATH": str(env / "no-bin")})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nothing was submitted: nodes=20 exceeds partition 'cpu' max_nodes 16" in r.stderr, r.stderr
    assert not (env / "state").exists()


# --- Hydra's own launcher test suites -------------------------------------------------------------

LOCAL = ["hydra.launcher.site=local", "hydra.launcher.time=5", "hydra.launcher.tasks_per_node=1"]


@pytest.mark.usefixtures("env")
@pytest.mark.parametrize("launcher_name, overrides", [("hpcring", LOCAL)])
class TestHydraLauncherSuite(LauncherTestSuite):
    pass


@pytest.mark.usefixtures("env")
@pytest.mark.parametrize("launcher_name, overrides",
                         [("hpcring", LOCAL + ["hydra/sweeper=basic", "hydra.sweeper.max_batch_size=2"])])
class TestHydraBatchedSweeperSuite(BatchedSweeperTestSuite):
    pass
