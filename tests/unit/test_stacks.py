"""Stack capture, the the stack signal hook, parsing, grouping and the node probe (hpcring.diagnostics.stacks*).

The dumps in tests/data/stacks/ are real: faulthandler-rank<r>.txt is what the the stack signal hook of rank
r appended, pyspy-rank<r>.txt is `py-spy dump --full-filenames`, both taken from one local-backend
job (tests/data/stacks/train_hang.py) where ranks 0-2 waited in an allreduce and rank 3 in load_batch.
"""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from hpcring.diagnostics import stacks, stacks_probe
from hpcring.diagnostics.stacks import (Frame, format_all_threads, group, install_signal_dump, locate,
                                        main_thread, parse_stacks, rank_ranges, summarize, where)

DATA = Path(__file__).resolve().parents[1] / "data" / "stacks"
HERE = os.path.basename(__file__)


def fixture(name: str) -> str:
    return (DATA / name).read_text()


@pytest.fixture
def no_hook():
    """Leave the stack signal as it was: the hook is process-wide."""
    stacks.uninstall_signal_dump()
    stacks._warned = False
    yield
    stacks.uninstall_signal_dump()
    stacks._warned = False


def _line_of(fn, text: str) -> int:
    """Line number of the first line of ``fn``'s source containing ``text``."""
    import inspect
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# ------------------------------------------------------------------------------- parsing

def test_parse_faulthandler_dump():
    threads = parse_stacks(fixture("faulthandler-rank0.txt"))
    assert len(threads) == 2
    main = main_thread(threads)
    assert main is threads[-1] and main.current            # faulthandler lists the main thread last
    assert main.name is None and main.ident.startswith("0x")
    assert main.frames[0] == Frame("/work/main/src/hpcring/collectives/ring.py", 312, "_call")
    assert main.frames[7] == Frame("/work/main/tests/data/stacks/train_hang.py", 22, "train_step")
    assert main.frames[-1].func == "_run_module_as_main" and main.frames[-1].file == "<frozen runpy>"
    assert [f.func for f in threads[0].frames[:2]] == ["select", "_run"]


def test_parse_pyspy_dump():
    threads = parse_stacks(fixture("pyspy-rank0.txt"))
    assert [t.name for t in threads] == ["MainThread", "hpcring-store:29507"]
    main = main_thread(threads)
    assert main is threads[0] and main.ident == "12202" and main.pid_thread
    assert main.frames[0] == Frame("/work/main/src/hpcring/collectives/ring.py", 312, "RingBackend._call")
    assert main.frames[2].func == "Communicator._allreduce.<locals>.run"
    assert main.frames[10] == Frame("<frozen runpy>", 88, "_run_code")


def test_pyspy_and_faulthandler_frames_have_the_same_keys():
    fh = main_thread(parse_stacks(fixture("faulthandler-rank0.txt")))
    spy = main_thread(parse_stacks(fixture("pyspy-rank0.txt")))
    assert fh.key() == spy.key()


def test_parse_ignores_noise_and_handles_unknown_lines():
    text = ("garbage before\n"
            "Thread 0x0000000000000001 \"worker\" (most recent call first):\n"
            '  File "/x/a.py", line ??? in f\n'
            "  <no Python frame>\n"
            "Stack (most recent call first):\n"
            '  File "/x/b.py", line 3 in g\n')
    threads = parse_stacks(text)
    assert [(t.name, [(f.file, f.line, f.func) for f in t.frames]) for t in threads] == [
        ("worker", [("/x/a.py", None, "f")]), (None, [("/x/b.py", 3, "g")])]
    assert parse_stacks("") == [] and main_thread([]) is None


# ------------------------------------------------------------------------------- location

@pytest.mark.parametrize("name", ["faulthandler-rank0.txt", "faulthandler-rank1.txt", "pyspy-rank0.txt"])
def test_locate_names_the_hpcring_call_and_the_user_line(name):
    main = main_thread(parse_stacks(fixture(name)))
    assert locate(main.frames) == "in allreduce at train_hang.py:22 (train_step)"


@pytest.mark.parametrize("name", ["faulthandler-rank3.txt", "pyspy-rank3.txt"])
def test_locate_plain_user_function(name):
    assert locate(main_thread(parse_stacks(fixture(name))).frames) == "in load_batch at train_hang.py:17"


def test_locate_falls_back_outside_user_code():
    frames = [Frame("/usr/lib/python3.11/threading.py", 331, "wait"), Frame("<frozen runpy>", 88, "_run_code")]
    assert locate(frames) == "in wait at threading.py:331"
    assert locate([]) == "no Python frame"
    # a relative name as py-spy writes it without --full-filenames: the stdlib by module name
    assert locate([Frame("threading.py", 1, "wait"), Frame("data.py", 12, "load")]) == "in load at data.py:12"


def test_user_script_under_a_folder_named_hpcring_is_user_code():
    frames = [Frame("/srv/hpcring/jobs/train.py", 5, "step")]
    assert locate(frames) == "in step at train.py:5"


# ------------------------------------------------------------------------------- grouping

def test_group_mixed_formats_and_summarize():
    by_rank = {0: fixture("faulthandler-rank0.txt"), 1: fixture("faulthandler-rank1.txt"),
               2: fixture("pyspy-rank0.txt"), 3: fixture("pyspy-rank3.txt")}
    groups = group(by_rank)
    assert [g.ranks for g in groups] == [[0, 1, 2], [3]]
    assert summarize(groups) == ("ranks 0-2: in allreduce at train_hang.py:22 (train_step); "
                                 "rank 3: in load_batch at train_hang.py:17")
    assert summarize(groups, sep="\n").count("\n") == 1


def test_group_orders_largest_first_and_keeps_missing_ranks():
    allred, load = fixture("faulthandler-rank0.txt"), fixture("faulthandler-rank3.txt")
    by_rank = {r: allred for r in (0, 1, 2, 3, 4, 6)}
    by_rank.update({5: load, 7: None, 8: "not a dump"})
    groups = group(by_rank)
    assert [g.ranks for g in groups] == [[0, 1, 2, 3, 4, 6], [5], [7], [8]]
    assert summarize(groups) == ("ranks 0-4,6: in allreduce at train_hang.py:22 (train_step); "
                                 "rank 5: in load_batch at train_hang.py:17; rank 7: no stack collected; "
                                 "rank 8: no Python thread in the dump")


def test_rank_ranges():
    assert rank_ranges([6, 0, 1, 2, 3, 4, 4]) == "0-4,6"
    assert rank_ranges([5]) == "5"
    assert rank_ranges(range(0, 100, 2))[:9] == "0,2,4,6,8"


# ------------------------------------------------------------------------------- live capture

def blocked_in_known_function(ev: threading.Event) -> None:
    ev.wait(30)


def wait_for_key(client) -> None:
    try:
        client.get("never-set", timeout=30)
    except Exception:
        pass


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_where_on_a_blocked_thread():
    ev = threading.Event()
    t = threading.Thread(target=blocked_in_known_function, args=(ev,), name="blocked")
    t.start()
    try:
        line = _line_of(blocked_in_known_function, "ev.wait")
        _wait_until(lambda: where(t) == f"in blocked_in_known_function at {HERE}:{line}")
        assert where(t.ident) == where(t)
        text = format_all_threads()
        assert '"blocked" (most recent call first):' in text
        assert f'line {line} in blocked_in_known_function' in text
        assert text.startswith("Current thread") and '"MainThread"' in text.splitlines()[0]
    finally:
        ev.set()
        t.join(5)
    assert where(t) == "thread not running"


def test_where_names_the_hpcring_call_a_thread_is_in():
    from hpcring.bootstrap.store_client import StoreClient
    from hpcring.bootstrap.store_server import StoreServer
    secret = os.urandom(32)
    srv = StoreServer("127.0.0.1", 0, secret=secret)
    client = StoreClient("127.0.0.1", srv.port, secret, timeout=10)
    t = threading.Thread(target=wait_for_key, args=(client,), daemon=True)
    t.start()
    try:
        line = _line_of(wait_for_key, "client.get")
        _wait_until(lambda: where(t) == f"in get at {HERE}:{line} (wait_for_key)")
    finally:
        srv.close()
        t.join(10)
        client.close()


def allreduce_alone(comm) -> None:
    comm.allreduce(np.ones(4, np.float32), timeout=5.0)      # the other rank never joins


def test_where_names_a_communicator_collective_not_its_wrapper():
    """Communicator.allreduce is generated (sync/async twins): a thread blocked in it must read
    "in allreduce", as users wrote it, not the wrapper's own name."""
    import helpers.ring as H
    g = H.ThreadGroup(2, timeout=30)
    t = threading.Thread(target=lambda: pytest.raises(Exception, allreduce_alone, g.comms[0]), daemon=True)
    t.start()
    seen = []
    try:
        line = _line_of(allreduce_alone, "comm.allreduce")
        _wait_until(lambda: seen.append(where(t)) or seen[-1] == f"in allreduce at {HERE}:{line} (allreduce_alone)",
                    timeout=4.0)
    except AssertionError:
        raise AssertionError(f"last seen: {seen[-3:]}") from None
    finally:
        t.join(30)                 # the collective times out first: a running one cannot be closed
        g.close()


def main_blocked_in_c(started: threading.Event, release: threading.Lock) -> None:
    started.set()
    release.acquire(timeout=30)   # a lock acquire: C code, GIL released, no Python frame inside


def test_capture_from_a_background_thread_while_main_is_blocked_in_c():
    started, release = threading.Event(), threading.Lock()
    release.acquire()
    seen = {}

    def watcher():
        started.wait(10)
        line = _line_of(main_blocked_in_c, "release.acquire")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen["where"], seen["text"] = where(), format_all_threads()
            if seen["where"] == f"in main_blocked_in_c at {HERE}:{line}":
                break
            time.sleep(0.01)
        release.release()

    t = threading.Thread(target=watcher, name="watcher")
    t.start()
    main_blocked_in_c(started, release)
    t.join(10)
    line = _line_of(main_blocked_in_c, "release.acquire")
    assert seen["where"] == f"in main_blocked_in_c at {HERE}:{line}"
    main = main_thread(parse_stacks(seen["text"]))
    assert main.name == "MainThread" and main.frames[0].func == "main_blocked_in_c"


# ------------------------------------------------------------------------------- the hook

def test_install_signal_dump_appends_on_sigusr2_and_is_idempotent(tmp_path, no_hook):
    path = install_signal_dump(tmp_path / "diag", 4)
    assert path == tmp_path / "diag" / "stacks-live-rank4.txt"
    assert install_signal_dump(tmp_path / "diag", 4) == path            # again: nothing changes
    assert path.read_text().count("# hpcring stack dumps of rank 4") == 1
    assert stacks.installed_signal_dump() == path
    before = path.stat().st_size
    os.kill(os.getpid(), stacks.STACK_SIGNAL)
    _wait_until(lambda: path.stat().st_size > before)
    dump = path.read_text()[before:]
    threads = parse_stacks(dump)
    assert any(f.func == "test_install_signal_dump_appends_on_sigusr2_and_is_idempotent"
               for t in threads for f in t.frames)


def test_install_signal_dump_file_path_and_move(tmp_path, no_hook):
    first = install_signal_dump(tmp_path / "a.txt", 0)
    assert first == tmp_path / "a.txt"
    second = install_signal_dump(tmp_path / "b", 0)
    assert second == tmp_path / "b" / "stacks-live-rank0.txt"
    before = first.stat().st_size
    os.kill(os.getpid(), stacks.STACK_SIGNAL)
    _wait_until(lambda: second.stat().st_size > 60)
    assert first.stat().st_size == before                              # the hook moved


def test_install_signal_dump_default_goes_to_the_job_diag_dir(tmp_path, monkeypatch, no_hook):
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "job"))
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    monkeypatch.setenv("HPCRING_JOB_ID", "7")
    for var in ("SLURM_JOB_ID", "LSB_JOBID", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    assert install_signal_dump(None, 2) == tmp_path / "job" / "7" / "diag" / "stacks-live-rank2.txt"


def test_install_signal_dump_unwritable_warns_once_and_never_raises(tmp_path, no_hook):
    blocker = tmp_path / "file"
    blocker.write_text("x")          # a file where the folder should be: fails even as root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert install_signal_dump(blocker / "diag", 1) is None
        assert install_signal_dump(blocker / "diag", 1) is None
    assert len(caught) == 1 and "rank 1 gets no stack dump on SIGRTMIN+6" in str(caught[0].message)
    assert stacks.installed_signal_dump() is None


# ------------------------------------------------------------------------------- the probe

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from hpcring.diagnostics.stacks import install_signal_dump
    if sys.argv[1] != "-":
        install_signal_dump(sys.argv[1], int(os.environ["SLURM_PROCID"]))
    if os.environ.get("FORK_WORKER") and os.fork() == 0:
        time.sleep(60)          # a forked data-loader worker: same environment, same rank
    def stuck_in_c():
        print("ready", flush=True)   # from inside: a dump right after "ready" finds it here
        time.sleep(60)
    stuck_in_c()
""")


@pytest.fixture
def fake_rank(tmp_path):
    """Start a Python 'rank' of a fake Slurm job; yields (job id, Popen); kills it (and its fork)."""
    started = []

    def start(rank=3, hook=True, node="nodeA", fork=False):
        job = f"stk{os.getpid()}x{len(started)}"
        env = dict(os.environ, SLURM_JOB_ID=job, SLURM_PROCID=str(rank), SLURMD_NODENAME=node,
                   SLURM_STEP_ID="0", PYTHONPATH=str(Path(stacks.__file__).parents[2]))
        env.pop("HPCRING_RANK", None)
        if fork:
            env["FORK_WORKER"] = "1"
        script = tmp_path / "rank.py"
        script.write_text(RANK_SCRIPT)
        p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "diag") if hook else "-"], env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(p)
        assert p.stdout.readline().strip() == "ready"
        return job, p

    yield start
    for p in started:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def test_probe_finds_the_rank_and_dumps_it_through_the_hook(fake_rank):
    job, p = fake_rank(rank=3)
    procs, notes = stacks_probe.find_ranks(job, "slurm", me={"SLURMD_NODENAME": "nodeA"})
    assert list(procs) == [3] and procs[3].pid == p.pid, notes
    assert stacks_probe.catches(p.pid, stacks.STACK_SIGNAL)
    text, live = stacks_probe.dump_signal(p.pid, time.monotonic() + 10)
    assert live.endswith("stacks-live-rank3.txt")
    assert locate(main_thread(parse_stacks(text)).frames).startswith("in stuck_in_c at rank.py:")
    result = stacks_probe.probe(job, "slurm", "signal", timeout=10)
    (rec,) = [r for r in result["ranks"] if r["pid"] == p.pid]
    assert rec["method"] == "signal" and rec["error"] is None and "stuck_in_c" in rec["text"]


def test_probe_skips_other_nodes_and_its_own_step(fake_rank):
    job, p = fake_rank(rank=1, node="nodeB")
    assert stacks_probe.find_ranks(job, "slurm", me={"SLURMD_NODENAME": "nodeA"})[0] == {}
    mine = {"SLURMD_NODENAME": "nodeB", "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0"}
    assert stacks_probe.find_ranks(job, "slurm", me=mine)[0] == {}
    assert list(stacks_probe.find_ranks(job, "slurm", me=dict(mine, SLURM_STEP_ID="7"))[0]) == [1]


def test_probe_takes_the_outermost_process_of_a_rank(fake_rank):
    job, p = fake_rank(rank=0, fork=True)
    _wait_until(lambda: len([d for d in os.listdir("/proc") if d.isdigit()
                             and (stacks_probe.read_proc(int(d)) or stacks_probe.Proc(0, 0, "", [], {})
                                  ).env.get("SLURM_JOB_ID") == job]) == 2)
    procs, _ = stacks_probe.find_ranks(job, "slurm", me={})
    assert procs[0].pid == p.pid


def test_probe_never_signals_a_rank_without_the_hook(fake_rank):
    job, p = fake_rank(rank=2, hook=False)
    with pytest.raises(stacks_probe.ProbeError, match="no stack dump hook"):
        stacks_probe.dump_signal(p.pid, time.monotonic() + 5)
    rec = stacks_probe.dump(stacks_probe.read_proc(p.pid), "signal", time.monotonic() + 5, None)
    assert rec["text"] is None and "install_signal_dump was not called" in rec["error"]
    time.sleep(0.2)
    assert p.poll() is None   # still alive: the stack signal was not sent


def test_probe_with_py_spy(fake_rank):
    pyspy = stacks_probe.find_pyspy()
    if pyspy is None:
        pytest.skip("py-spy is not installed")
    job, p = fake_rank(rank=5, hook=False)
    text = stacks_probe.dump_pyspy(p.pid, pyspy, time.monotonic() + 30)
    assert locate(main_thread(parse_stacks(text)).frames).startswith("in stuck_in_c at rank.py:")


def test_emit_and_read_back_interleaved_chunks(capsys):
    big = {"host": "n1", "ranks": [{"rank": 0, "text": "x" * 5000}], "notes": []}
    small = {"host": "n2", "ranks": [], "notes": ["hello"]}
    stacks_probe.emit(big, "n1:0")
    stacks_probe.emit(small, "n2:1")
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) < 1000 for line in lines)
    mixed = [lines[-1], "srun: noise"] + lines[:-1][::-1]
    results, problems = stacks_probe.read_emitted("\n".join(mixed))
    assert problems == [] and sorted(r["host"] for r in results) == ["n1", "n2"]
    assert next(r for r in results if r["host"] == "n1") == big
    results, problems = stacks_probe.read_emitted("\n".join(lines[1:]))
    assert len(results) == 1 and "incomplete" in problems[0]


# ------------------------------------------------------------------------------- the command

def test_stacks_command_refuses_lsf_jobs(cli, state_dir):
    from hpcring.schedulers.base import new_record
    new_record("4242", "lsf", "devcluster-lsf", "/srv/hpcring/jobs/4242", 4, "t", "t.py")
    r = cli("stacks", "4242")
    assert r.exit_code == 1
    assert "LSF job" in r.stderr and "supports Slurm and the local backend only" in r.stderr


def test_stacks_command_local_job_not_running(cli, state_dir, tmp_path):
    from hpcring.schedulers.base import new_record
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "7_local.json").write_text('{"state": "COMPLETED", "pid": 1}')
    new_record("7", "local", "local", str(tmp_path / "7"), 2, "t", "t.py")
    r = cli("stacks", "7")
    assert r.exit_code == 1 and "local job 7 is COMPLETED, not RUNNING" in r.stderr
