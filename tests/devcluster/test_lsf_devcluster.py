"""hpcring's LSF backend end to end on the dev cluster, through the LSF emulation (tests/lsf_emulation).

LSF itself cannot be installed here (proprietary); tests/lsf_emulation's bsub/bjobs/bkill/bstop/
bresume/brequeue/blaunch follow LSF's documented behaviour and place jobs on the dev cluster's
real nodes (network namespaces node1..3). Skipped when the dev cluster is down.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.jobs import job_id_of

ROOT = Path(__file__).resolve().parents[2]
HELLO = ROOT / "examples" / "hello.py"
EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"
SHARED = Path("/srv/hpcring")


@pytest.fixture(scope="module")
def emu_dir():
    d = SHARED / f".lsf-emulation-test-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)
    for p in SHARED.glob(f"lsf_*_{os.getpid()}.py"):  # the test scripts written below
        p.unlink()


@pytest.fixture
def env(tmp_path, emu_dir):
    return {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_LSF_EMU_DIR": str(emu_dir),
            "PATH": f"{EMU_BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}


def run(*argv, env, timeout=60):
    return subprocess.run(list(argv), capture_output=True, text=True, env=dict(os.environ, **env),
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(ROOT))


def hellos(stdout: str) -> list[dict]:
    return [json.loads(l.split("HELLO ", 1)[1]) for l in stdout.splitlines() if "<stdout>:HELLO " in l]


def bjobs_stat(jid: str, env) -> str:
    return run("bjobs", "-o", "jobid stat", "-noheader", jid, env=env).stdout.split()[1]


def wait_for(pred, what: str, timeout: float = 60.0):
    deadline = time.time() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def sleeper(name: str, seconds: int = 600) -> Path:
    p = SHARED / f"lsf_{name}_{os.getpid()}.py"
    p.write_text(f"import time\nprint('sleeping', flush=True)\ntime.sleep({seconds})\n")
    return p


def test_hello_6_ranks_over_3_nodes(hpcring, env):
    r = hpcring("submit", str(HELLO), "--site", "devcluster-lsf", "--nodes", "3", "--tasks-per-node", "2",
                "--wait", env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    recs = hellos(r.stdout)
    assert sorted(x["rank"] for x in recs) == list(range(6))
    by_host = {}
    for x in recs:
        assert x["size"] == 6
        by_host.setdefault(x["host"], set()).add((x["local_rank"], x["address"]))
    assert sorted(by_host) == ["node1", "node2", "node3"]
    for host, items in by_host.items():
        assert {lr for lr, _ in items} == {0, 1}
        assert {a for _, a in items} == {f"10.99.0.{host[-1]}"}
    jid = job_id_of(r)
    st = hpcring("status", jid, env=env)
    assert st.returncode == 0 and "COMPLETED (DONE)" in st.stdout, st.stdout
    assert bjobs_stat(jid, env) == "DONE"
    folder = SHARED / "lsf-jobs" / jid     # the site's job_dir
    for rank in range(6):  # submitit: one result per rank; hpcring: status and per-rank logs
        assert (folder / f"{jid}_{rank}_result.pkl").is_file()
        assert json.loads((folder / f"{jid}_{rank}_status.json").read_text())["launcher"] == "blaunch"
        assert "HELLO" in (folder / f"{jid}_{rank}_log.out").read_text()
    assert "Successfully completed." in (folder / f"{jid}_batch.out").read_text()


def test_failing_rank_named(hpcring, env):
    r = hpcring("submit", str(HELLO), "--site", "devcluster-lsf", "--nodes", "3", "--tasks-per-node", "2",
                "--wait", env=dict(env, HELLO_FAIL_RANK="3"))
    assert r.returncode == 3, r.stderr
    assert "rank 3 on node2: exited with code 3" in r.stderr, r.stderr
    assert bjobs_stat(job_id_of(r), env) == "EXIT"


def test_cancel_through_bkill(hpcring, env):
    r = hpcring("submit", str(sleeper("cancel")), "--site", "devcluster-lsf", "--nodes", "2", env=env)
    assert r.returncode == 0, r.stderr
    jid = job_id_of(r)
    wait_for(lambda: "RUNNING" in hpcring("status", jid, env=env).stdout, "RUN")
    assert hpcring("cancel", jid, env=env).returncode == 0
    out = wait_for(lambda: (lambda o: o if "CANCELLED" in o else None)(hpcring("status", jid, env=env).stdout),
                   "CANCELLED")
    assert "(EXIT)" in out
    assert bjobs_stat(jid, env) == "EXIT"


def test_suspended_job_is_not_finished(hpcring, env):
    r = hpcring("submit", str(sleeper("susp", 8)), "--site", "devcluster-lsf", "--nodes", "1", env=env)
    jid = job_id_of(r)
    wait_for(lambda: bjobs_stat(jid, env) == "RUN", "RUN")
    assert run("bstop", jid, env=env).returncode == 0
    assert bjobs_stat(jid, env) == "USUSP"
    from hpcring.schedulers import lsf
    for _ in range(3):  # still suspended well past the script's 8 s
        st = hpcring("status", jid, env=env).stdout
        assert "SUSPENDED (USUSP)" in st, st
        time.sleep(4)
    watcher = lsf.LsfInfoWatcher()
    watcher.register_job(jid)
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert watcher.get_state(jid, mode="force") == "SUSPENDED" and not watcher.is_done(jid, mode="cache")
    assert run("bresume", jid, env=env).returncode == 0
    wait_for(lambda: bjobs_stat(jid, env) == "DONE", "DONE after bresume", 60)


def test_brequeue_reruns_with_the_same_id(hpcring, env, tmp_path):
    marker = SHARED / f"lsf_requeue_{os.getpid()}"
    script = SHARED / f"lsf_requeue_{os.getpid()}.py"
    script.write_text(f"import os, time\np = {str(marker)!r}\n"
                      "first = not os.path.exists(p)\nopen(p, 'a').write('run\\n')\n"
                      "time.sleep(600 if first else 0)\n")
    r = hpcring("submit", str(script), "--site", "devcluster-lsf", env=env)
    jid = job_id_of(r)
    wait_for(lambda: marker.exists(), "first run")
    assert "is being requeued" in run("brequeue", jid, env=env).stdout
    wait_for(lambda: bjobs_stat(jid, env) == "DONE", "DONE after requeue", 90)
    assert marker.read_text() == "run\nrun\n"
    marker.unlink()


def test_submitit_executor_one_result_per_rank(env, tmp_path):
    """The plugin on its own: submitit.Job.results() returns one value per rank."""
    code = f"""
import os, socket, sys
from hpcring.schedulers.lsf import LsfExecutor
def who():
    import submitit
    e = submitit.JobEnvironment()
    return (e.global_rank, e.local_rank, e.num_tasks, socket.gethostname())
ex = LsfExecutor({str(SHARED / 'jobs' / 'submitit' / '%j')!r}, site="devcluster-lsf")
ex.update_parameters(nodes=3, tasks_per_node=2, time=5)
job = ex.submit(who)
job.watcher._delay_s = 2
print("RESULTS", sorted(job.results()))
"""
    r = run(sys.executable, "-c", code, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    results = eval(r.stdout.split("RESULTS ", 1)[1])
    assert [x[0] for x in results] == list(range(6)) and {x[2] for x in results} == {6}
    assert [x[3] for x in results] == ["node1", "node1", "node2", "node2", "node3", "node3"]
    assert [x[1] for x in results] == [0, 1, 0, 1, 0, 1]


def test_ring_allreduce_across_6_ranks(hpcring, env):
    try:
        import importlib
        pkg = importlib.import_module("hpcring")
        from hpcring.collectives import Communicator  # noqa: F401
        assert callable(pkg.init)
    except (ImportError, AttributeError, AssertionError) as exc:
        pytest.skip(f"hpcring.collectives is not usable yet ({exc})")
    script = SHARED / f"lsf_allreduce_{os.getpid()}.py"
    script.write_text("import json\nimport numpy as np\nimport hpcring\n"
                      "s = hpcring.init()\n"
                      "y = s.communicator('ring').allreduce(np.full(1000, s.rank + 1, dtype=np.float64))\n"
                      "print('SUM ' + json.dumps({'rank': s.rank, 'min': float(y.min()), 'max': float(y.max())}), flush=True)\n")
    r = hpcring("submit", str(script), "--site", "devcluster-lsf", "--nodes", "3", "--tasks-per-node", "2",
                "--wait", env=env, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    sums = [json.loads(l.split("SUM ", 1)[1]) for l in r.stdout.splitlines() if "<stdout>:SUM " in l]
    assert sorted(s["rank"] for s in sums) == list(range(6))
    assert all(s["min"] == s["max"] == 21.0 for s in sums)  # 1 + 2 + ... + 6


def test_hpcring_run_inside_an_lsf_job_leaves_the_launch_node_out(env):
    """`hpcring run` in a job of 3 hosts x 2 slots, with a site whose first host is the launch node:
    blaunch starts 2 x 2 ranks on the other two hosts, from the host file hpcring run wrote, and
    every rank's bootstrap sees the same 4-rank world (a quoted argument survives blaunch's shell)."""
    site = SHARED / f"lsf_run_site_{os.getpid()}.yaml"
    site.write_text((ROOT / "site_configs" / "devcluster-lsf.yaml").read_text()
                    .replace('  warning_time: "1"', '  warning_time: "1"\n  drop_launch_node: true'))
    out = SHARED / f"lsf_run_{os.getpid()}.out"
    script = SHARED / f"lsf_run_{os.getpid()}.sh"
    whoami = f"import runpy; runpy.run_path('{ROOT / 'examples' / 'whoami.py'}')"
    script.write_text(f"#!/bin/bash\n#BSUB -n 6\n#BSUB -R \"span[ptile=2]\"\n#BSUB -W 5\n#BSUB -oo {out}\n"
                      f"exec {sys.executable} -m hpcring run --site {site} --tasks-per-node 2 -- "
                      f"{sys.executable} -c \"{whoami}\"\n")
    try:
        r = run("/bin/sh", "-c", 'exec bsub < "$1"', "bsub", str(script), env=env)
        jid = r.stdout.split("<")[1].split(">")[0]
        wait_for(lambda: bjobs_stat(jid, env) in ("DONE", "EXIT"), "the job's end", 120)
        text = wait_for(lambda: out.is_file() and out.read_text(), "the job's output")
        assert bjobs_stat(jid, env) == "DONE", text[-3000:]
        recs = [json.loads(line.split("TOPO ", 1)[1]) for line in text.splitlines() if "TOPO " in line]
        assert sorted(x["rank"] for x in recs) == [0, 1, 2, 3], text[-3000:]
        for x in recs:
            assert x["size"] == 4 and x["hosts"] == ["node2", "node2", "node3", "node3"]
            assert x["host"] == x["hosts"][x["rank"]] and x["launcher"] == "blaunch"
            assert x["local_size"] == 2 and x["num_nodes"] == 2
    finally:
        for p in (site, out, script):
            p.unlink(missing_ok=True)


def test_a_straggler_is_named_and_reported_on_lsf(hpcring, env):
    """A 6-rank LSF job (3 nodes) whose rank 5 computes 1.5x as long: rank 0's watcher names it
    with its node while it runs, and `hpcring report` shows the verdict and each rank's split
    adding up to its wall time."""
    train = ROOT / "benchmarks" / "straggler_train.py"
    r = hpcring("submit", str(train), "--site", "devcluster-lsf", "--nodes", "3", "--tasks-per-node", "2", "--wait",
                env=dict(env, STEPS="160", SLOW_RANK="5", SLOW_FACTOR="1.5", WORK_MS="20"), timeout=400)
    assert r.returncode == 0, r.stderr + r.stdout
    jid = job_id_of(r)
    rep = hpcring("report", jid, "--json", env=env, timeout=120)
    assert rep.returncode == 0 and "Traceback" not in rep.stderr, rep.stderr
    doc = json.loads(rep.stdout)
    named = [e["verdict"] for e in doc["stragglers"] if e["verdict"]]
    assert named and named[0]["kind"] == "rank" and named[0]["ranks"] == [5] and named[0]["host"] == "node3", named
    assert doc["job"]["scheduler"] == "lsf" and len(doc["ranks"]) == 6
    for e in doc["ranks"]:
        parts = sum(e[f"{p}_s"] for p in ("startup", "compute", "communication", "waiting"))
        assert abs(parts - e["wall_s"]) <= 0.02 * e["wall_s"], e
