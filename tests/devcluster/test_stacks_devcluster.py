"""`hpcring stacks JOB` on the real Slurm dev cluster: a 3 nodes x 2 ranks job where ranks 0-4
wait in one function and rank 5 in another; the grouped summary must say exactly that, through the
ranks' stack-signal hook (faulthandler, installed by hpcring.init) and, when installed, through py-spy."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]




# hpcring.init() installs the stack hook (SIGRTMIN+6) in every rank.
SCRIPT = """\
import time

import hpcring


def wait_for_peers():
    time.sleep(600)


def load_batch():
    time.sleep(600)


session = hpcring.init()
print("READY", session.rank, flush=True)
if session.rank == 5:
    load_batch()
else:
    wait_for_peers()
"""


def _line(text: str, needle: str) -> int:
    """Number of the first line of ``text`` that is ``needle`` (ignoring indentation)."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.strip() == needle)


@pytest.fixture(scope="module")
def hung_job(hpcring, tmp_path_factory):
    """A running 3x2 job whose ranks are all stuck; yields (job id, env, script path, folder)."""
    env = {"HPCRING_STATE_DIR": str(tmp_path_factory.mktemp("state"))}
    script = Path("/srv/hpcring") / f"stacks_hang_{os.getpid()}.py"
    script.write_text(SCRIPT)
    r = hpcring("submit", str(script), "--site", "devcluster", "--nodes", "3", "--tasks-per-node", "2",
                "--time", "5", env=env)
    assert r.returncode == 0, r.stderr
    job = r.stderr.split("Submitted job ")[1].split()[0]
    folder = Path(r.stderr.split("logs in ")[1].split()[0])
    try:
        deadline = time.time() + 180
        while True:
            ready = sum("READY" in p.read_text() for p in folder.glob(f"{job}_*_log.out"))
            if ready == 6:
                break
            assert time.time() < deadline, f"only {ready} of 6 ranks ready: {hpcring('status', job, env=env).stdout}"
            time.sleep(1)
        yield job, env, script, folder
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        deadline = time.time() + 60
        while time.time() < deadline:
            q = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=30)
            if not q.stdout.strip():
                break
            time.sleep(1)
        script.unlink(missing_ok=True)


def _expected(script: Path) -> list[str]:
    name = script.name
    return [f"ranks 0-4: in wait_for_peers at {name}:{_line(SCRIPT, 'time.sleep(600)')}",
            f"rank 5: in load_batch at {name}:{_line(SCRIPT, 'def load_batch():') + 1}"]


def test_stacks_through_the_sigusr2_hook(hpcring, hung_job):
    job, env, script, folder = hung_job
    r = hpcring("stacks", job, "--method", "signal", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == _expected(script), r.stdout + r.stderr
    saved = Path(r.stderr.split("saved to ")[1].split()[0])
    assert saved.parent == folder / "diag" and saved.name.startswith("stacks-")
    text = saved.read_text()
    assert _expected(script)[0] in text and "via signal" in text
    for rank in range(6):
        assert f"# rank {rank}: pid " in text
    assert "warning" not in r.stderr, r.stderr


def test_stacks_full_and_json(hpcring, hung_job):
    job, env, script, _ = hung_job
    r = hpcring("stacks", job, "--method", "signal", "--full", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("=== ") == 2                       # each distinct stack once
    assert f'File "{script}", line {_line(SCRIPT, "load_batch()")}' in out
    r = hpcring("stacks", job, "--method", "signal", "--json", env=env)
    data = json.loads(r.stdout)
    assert [(g["ranks"], g["where"]) for g in data["groups"]] == [
        ([0, 1, 2, 3, 4], _expected(script)[0].split(": ", 1)[1]),
        ([5], _expected(script)[1].split(": ", 1)[1])]
    hosts = {v["host"] for v in data["ranks"].values()}
    assert hosts == {"node1", "node2", "node3"}


def test_stacks_through_py_spy(hpcring, hung_job):
    from hpcring.diagnostics.stacks_probe import find_pyspy
    if find_pyspy() is None:
        pytest.skip("py-spy is not installed next to this interpreter or on PATH")
    job, env, script, _ = hung_job
    r = hpcring("stacks", job, "--method", "py-spy", "--json", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {v["method"] for v in data["ranks"].values()} == {"py-spy"}
    assert [g["ranks"] for g in data["groups"]] == [[0, 1, 2, 3, 4], [5]]
    assert data["groups"][1]["where"] == _expected(script)[1].split(": ", 1)[1]


def test_stacks_of_a_job_that_is_not_running(hpcring, tmp_path):
    r = hpcring("stacks", "987654321", env={"HPCRING_STATE_DIR": str(tmp_path)})
    assert r.returncode == 1
    assert "job 987654321 is not in squeue" in r.stderr
