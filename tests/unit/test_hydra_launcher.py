"""The Hydra launcher plugin without jobs: its config generated from the option table and
registered as hydra/launcher=hpcring, its checks (named hydra.launcher.KEY), how the ranks' call
names the job, and the rank traceback that starts in the task function."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")

from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import ValidationError  # noqa: E402

from hpcring.config.jobopts import PYTHON_OPTIONS  # noqa: E402
from hpcring.errors import HpcringError, InvalidParameterError  # noqa: E402
from hydra_plugins.hpcring_launcher import config as conf  # noqa: E402
from hydra_plugins.hpcring_launcher import hpcring_launcher as hl  # noqa: E402


def launcher(**params):
    """A launcher set up as Hydra sets it up (Hydra's context is not needed before launch)."""
    ln = hl.HpcringLauncher(**params)
    ln.setup(hydra_context=None, task_function=lambda cfg: None,
             config=OmegaConf.create({"hydra": {"job": {"name": "app"}}}))
    return ln


def test_the_keys_are_the_executors_from_the_option_table():
    cfg = OmegaConf.structured(conf.HpcringLauncherConf)
    keys = [k for k in cfg if k != "_target_"]
    assert keys == ["site", "folder"] + [o.name for o in PYTHON_OPTIONS]
    assert all(cfg[k] is None for k in keys)              # not given: HPCRING_* > site > default decide
    assert cfg._target_ == "hydra_plugins.hpcring_launcher.hpcring_launcher.HpcringLauncher"
    assert "array_parallelism" in keys and "timeout_min" not in keys


def test_registered_as_hydra_launcher_hpcring():
    from hydra.core.config_store import ConfigStore
    node = ConfigStore.instance().load("hydra/launcher/hpcring.yaml")
    assert node.provider == "hpcring" and node.node._target_.endswith(".HpcringLauncher")


def test_omegaconf_types_follow_the_kinds():
    cfg = OmegaConf.structured(conf.HpcringLauncherConf)
    cfg.nodes, cfg.time, cfg.exclusive, cfg.sched_arg, cfg.timeout = "3", 90, True, ["--mem=8G"], 30
    assert (cfg.nodes, cfg.time, cfg.timeout) == (3, "90", 30.0)     # minutes as text mean the same
    with pytest.raises(ValidationError):
        cfg.nodes = "many"


def test_values_reach_the_executor_checked():
    ln = launcher(site="local", folder=None, nodes=2, tasks_per_node=2, time="0:10:00", partition=None,
                  sched_arg=OmegaConf.create(["--mem=8G"]), array_parallelism=3)
    assert ln.executor.site == "local"
    assert ln.executor.parameters == {"nodes": 2, "tasks_per_node": 2, "time": "0:10:00", "sched_arg": ["--mem=8G"],
                                      "array_parallelism": 3}


@pytest.mark.parametrize("params, said", [
    ({"nodes": 0}, "hydra.launcher.nodes=0: out of range; nodes must be a whole number (int) from 1 to 100000"),
    ({"time": "99:99:99:99"}, "hydra.launcher.time='99:99:99:99'"),
    ({"array_parallelism": 0}, "hydra.launcher.array_parallelism=0: out of range"),
    ({"timeout": -1.0}, "hydra.launcher.timeout=-1.0"),
    ({"partition": "a\nb"}, "hydra.launcher.partition='a\\nb': contains the control character"),
    ({"site": ""}, "Executor(site='')"),
])
def test_a_bad_value_is_refused_at_setup(params, said):
    with pytest.raises(HpcringError) as info:
        launcher(**params)
    exc = info.value
    assert said in str(exc) and "update_parameters" not in exc.message, str(exc)
    from hydra.errors import CompactHydraException
    assert isinstance(exc, CompactHydraException)      # Hydra prints the message alone, no stack
    assert isinstance(exc.__cause__, InvalidParameterError)


def test_an_unknown_key_is_refused_with_the_valid_ones():
    """Hydra's schema refuses an unknown key of hydra/launcher=hpcring first; a config that names
    the launcher's _target_ itself reaches this check."""
    with pytest.raises(HpcringError) as info:
        launcher(nodes=2, timeout_min=30, mem_gb=4)
    text = str(info.value)
    assert "hydra.launcher: unknown parameters 'timeout_min', 'mem_gb'; valid parameters: site, folder, nodes" in text
    assert "timeout_min is submitit's: here the time limit is time=" in text


def test_the_ranks_call_names_the_job():
    """hpcring.Executor names a function's job by its __name__ and its record by its place: the
    task function's place, and Hydra's job name (which name= and HPCRING_JOB_NAME still beat)."""
    from hpcring.executor import _label

    def my_task(cfg):
        return cfg
    point = hl.SweepPoint(None, my_task, OmegaConf.create({"hydra": {"job": {"name": "train"}}}))
    assert _label(point) == (f"{__name__}.test_the_ranks_call_names_the_job.<locals>.my_task()", "train")


def _run_job_like(task):
    """A stand-in for Hydra's run_job: catches the task's exception as run_job does."""
    def run_job():
        try:
            task()
        except Exception as exc:  # noqa: BLE001
            return exc
    return run_job()


def test_the_rank_traceback_starts_in_the_task():
    from hpcring.job import user_traceback

    def task():
        raise ValueError("bad point")

    def wrapper():
        __tracebackhide__ = True      # noqa: F841 - as SweepPoint.__call__
        exc = _run_job_like(task)
        raise exc.with_traceback(hl._from_task(exc.__traceback__))

    def call_function():              # hpcring.job.call_function's frame: left out as a wrapper's
        __tracebackhide__ = True      # noqa: F841
        try:
            wrapper()
        except ValueError as exc:
            return user_traceback(exc)
    text = call_function()
    frames = [ln for ln in text.splitlines() if ln.strip().startswith("File ")]
    assert len(frames) == 1 and frames[0].endswith("in task"), text
    assert text.rstrip().endswith("ValueError: bad point")


def test_a_failed_point_names_the_point_the_rank_and_the_exception():
    from hpcring.errors import JobFailedError
    job_error = JobFailedError("job 7_2 (app) FAILED: rank 1 on node3: ValueError: x=3 is refused",
                               hint="see `hpcring logs 7_2 --rank 1`")
    job_error.rank, job_error.host, job_error.traceback = 1, "node3", "Traceback ...\nValueError: x=3 is refused\n"
    failed = hl.SweepPointFailed(job_error, ["x=3", "hydra.verbose=true"], 2, "7_2")
    assert str(failed).startswith("sweep point #2 (x=3): job 7_2 (app) FAILED: rank 1 on node3: ValueError: x=3")
    assert (failed.rank, failed.host, failed.job_num, failed.job_id) == (1, "node3", 2, "7_2")
    assert failed.overrides == ["x=3", "hydra.verbose=true"] and "ValueError" in failed.traceback
    assert isinstance(failed, JobFailedError) and "hint: see `hpcring logs 7_2 --rank 1`" in str(failed)


def test_the_plugin_module_imports_nothing_heavy():
    """Hydra imports every plugin at start-up: no submitit, numpy or hpcring's submission layer."""
    import subprocess
    code = ("import sys, hydra_plugins.hpcring_launcher.config, hydra_plugins.hpcring_launcher.hpcring_launcher; "
            "print(sorted(m for m in ('submitit', 'numpy', 'hpcring.submit', 'hpcring.executor', 'pydantic') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_docs_launcher_config_is_accepted(monkeypatch, tmp_path):
    """docs/python-api.md's launcher YAML: every key the launcher's, every value one the site takes
    (the job script it would submit, rendered without submitting)."""
    import os
    import re
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text()
    block = next(b for b in re.findall(r"^```yaml\n(.*?)^```", doc, re.S | re.M) if "hpcring" in b)
    keys = OmegaConf.to_container(OmegaConf.create(block).hydra.launcher)
    OmegaConf.merge(OmegaConf.structured(conf.HpcringLauncherConf), keys)      # Hydra's schema takes them
    ln = launcher(**keys)

    def main(cfg):
        return cfg
    text = ln.executor.render(main)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --partition=gpu" in text and "#SBATCH --mem=16G" in text
    assert "#SBATCH --time=02:00:00" in text
