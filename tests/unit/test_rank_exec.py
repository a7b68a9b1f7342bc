"""``python -m hpcring.rank_exec``, one rank on its own (the local launcher's environment): the
command's output tagged with the rank, its exit code recorded and returned, a command that
cannot start and a bootstrap that fails each recorded with a one-line reason."""
from __future__ import annotations

import os
import subprocess
import sys

from hpcring.bootstrap.auth import write_secret_file
from hpcring.outcome import read_records
from hpcring.schedulers.local_run import rank_env


def _env(tmp_path, **extra) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_", "LSB_", "LSF_", "JSM_", "HPCRING_", "SUBMITIT_"))}
    env = rank_env(base, "re1", 1, 1, 0, 0)
    env["HPCRING_SECRET_FILE"] = str(write_secret_file(tmp_path / "secret.key", exclusive=True))
    env["HPCRING_JOB_DIR"] = str(tmp_path / "jobs")
    env.update(extra)
    return env


def _run(tmp_path, cmd: list[str], **extra) -> tuple[subprocess.CompletedProcess, dict]:
    status = tmp_path / "status"
    p = subprocess.run([sys.executable, "-m", "hpcring.rank_exec", "--status-dir", str(status), "--", *cmd],
                       env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    return p, read_records(status, "re1", 1)[0]


def test_output_is_tagged_and_the_exit_code_recorded(tmp_path):
    p, st = _run(tmp_path, [sys.executable, "-c",
                            "import os, sys; print('hello', os.environ['RANK'], os.environ['WORLD_SIZE']); "
                            "print('oops', file=sys.stderr); sys.exit(3)"])
    assert p.returncode == 3
    assert "[0]<stdout>:hello 0 1" in p.stdout and "[0]<stderr>:oops" in p.stderr
    assert (st["rank"], st["host"], st["exit_code"]) == (0, "local0", 3)


def test_a_command_that_cannot_start_is_named_once(tmp_path):
    p, st = _run(tmp_path, ["no-such-command-hpcring"])
    assert p.returncode == 127 and st["exit_code"] == 127
    assert "cannot run 'no-such-command-hpcring' on local0" in p.stderr and "hint:" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_failed_bootstrap_is_recorded_under_the_launchers_rank(tmp_path):
    p, st = _run(tmp_path, [sys.executable, "-c", "pass"], HPCRING_TIMEOUT="soon")
    assert p.returncode == 1 and st["exit_code"] == 1
    assert "HPCRING_TIMEOUT" in st["error"] and "HPCRING_TIMEOUT" in p.stderr
    assert "Traceback" not in p.stderr
