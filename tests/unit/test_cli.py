"""The CLI through typer's runner: thin commands, errors mapped to messages and exit codes."""


def test_render_devcluster(cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    r = cli("render", str(script), "--site", "devcluster", "--nodes", "3", "--tasks-per-node", "2",
            "--sched-arg=--comment=x", "--", "--epochs", "2")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --nodes=3" in r.stdout and "#SBATCH --ntasks-per-node=2" in r.stdout
    assert "#SBATCH --comment=x" in r.stdout and "--mpi=pmix" in r.stdout


def test_verbose_shows_sources(cli, tmp_path):
    script = tmp_path / "t.py"          # render refuses a script that does not exist
    script.write_text("print('hi')\n")
    r = cli("render", str(script), "--site", "devcluster", "--nodes", "2", "-v", env={"HPCRING_TIME": "00:05:00"})
    assert r.exit_code == 0, r.output
    assert "<- cli" in r.stderr and "<- env HPCRING_TIME" in r.stderr and "<- site devcluster" in r.stderr


def test_bad_flag_is_usage_error(cli):
    r = cli("submit", "t.py", "--nodez", "2")
    assert r.exit_code == 2
    assert "--nodez" in r.output


def test_bad_value_is_usage_error_exit_2(cli):
    r = cli("render", "t.py", "--site", "devcluster", "--nodes", "9")
    assert r.exit_code == 2
    assert "max_nodes 3" in r.stderr and r.stderr.startswith("error:")


def test_unknown_site_exit_1(cli):
    r = cli("render", "t.py", "--site", "nosuchsite")
    assert r.exit_code == 1 and "no site config named 'nosuchsite'" in r.stderr


def test_missing_script_on_submit(cli, state_dir):
    r = cli("submit", "does-not-exist.py", "--site", "local")
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_sites_list_and_show(cli):
    r = cli("sites", "list")
    assert r.exit_code == 0 and "devcluster" in r.stdout and "lsf-summit" in r.stdout
    r = cli("sites", "show", "slurm-roce")
    assert r.exit_code == 0 and "NCCL_IB_GID_INDEX=3" in r.stdout


def test_sites_validate_reports_each_problem(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nscheduler: slurm\nlauncher: {kind: srun}\nfabric: {kind: roce, hcas: [mlx5_0:1]}\nfoo: 1\n")
    r = cli("sites", "validate", str(bad), "local")
    assert r.exit_code == 1
    assert "fabric.gid_index" in r.stderr and "foo: unknown key" in r.stderr and "ok " in r.stderr


def test_status_of_unknown_job(cli, state_dir):
    r = cli("status", "424242")
    assert r.exit_code == 1 and "job 424242" in r.stderr


def test_status_without_a_job_lists_the_newest(cli, tmp_path, state_dir):
    """`hpcring status` alone: the newest jobs first with their states; a scheduler that cannot
    answer gives '?' and its reason on that line instead of failing the listing."""
    import json
    import time
    from hpcring.schedulers.base import new_record
    assert "no jobs submitted" in cli("status").stdout
    for i, state in enumerate(["COMPLETED", "FAILED", "RUNNING"]):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / f"{i}_local.json").write_text(json.dumps({"state": state, "pid": 0 if state != "RUNNING" else 1}))
        new_record(str(i), "local", "local", str(folder), 2, f"job{i}", f"/x/job{i}.py")
        time.sleep(0.01)
    new_record("77", "slurm", "dev", str(tmp_path), 4, "remote", "/x/r.py", cluster="dev")
    r = cli("status", env={"PATH": str(tmp_path)})              # no sacct/squeue on PATH
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["JOB", "STATE", "RANKS"]
    assert [ln.split()[0] for ln in lines[1:]] == ["slurm-dev-77", "local-2", "local-1", "local-0"]
    assert lines[1].split()[1] == "?" and "sacct" in lines[1]
    assert [ln.split()[1] for ln in lines[2:]] == ["RUNNING", "FAILED", "COMPLETED"]
    assert len(cli("status", "-n", "2", env={"PATH": str(tmp_path)}).stdout.splitlines()) == 3   # sacct's answer aside


def test_cancel_of_an_ended_job_says_so(cli, tmp_path, state_dir):
    import json
    from hpcring.schedulers.base import new_record
    (tmp_path / "5_local.json").write_text(json.dumps({"state": "COMPLETED", "pid": 0}))
    new_record("5", "local", "local", str(tmp_path), 2, "j", "/x/j.py")
    r = cli("cancel", "5")
    assert r.exit_code == 0 and "job 5 has already ended (COMPLETED): nothing to cancel" in r.stderr, r.output


def test_logs_without_a_job_shows_the_newest(cli, tmp_path, state_dir):
    import time
    from hpcring.schedulers.base import new_record
    r = cli("logs")
    assert r.exit_code == 1 and "no job was submitted" in r.stderr
    for jid in ("3", "4"):
        folder = tmp_path / jid
        folder.mkdir()
        (folder / f"{jid}_0_log.out").write_text(f"output of job {jid}\n")
        new_record(jid, "local", "local", str(folder), 1, f"j{jid}", "/x/j.py")
        time.sleep(0.01)
    r = cli("logs")
    assert r.exit_code == 0 and "[0]<stdout>:output of job 4" in r.stdout and "job 3" not in r.stdout, r.output
    assert "job 4 [local-4] (j4), the newest" in r.stderr


def test_dry_run_prints_script_submits_nothing(cli, tmp_path, state_dir):
    script = tmp_path / "t.py"
    script.write_text("")
    r = cli("submit", str(script), "--site", "local", "--nodes", "2", "--dry-run")
    assert r.exit_code == 0 and "hpcring.schedulers.local_run --nodes 2" in r.stdout
    assert not (state_dir / "jobs").exists() or not list((state_dir / "jobs").iterdir())


def test_help_and_hostlist_import_no_heavy_library():
    """`hpcring --help` must be instant: neither submitit, pydantic nor numpy is imported. (Running
    any command, typer 0.29 itself imports pydantic -- a bare two-command typer app too -- so for
    `hostlist` only submitit, numpy and the bootstrap layer are checked.)"""
    import subprocess
    import sys
    code = ("import sys; from typer.testing import CliRunner; from hpcring.cli.main import app; "
            "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('submitit', 'pydantic', 'numpy', 'hpcring.session') if m in sys.modules)); "
            "r = CliRunner().invoke(app, ['hostlist', 'expand', 'n[1-2]']); assert r.output.split() == ['n1', 'n2']; "
            "print(sorted(m for m in ('submitit', 'numpy', 'hpcring.session') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "[]"]


def test_submit_and_render_share_every_job_option(cli):
    from hpcring.cli.jobopts import JobRequest
    helps = {cmd: cli(cmd, "--help", columns=200).output for cmd in ("submit", "render")}
    for flag in ("--site", "--nodes", "--tasks-per-node", "--gpus-per-node", "--cpus-per-task", "--time",
                 "--partition", "--account", "--qos", "--constraint", "--exclusive", "--name", "--sched-arg",
                 "--template", "--verbose"):
        assert flag in helps["submit"] and flag in helps["render"], flag
    assert "--dry-run" in helps["submit"] and "--dry-run" not in helps["render"]
    # the request: CLI values only, None when not given; repeated flags and script args as lists
    from hpcring.cli import main
    seen = {}
    orig = JobRequest.resolve
    try:
        JobRequest.resolve = lambda self: (_ for _ in ()).throw(SystemExit(seen.setdefault("req", self) and 0))
        cli("render", "t.py", "-N", "3", "--sched-arg", "--x=1", "--sched-arg", "--y", "-J", "my run", "--",
            "--lr", "0.1")
    finally:
        JobRequest.resolve = orig
    req = seen["req"]
    assert (req.script, req.args, req.nodes, req.sched_arg, req.name, req.partition) == \
        ("t.py", ["--lr", "0.1"], 3, ["--x=1", "--y"], "my run", None)
    assert main.render.__name__ == "render"
