"""The CLI through typer's runner: thin commands, errors mapped to messages and exit codes."""
import pytest
from typer.testing import CliRunner

from hpcring.cli.main import app

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, list(args), env=env or {})


def test_render_devcluster(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = run("render", str(script), "--site", "devcluster", "--nodes", "3", "--tasks-per-node", "2",
            "--sched-arg=--comment=x", "--", "--epochs", "2")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --nodes=3" in r.stdout and "#SBATCH --ntasks-per-node=2" in r.stdout
    assert "#SBATCH --comment=x" in r.stdout and "--mpi=pmix" in r.stdout


def test_verbose_shows_sources(tmp_path):
    r = run("render", "t.py", "--site", "devcluster", "--nodes", "2", "-v", env={"HPCRING_TIME": "00:05:00"})
    assert r.exit_code == 0, r.output
    assert "<- cli" in r.stderr and "<- env HPCRING_TIME" in r.stderr and "<- site devcluster" in r.stderr


def test_bad_flag_is_usage_error():
    r = run("submit", "t.py", "--nodez", "2")
    assert r.exit_code == 2
    assert "--nodez" in r.output


def test_bad_value_is_usage_error_exit_2():
    r = run("render", "t.py", "--site", "devcluster", "--nodes", "9")
    assert r.exit_code == 2
    assert "max_nodes 3" in r.stderr and r.stderr.startswith("error:")


def test_unknown_site_exit_1():
    r = run("render", "t.py", "--site", "nosuchsite")
    assert r.exit_code == 1 and "no site config named 'nosuchsite'" in r.stderr


def test_missing_script_on_submit(state_dir):
    r = run("submit", "does-not-exist.py", "--site", "local")
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_sites_list_and_show():
    r = run("sites", "list")
    assert r.exit_code == 0 and "devcluster" in r.stdout and "lsf-summit" in r.stdout
    r = run("sites", "show", "slurm-roce")
    assert r.exit_code == 0 and "NCCL_IB_GID_INDEX=3" in r.stdout


def test_sites_validate_reports_each_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nscheduler: slurm\nlauncher: {kind: srun}\nfabric: {kind: roce, hcas: [mlx5_0:1]}\nfoo: 1\n")
    r = run("sites", "validate", str(bad), "local")
    assert r.exit_code == 1
    assert "fabric.gid_index" in r.stderr and "foo: unknown key" in r.stderr and "ok " in r.stderr


def test_status_of_unknown_job(state_dir):
    r = run("status", "424242")
    assert r.exit_code == 1 and "job 424242" in r.stderr


def test_dry_run_prints_script_submits_nothing(tmp_path, state_dir):
    script = tmp_path / "t.py"
    script.write_text("")
    r = run("submit", str(script), "--site", "local", "--nodes", "2", "--dry-run")
    assert r.exit_code == 0 and "hpcring.schedulers.local_run --nodes 2" in r.stdout
    assert not (state_dir / "jobs").exists() or not list((state_dir / "jobs").iterdir())
