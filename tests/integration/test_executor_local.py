"""``hpcring.Executor`` on the local backend, real jobs: a function on every rank inside hpcring's
bootstrap (an allreduce through ``hpcring.init().communicator()``), a failing rank's exception and
host in ``result()``, ``map_array`` with a parallel limit, cancel, the CLI seeing a Python job and
Python seeing a CLI job, a function of ``__main__`` sent by value, bounded waits."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import hpcring
from hpcring.errors import JobFailedError, WaitTimeoutError

ROOT = Path(__file__).resolve().parents[2]
HELLO = str(ROOT / "examples" / "hello.py")
DEADLINE = 120.0          # any job here ends within seconds; a wait that reaches this is a failure


# --- what the ranks run (this module is importable on the ranks: the submitter's sys.path goes along)

def allreduce_rank(offset):
    import numpy as np
    session = hpcring.init()
    comm = session.communicator()
    total = comm.allreduce(np.array([session.rank + offset], dtype=np.float64))
    print(f"rank {session.rank} of {session.size} on {session.host}: sum {total[0]:g}", flush=True)
    return {"rank": session.rank, "size": session.size, "host": session.host, "sum": float(total[0]),
            "world": int(os.environ["WORLD_SIZE"])}


def fail_on_rank(bad):
    session = hpcring.init()
    if session.rank == bad:
        inner_failure(session.rank)
    session.communicator().barrier()
    return session.rank


def inner_failure(rank):
    raise ValueError(f"rank {rank} cannot go on")


def timed_task(i, pause):
    session = hpcring.init()
    started = time.time()
    time.sleep(pause)
    session.communicator().barrier()
    return {"item": i, "task": os.environ.get("HPCRING_ARRAY_TASK"), "rank": session.rank,
            "started": started, "ended": time.time()}


def allreduce_when_every_task_is_up(flag_dir, ranks, value):
    """Every rank of every task waits until all are up, then its task's first collective: the
    tasks set their ring up (shared memory between the ranks of local0) at the same moment."""
    import numpy as np
    session = hpcring.init()
    Path(flag_dir, f"{os.environ['HPCRING_ARRAY_TASK']}-{session.rank}").write_text("")
    deadline = time.monotonic() + 60
    while len(os.listdir(flag_dir)) < ranks and time.monotonic() < deadline:
        time.sleep(0.005)
    return float(session.communicator().allreduce(np.array([value], dtype=np.float64))[0])


def sleeper(pid_dir, seconds):
    Path(pid_dir, str(os.getpid())).write_text("")
    time.sleep(seconds)
    return "woke"


@pytest.fixture
def env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("HPCRING_SITE", "local")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return {k: os.environ[k] for k in ("HPCRING_STATE_DIR", "HPCRING_JOB_DIR", "HPCRING_SITE")}


@pytest.fixture(scope="session")
def hpcring_cli(request):
    """The conftest `hpcring` runner (here `hpcring` names the library) with a 120 s bound."""
    return functools.partial(request.getfixturevalue("hpcring"), timeout=120)


def executor(**params):
    ex = hpcring.Executor(site="local")
    ex.update_parameters(nodes=1, tasks_per_node=2, time=5, timeout=60, **params)
    return ex


def test_allreduce_on_every_rank(env):
    job = executor().submit(allreduce_rank, 10)
    assert job.wait(timeout=DEADLINE) == "COMPLETED"
    assert job.done() and job.state == "COMPLETED"
    got = job.results(timeout=DEADLINE)
    assert got == [{"rank": r, "size": 2, "host": "local0", "sum": 21.0, "world": 2} for r in (0, 1)]
    assert job.result() == got[0]
    assert job.exception() is None
    assert "rank 0 of 2 on local0: sum 21" in job.stdout(0) and "rank 1 of 2" in job.stdout(1)
    assert "[1]<stdout>:rank 1 of 2 on local0: sum 21" in job.logs().splitlines()
    assert job.name == "allreduce_rank" and job.num_tasks == 2


def test_a_failing_rank_reaches_result(hpcring_cli, env):
    job = executor().submit(fail_on_rank, 1)
    with pytest.raises(JobFailedError) as info:
        job.result(timeout=DEADLINE)
    exc = info.value
    text = str(exc)
    assert (exc.rank, exc.host) == (1, "local0")
    assert f"job {job.job_id} (fail_on_rank) FAILED: rank 1 on local0: ValueError: rank 1 cannot go on" in text
    assert exc.traceback.startswith("Traceback (most recent call last):")
    assert exc.traceback.rstrip().endswith("ValueError: rank 1 cannot go on")
    # the user's frames only, each with its line, as python itself shows them
    assert 'in fail_on_rank\n    inner_failure(session.rank)' in exc.traceback
    assert 'in inner_failure\n    raise ValueError(f"rank {rank} cannot go on")' in exc.traceback
    assert "submitit" not in exc.traceback and "hpcring/job.py" not in exc.traceback
    assert "traceback of rank 1 on local0:" in text and f"hpcring logs {job.job_id} --rank 1" in text
    assert isinstance(exc, hpcring.HpcringError) and exc.exit_code == 1
    with pytest.raises(JobFailedError, match="rank 1 on local0"):
        job.results()
    assert job.exception().rank == 1
    assert "ValueError: rank 1 cannot go on" in job.stderr(1)
    st = hpcring_cli("status", job.job_id)
    assert "FAILED" in st.stdout and "rank 1 on local0: ValueError: rank 1 cannot go on" in st.stdout, st.stdout


def test_map_array_runs_at_most_two_tasks_at_once(hpcring_cli, env):
    jobs = executor(array_parallelism=2).map_array(timed_task, range(6), [1.5] * 6)
    assert len(jobs) == 6 and len({j.job_id.split("_")[0] for j in jobs}) == 1
    results = [j.results(timeout=DEADLINE) for j in jobs]
    assert [[r["item"] for r in rs] for rs in results] == [[i, i] for i in range(6)]
    assert [rs[0]["task"] for rs in results] == [str(i) for i in range(6)]
    # the tasks' own spans (the supervisor's start to end, which hold the function's) and the
    # functions' spans: at no moment more than 2 of either
    for spans in ([(json.loads((j.folder / f"{j.job_id}_local.json").read_text())["started"],
                    json.loads((j.folder / f"{j.job_id}_local.json").read_text())["ended"]) for j in jobs],
                  [(min(r["started"] for r in rs), max(r["ended"] for r in rs)) for rs in results]):
        for start, _ in spans:
            assert sum(1 for s, e in spans if s <= start < e) <= 2, spans
        assert max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans) == 2, spans   # and 2 did run together
    st = hpcring_cli("status", jobs[0].job_id.split("_")[0])
    assert "array of 6 tasks (at most 2 at once)" in st.stdout and "6 COMPLETED" in st.stdout, st.stdout


def test_array_tasks_running_at_once_on_one_host_each_have_their_own_shared_memory(env, tmp_path):
    """An array's tasks share one secret: their rings' shared-memory segments on local0 must still
    differ (they once had one name, and one task's leader unlinked another's live segment)."""
    flags = tmp_path / "flags"
    flags.mkdir()
    jobs = executor(array_parallelism=3).map_array(allreduce_when_every_task_is_up, [str(flags)] * 3, [6] * 3,
                                                    [1.0, 2.0, 3.0])
    assert [j.results(timeout=DEADLINE) for j in jobs] == [[2.0, 2.0], [4.0, 4.0], [6.0, 6.0]]


def test_cancel(hpcring_cli, env, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    job = executor().submit(sleeper, str(pids), 120)
    deadline = time.monotonic() + DEADLINE
    while len(list(pids.iterdir())) < 2:                 # both ranks are in the function
        assert time.monotonic() < deadline and not job.done(), "the ranks never started"
        time.sleep(0.2)
    assert job.state == "RUNNING"
    job.cancel()
    assert job.wait(timeout=30) == "CANCELLED"
    with pytest.raises(JobFailedError, match="CANCELLED"):
        job.result()
    for pid in (int(p.name) for p in pids.iterdir()):   # no rank outlives the cancel
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    job.cancel()                                         # ended: nothing to do, no error
    again = hpcring_cli("cancel", job.job_id)
    assert "has already ended (CANCELLED)" in again.stderr


def test_wait_has_a_deadline(env, tmp_path):
    job = executor().submit(sleeper, str(tmp_path), 60)
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError) as info:
        job.wait(timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert isinstance(info.value, TimeoutError) and f"job {job.job_id}" in str(info.value)
    assert "hint:" in str(info.value) and f"hpcring cancel {job.key}" in str(info.value)
    with pytest.raises(TimeoutError):
        job.result(timeout=0.2)
    with pytest.raises(hpcring.HpcringError, match="wait"):
        job.wait(timeout=float("nan"))
    job.cancel()
    assert job.wait(timeout=30) == "CANCELLED"


def test_the_cli_sees_a_python_job(hpcring_cli, env):
    job = executor(name="from-python").submit(allreduce_rank, 1)
    job.wait(timeout=DEADLINE)
    st = hpcring_cli("status", job.job_id)
    assert st.returncode == 0 and f"job {job.job_id}  COMPLETED" in st.stdout and "name from-python" in st.stdout
    assert str(job.folder) in st.stdout
    table = hpcring_cli("status")
    assert f"local-{job.job_id}" in table.stdout and "test_executor_local.allreduce_rank()" in table.stdout
    logs = hpcring_cli("logs", job.job_id)
    assert "[0]<stdout>:rank 0 of 2 on local0: sum 3" in logs.stdout.splitlines(), logs.stdout
    assert logs.stdout == job.logs()
    one = hpcring_cli("logs", job.job_id, "--rank", "1")
    assert one.stdout.splitlines() == ["[1]<stdout>:rank 1 of 2 on local0: sum 3"]


def test_python_sees_a_cli_job(hpcring_cli, env):
    r = hpcring_cli("submit", HELLO, "--tasks-per-node", "2")
    assert r.returncode == 0, r.stderr
    job_id = r.stderr.split("Submitted job ")[1].split()[0]
    job = hpcring.Job(job_id)
    assert job.wait(timeout=DEADLINE) == "COMPLETED"
    assert job.results() == [0, 0]          # a script's ranks return its exit code
    assert sum(1 for ln in job.logs().splitlines() if "<stdout>:HELLO " in ln) == 2
    assert hpcring.Executor().job(f"local-{job_id}").key == job.key == f"local-{job_id}"
    failing = hpcring_cli("submit", HELLO, "--tasks-per-node", "2", env={"HELLO_FAIL_RANK": "1"})
    bad = hpcring.Job(failing.stderr.split("Submitted job ")[1].split()[0])
    with pytest.raises(JobFailedError) as info:
        bad.result(timeout=DEADLINE)
    assert (info.value.rank, info.value.exit_code) == (1, 3) and "exited with code 3" in str(info.value)


def test_submit_script(env):
    job = executor().submit_script(HELLO)
    assert job.results(timeout=DEADLINE) == [0, 0] and job.name == "hello"


MAIN = '''\
import os, sys
import hpcring

class Point:                                  # a class of __main__ goes by value too
    def __init__(self, x):
        self.x = x

def scale(p, k):
    session = hpcring.init()
    if k < 0:
        raise RuntimeError(f"negative scale on rank {session.rank}")
    return Point(p.x * k + session.rank)

if __name__ == "__main__":
    ex = hpcring.Executor(site="local")
    ex.update_parameters(tasks_per_node=2, time=5)
    good = ex.submit(scale, Point(3), 2)
    bad = ex.submit(scale, Point(3), -1)
    os.unlink(__file__)                       # the ranks need nothing of this file
    print([p.x for p in good.results(timeout=120)])
    try:
        bad.result(timeout=120)
    except hpcring.JobFailedError as exc:
        print("FAILED", exc.rank, exc.host)
        print(exc.traceback)
'''


def test_a_function_of_main_goes_by_value(env, tmp_path):
    """A script's own function and class run on the ranks although the script is gone by then
    (cloudpickle sends them by value), and the traceback still shows the script's lines."""
    script = tmp_path / "elsewhere" / "driver.py"
    script.parent.mkdir()
    script.write_text(MAIN)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "[6, 7]" and out[1] in ("FAILED 0 local0", "FAILED 1 local0"), r.stdout   # both fail: the first
    line = MAIN.splitlines().index('        raise RuntimeError(f"negative scale on rank {session.rank}")') + 1
    assert f'File "{script}", line {line}, in scale' in r.stdout
    assert 'raise RuntimeError(f"negative scale on rank {session.rank}")' in r.stdout
    assert not script.exists()


def test_a_module_function_loads_from_the_submitters_path(env, tmp_path, monkeypatch):
    """A function of a module the ranks can import from the submitter's sys.path (its own folder):
    sent by reference, loaded there."""
    mod = tmp_path / "mods" / "mytasks.py"
    mod.parent.mkdir()
    mod.write_text(textwrap.dedent("""
        import hpcring
        def who():
            return hpcring.init().rank * 10
    """))
    monkeypatch.syspath_prepend(str(mod.parent))
    import mytasks
    job = executor().submit(mytasks.who)
    assert job.results(timeout=DEADLINE) == [0, 10]
