"""Both rank entries, a submitted job's (``job.RunScript``) and ``hpcring run``'s (``rank_exec``),
go through ``rank_life``: for the same outcome they leave the same status record."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcring.bootstrap.auth import write_secret_file
from hpcring.outcome import read_records
from hpcring.schedulers.local_run import rank_env

# what differs between any two runs, whichever the entry
PER_RUN = ("pid", "started", "ended", "cmd")

SCRIPTS = {"success": "print('fine')\n", "exception": "raise ValueError('x')\n", "bootstrap": "print('never')\n"}


def _env(tmp_path, outcome: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMPI_", "PMI", "PMIX_", "LSB_", "LSF_", "JSM_", "HPCRING_", "SUBMITIT_"))}
    env = rank_env(base, "rl1", 1, 1, 0, 0)
    env["HPCRING_SECRET_FILE"] = str(write_secret_file(tmp_path / "secret.key", exclusive=True))
    env["HPCRING_END_JOB"] = "0"                 # nothing to end: one rank on this machine
    env["SUBMITIT_FOLDER"] = str(tmp_path / "job")
    if outcome == "bootstrap":
        env["HPCRING_TIMEOUT"] = "soon"          # every entry checks the environment first
    return env


def _submitted(tmp_path, script, env) -> tuple[int, dict]:
    code = (f"import sys; from hpcring.job import RunScript; "
            f"sys.exit(RunScript({str(script)!r}, [], {str(tmp_path)!r})())")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    return p.returncode, read_records(tmp_path / "job", "rl1", 1).get(0)


def _run(tmp_path, script, env) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "hpcring.rank_exec", "--status-dir", str(tmp_path / "run"), "--",
                        sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    return p.returncode, read_records(tmp_path / "run", "rl1", 1).get(0)


@pytest.mark.parametrize("outcome", sorted(SCRIPTS))
def test_both_entries_write_the_same_record(tmp_path, outcome):
    script = tmp_path / "train.py"
    script.write_text(SCRIPTS[outcome])
    env = _env(tmp_path, outcome)
    (code_job, job), (code_run, run) = _submitted(tmp_path, script, env), _run(tmp_path, script, env)
    assert job is not None and run is not None, (job, run)
    assert {k: v for k, v in job.items() if k not in PER_RUN} == {k: v for k, v in run.items() if k not in PER_RUN}
    assert set(job) == set(run)
    expect = {"success": (0, None), "exception": (1, "ValueError: x")}.get(outcome)
    if expect is not None:
        assert (job["exit_code"], job["error"]) == expect and job["size"] == 1 and job["host"] == "local0"
        assert code_job == code_run == expect[0]
    else:                                        # recorded under the launcher's rank, with the reason
        assert (job["rank"], job["host"], job["exit_code"]) == (0, "local0", 1)
        assert "HPCRING_TIMEOUT" in job["error"] and "size" not in job
        assert code_job != 0 and code_run != 0
    assert job["cmd"][-1] == run["cmd"][-1] == str(script)
    assert not list((tmp_path / "run").glob("*_error.txt"))    # the child's hand-over is consumed
