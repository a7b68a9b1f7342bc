"""The local backend runs the same job as a cluster would: N nodes x k ranks with allocation env."""
import functools
import json
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELLO = ROOT / "examples" / "hello.py"


@pytest.fixture(scope="session")
def hpcring(hpcring):
    """The conftest runner with this file's 120 s bound (a 4-rank hello takes a few seconds)."""
    return functools.partial(hpcring, timeout=120)


@pytest.fixture
def local_env(tmp_path):
    return {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_JOB_DIR": str(tmp_path / "jobs")}


def hellos(stdout: str) -> list[dict]:
    return [json.loads(l.split("HELLO ", 1)[1]) for l in stdout.splitlines() if "<stdout>:HELLO " in l]


def test_hello_2_nodes_x_2_ranks(hpcring, local_env):
    r = hpcring("submit", str(HELLO), "--nodes", "2", "--tasks-per-node", "2", "--wait", env=local_env)
    assert r.returncode == 0, r.stderr
    recs = hellos(r.stdout)
    assert sorted(x["rank"] for x in recs) == [0, 1, 2, 3]
    assert {(x["rank"], x["local_rank"], x["host"]) for x in recs} == \
        {(0, 0, "local0"), (1, 1, "local0"), (2, 0, "local1"), (3, 1, "local1")}
    assert all(x["size"] == 4 for x in recs)
    for line in r.stdout.splitlines():  # every line tagged like mpirun --tag-output
        assert line.startswith("[") and "]<std" in line
    job_id = r.stderr.split("Submitted job ")[1].split()[0]
    st = hpcring("status", job_id, env=local_env)
    assert st.returncode == 0 and "COMPLETED" in st.stdout
    logs = hpcring("logs", job_id, "--rank", "2", env=local_env)
    assert logs.returncode == 0 and [x["rank"] for x in hellos(logs.stdout)] == [2]


def test_failing_rank_named_and_exit_code(hpcring, local_env):
    r = hpcring("submit", str(HELLO), "--nodes", "2", "--tasks-per-node", "2", "--wait",
                env=dict(local_env, HELLO_FAIL_RANK="1"))
    assert r.returncode == 3, r.stderr
    assert "rank 1 on local0: exited with code 3" in r.stderr


def test_cancel_stops_running_job(hpcring, local_env, tmp_path):
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(300)\n")
    r = hpcring("submit", str(sleeper), "--nodes", "1", "--tasks-per-node", "2", env=local_env)
    assert r.returncode == 0, r.stderr
    job_id = r.stderr.split("Submitted job ")[1].split()[0]
    deadline = time.time() + 30
    while "RUNNING" not in hpcring("status", job_id, env=local_env).stdout:
        assert time.time() < deadline, "job never started"
        time.sleep(0.5)
    assert hpcring("cancel", job_id, env=local_env).returncode == 0
    deadline = time.time() + 30
    while True:
        out = hpcring("status", job_id, env=local_env).stdout
        if "CANCELLED" in out:
            break
        assert time.time() < deadline, out
        time.sleep(0.5)
    folder = Path(local_env["HPCRING_JOB_DIR"]) / job_id
    state = json.loads((folder / f"{job_id}_local.json").read_text())
    for pid in [state["pid"]]:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:2]


def test_time_limit_reaches_the_job_and_is_enforced(hpcring, local_env, tmp_path):
    """--time 1 reaches the job's supervisor as 60 s (read back from a rank), and the supervisor
    stops ranks that outlive their limit with TIMEOUT: the latter run straight through
    local_run with a 2 s limit, as the rendered script starts it, instead of waiting out a minute."""
    import os
    import subprocess
    import sys
    show = tmp_path / "show.py"
    show.write_text("import os\nprint('LIMIT', os.environ['HPCRING_TIME_LIMIT_S'], flush=True)\n")
    r = hpcring("submit", str(show), "--time", "1", "--wait", env=dict(local_env))
    assert r.returncode == 0 and "LIMIT 60" in r.stdout, r.stdout + r.stderr
    folder = tmp_path / "run"
    env = dict(os.environ, HPCRING_LOCAL_JOB_ID="77", HPCRING_TIME_LIMIT_S="2", **local_env)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "hpcring.schedulers.local_run", "--nodes", "1", "--tasks-per-node",
                        "2", "--folder", str(folder), "--", sys.executable, "-c", "'import time; time.sleep(300)'"],
                       env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    state = json.loads((folder / "77_local.json").read_text())
    assert p.returncode == 1 and state["state"] == "TIMEOUT", (p.stdout, p.stderr, state)
    assert time.monotonic() - t0 < 30, "the ranks outlived their limit by far"


def test_secret_outlives_the_first_rank_to_finish(hpcring, local_env):
    """Rank 0 ends at once; the others, still running seconds later, find the job's secret (a
    rank's exit used to delete it: 'cannot read secret file' on the slower ranks)."""
    r = hpcring("submit", str(ROOT / "tests" / "data" / "secret_skew.py"), "--nodes", "2",
                "--tasks-per-node", "2", "--wait", env=dict(local_env, SKEW_S="3"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(l.split("SKEW rank ")[1].split()[0] for l in r.stdout.splitlines() if "SKEW rank" in l) \
        == ["1", "2", "3"]
    assert "gone while the job runs" not in r.stdout
    secrets = list(Path(local_env["HPCRING_JOB_DIR"]).rglob("*.key"))
    assert secrets == [], secrets          # the job's end (not a rank's) removed it
