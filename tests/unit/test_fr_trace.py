"""hpcring's flight records in torch's Flight Recorder format (hpcring.diagnostics.fr_trace): the
mapping of a record to an entry, checked against what torch's own analyzer (torchfrtrace, in the
installed torch) reads; three "ranks" in one process whose dumps torchfrtrace reads and agrees on
with hpcring's report; a folder that is missing or corrupt; a rank that raised writes its dump."""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from hpcring.collectives.recorder import FlightRecorder
from hpcring.diagnostics import fr_trace
from hpcring.diagnostics.report import diagnose

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["nodeA", "nodeB", "nodeC"]


def _torch_fr():
    """torch's Flight Recorder analyzer package, or skip."""
    return pytest.importorskip("torch.distributed.flight_recorder.components.types")


def _recorder(rank: int, size: int = 3, ops=(), capacity: int = 64, backend: str = "ring", group=None):
    """A recorder with ``ops``: (op, dtype, count, root, end) each; end "done", "failed" or None (in flight)."""
    rec = FlightRecorder(rank, size, backend, capacity=capacity, **(group or {}))
    for op, dtype, count, root, end in ops:
        r = rec.queue(op, dtype, count, root, 5.0)
        FlightRecorder.start(r)
        if end == "done":
            FlightRecorder.finish(r)
        elif end == "failed":
            FlightRecorder.finish(r, "recv from rank 1 (nodeB) timed out after 5.0 s, 0/4096 bytes done")
    return rec


def _comm(rec):
    return types.SimpleNamespace(recorder=rec)


def _entry(op, dtype="float32", count=4096, root=None, end="done", size=3, rank=0):
    rec = _recorder(rank, size, [(op, dtype, count, root, end)])
    return fr_trace.to_entry(rec.records()[0], 0, ("0", "default_pg"), 0, size, rank, "ring")


# -- the mapping ------------------------------------------------------------------------------
def test_every_key_torchfrtrace_reads_of_an_entry_is_written():
    mod = _torch_fr()
    src = "".join(p.read_text() for p in Path(mod.__file__).parent.glob("*.py"))
    read = set(re.findall(r'\b(?:entry|event|e|current_entry)\["([a-z0-9_]+)"\]', src))
    assert {"record_id", "process_group", "profiling_name", "state", "is_p2p"} <= read   # the pattern still finds them
    assert read <= set(fr_trace.ENTRY_KEYS), read - set(fr_trace.ENTRY_KEYS)
    for op in fr_trace.OPS:
        e = _entry(op)
        assert set(fr_trace.ENTRY_KEYS) <= set(e), (op, set(fr_trace.ENTRY_KEYS) - set(e))
    dump = fr_trace.rank_dump([_comm(_recorder(0, ops=[("allreduce", "float32", 8, None, "done")]))], 0)
    assert set(fr_trace.DUMP_KEYS) <= set(dump) and dump["version"] == fr_trace.VERSION


def test_torch_parses_every_mapped_op_and_matches_it_with_itself():
    types_ = _torch_fr()
    members = {"0": {0, 1, 2}}
    for op in fr_trace.OPS:
        e = _entry(op)
        parsed = types_.Op(e, members, "0")               # raises on a name or op type it does not know
        assert parsed.type in types_.COLLECTIVES
        assert parsed.match(types_.Op(dict(e), members, "0")).state in (types_.MatchState.FULLY_MATCHED,
                                                                          types_.MatchState.UNDECIDED), op


def test_sizes_dtypes_and_names_per_op():
    e = _entry("allreduce", count=65536)
    assert e["profiling_name"] == "gloo:all_reduce" and e["collective_seq_id"] == 1
    assert e["input_sizes"] == e["output_sizes"] == [[65536]] and e["input_dtypes"] == e["output_dtypes"] == ["Float"]
    assert _entry("allgather", count=10)["output_sizes"] == [[3, 10]]            # size x input, as torch's check
    assert _entry("reduce_scatter", count=12)["output_sizes"] == [[4]]
    uneven = _entry("reduce_scatter", count=10)                                 # shares 4, 3, 3 on 3 ranks
    assert uneven["profiling_name"].endswith(":reduce_scatter_v") and uneven["output_sizes"] == [[4], [3], [3]]
    barrier = _entry("barrier", dtype=None, count=0)
    assert barrier["input_sizes"] == barrier["input_dtypes"] == [] and barrier["profiling_name"] == "gloo:barrier"
    assert _entry("allreduce_grouped", dtype="float32+float64")["input_dtypes"] == ["Float", "Double"]
    assert _entry("broadcast", root=2)["hpcring"]["root"] == 2
    assert _entry("alltoall", dtype="bfloat16")["input_dtypes"] == ["BFloat16"]
    rec = _recorder(0, backend="nccl", ops=[("allreduce", "float16", 8, None, "done")])
    assert fr_trace.to_entry(rec.records()[0], 0, ("0", "d"), 0, 3, 0, "nccl")["profiling_name"] == "nccl:all_reduce"
    assert fr_trace.to_entry({"op": "p2p", "seq": 1}, 0, ("0", "d"), 0, 3, 0, "ring") is None   # no torch type


def test_states_times_and_frames():
    done, failed, live = _entry("allreduce"), _entry("allreduce", end="failed"), _entry("allreduce", end=None)
    assert (done["state"], done["retired"]) == ("completed", True) and done["time_discovered_completed_ns"]
    assert (failed["state"], failed["retired"]) == ("started", False)          # torch has no failed state
    assert failed["hpcring"]["state"] == "failed" and "timed out" in failed["hpcring"]["error"]
    assert failed["time_discovered_completed_ns"] is None and failed["hpcring"]["time_ended_ns"]
    assert (live["state"], live["time_discovered_started_ns"] > 0) == ("started", True)
    queued = FlightRecorder(0, 3, "ring", capacity=16).queue("allreduce", "float32", 4, None, 2.5)
    q = fr_trace.to_entry(queued, 0, ("0", "d"), 0, 3, 0, "ring")
    assert q["state"] == "scheduled" and q["time_discovered_started_ns"] is None and q["timeout_ms"] == 2500
    frame = done["frames"][0]                                                  # the user's call site, full path
    assert frame["filename"] == __file__ and frame["name"] == "_recorder" and frame["line"] > 0
    assert fr_trace._frames("train.py:88 in step") == [{"name": "step", "filename": "train.py", "line": 88}]
    assert fr_trace._frames("?") == [] and fr_trace._frames(None) == []


def test_process_groups_and_record_ids_line_up_when_the_ring_wrapped():
    ops = [("allreduce", "float32", 4, None, "done")] * 40
    world = _recorder(1, ops=ops, capacity=16)
    group = _recorder(0, size=2, ops=ops[:2], group={"group": "group 1 of ranks 1-2", "members": (1, 2)})
    dump = fr_trace.rank_dump([_comm(world), _comm(group)], 1, host="nodeB", reason="test")
    assert dump["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"},
                                 "group 1 of ranks 1-2": {"name": "group 1 of ranks 1-2", "desc": "undefined",
                                                          "ranks": "[1, 2]"}}
    assert dump["pg_status"]["0"] == {"last_enqueued_collective": 40, "last_started_collective": 40,
                                      "last_completed_collective": 40}
    seqs = [e["collective_seq_id"] for e in dump["entries"] if e["process_group"][0] == "0"]
    assert seqs == list(range(25, 41))                    # the ring kept the newest 16
    ids = [e["record_id"] for e in dump["entries"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and ids[-1] == 41   # 42 collectives, ids 0..41
    assert dump["hpcring"]["rank"] == 1 and dump["hpcring"]["host"] == "nodeB"


# -- torchfrtrace and hpcring's report agree ------------------------------------------------------
def _three_ranks(tmp_path, fault: str):
    """Three ranks' recorders after 3 good allreduces and a fault at #4 on rank 1; their dumps in
    ``tmp_path/fr-trace`` and hpcring's report from the same records."""
    good = [("allreduce", "float32", 4096, None, "done")] * 3
    fourth = {0: ("allreduce", "float32", 4096, None, "failed"), 2: ("allreduce", "float32", 4096, None, None)}
    if fault == "mismatch":
        fourth[1] = ("allreduce", "float32", 2048, None, None)
    recs = {r: _recorder(r, ops=good + ([fourth[r]] if r in fourth else [])) for r in range(3)}
    folder = tmp_path / "fr-trace"
    for r, rec in recs.items():
        fr_trace.write(folder, r, [_comm(rec)], host=HOSTS[r])
    snaps = {r: {"rank": r, "records": [x.to_dict() for x in rec.records()], "last_done": rec.last_done(),
                 "where": "in load_batch at train.py:9" if r == 1 and fault == "skip" else "in allreduce at train.py:5"}
             for r, rec in recs.items()}
    report = diagnose(3, HOSTS, snaps, trigger={"rank": 0, "error": "timed out", "op": snaps[0]["records"][-1]})
    return folder, report


def _torchfrtrace(*args) -> subprocess.CompletedProcess:
    _torch_fr()
    return subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_torchfrtrace_names_the_rank_that_never_joined_as_the_report_does(tmp_path):
    folder, report = _three_ranks(tmp_path, "skip")
    assert report.categories["missing"] == [1] and report.op["seq"] == 4 and report.op["op"] == "allreduce"
    p = _torchfrtrace(folder)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "Not all ranks joining collective, sequence number: 4" in out
    assert "missing ranks: {1}" in out and "collective: gloo:all_reduce" in out
    assert f"at {__file__}" in out                                               # the call site as a frame


def test_torchfrtrace_finds_the_size_mismatch_the_report_names(tmp_path):
    folder, report = _three_ranks(tmp_path, "mismatch")
    assert report.categories["mismatch"] == [1] and report.op["seq"] == 4
    out = "".join(_torchfrtrace(folder).__dict__[k] for k in ("stdout", "stderr"))
    assert "Collective sequence number: 4 has errors" in out, out
    # torchfrtrace measures every rank against the first file it happens to read (its own caveat in
    # utils.check_current_entry_match): rank 1 is named, or ranks 0 and 2 are, measured against it
    culprits = set(map(int, re.findall(r"Culprit rank (\d+); Error type: SIZE_OR_SYNTAX_MISMATCH", out)))
    assert culprits in ({1}, {0, 2}), out
    assert "'[[2048]]'" in out and "'[[4096]]'" in out


# -- bad input: hpcring's reader and its command ---------------------------------------------------
def test_reader_messages_for_a_missing_empty_or_corrupt_folder(tmp_path):
    with pytest.raises(fr_trace.FrTraceError, match="no such folder") as e:
        fr_trace.read_dir(tmp_path / "nope")
    assert "diag/fr-trace" in e.value.hint
    (tmp_path / "file").write_text("x")
    with pytest.raises(fr_trace.FrTraceError, match="not a folder"):
        fr_trace.read_dir(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(fr_trace.FrTraceError, match="no Flight Recorder dumps"):
        fr_trace.read_dir(tmp_path / "empty")
    folder, _ = _three_ranks(tmp_path, "skip")
    assert fr_trace.read_dir(tmp_path)[0] == folder                  # a job folder's fr-trace is found
    good = (folder / "fr_trace_rank_2").read_bytes()
    cases = {b"": "empty file", good[:50]: "pickle data was truncated", b"not a pickle": "not a Flight Recorder dump",
             pickle.dumps({"entries": []}): "needs version, pg_config, entries",
             pickle.dumps({"version": "2.10", "pg_config": {}, "entries": [{"record_id": 0}]}): "entry 0 lacks",
             pickle.dumps(types.SimpleNamespace(a=1)): "refers to types.SimpleNamespace"}
    for data, why in cases.items():
        (folder / "fr_trace_rank_2").write_bytes(data)
        with pytest.raises(fr_trace.FrTraceError, match=re.escape(why)) as e:
            fr_trace.read_dir(folder)
        assert "fr_trace_rank_2" in str(e.value)
    (folder / "fr_trace_rank_2").write_bytes(good)
    (folder / "fr_trace_rank_x").write_bytes(good)
    with pytest.raises(fr_trace.FrTraceError, match="reads the rank from the name"):
        fr_trace.read_dir(folder)
    (folder / "fr_trace_rank_x").unlink()
    (folder / "fr_trace_rank_2").unlink()
    assert fr_trace.read_dir(folder)[2] == [2]                        # rank 2 left no dump


def test_the_command_checks_first_then_runs_torchfrtrace(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "hpcring.diagnostics.fr_trace", *map(str, args)], env=env,
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout + p.stderr
    code, out = run(tmp_path / "nope")
    assert code == 1 and "hpcring: " in out and "no such folder" in out and "Traceback" not in out
    folder, _ = _three_ranks(tmp_path, "skip")
    (folder / "fr_trace_rank_1").write_bytes(b"\x80\x04garbage")
    code, out = run(tmp_path)
    assert code == 1 and "fr_trace_rank_1: not a Flight Recorder dump" in out and "Traceback" not in out
    (folder / "fr_trace_rank_1").unlink()                              # rank 1 died before writing one
    code, out = run(tmp_path)
    assert code == 0, out
    assert "no dump from ranks 1" in out and "--allow-incomplete-ranks" in out
    assert "missed FR dumps from ranks ({1})" in out                  # torchfrtrace's own words


# -- the watchdog writes it, and a rank that raised writes its own ---------------------------------
@pytest.fixture
def job(tmp_path, monkeypatch):
    from hpcring.bootstrap.store_server import StoreServer
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRING_JOB_ID", "78")
    with StoreServer("127.0.0.1", 0, secret=b"f" * 32) as srv:
        yield types.SimpleNamespace(port=srv.port, diag=tmp_path / "78" / "diag")


def _dog(job, rank):
    from hpcring.diagnostics.watchdog import Watchdog
    topo = types.SimpleNamespace(rank=rank, size=3, host=HOSTS[rank], hosts=tuple(HOSTS), interface="eth0")
    return Watchdog(topo, ("127.0.0.1", job.port), b"f" * 32, grace=2.0, abort=False)


def _user_code_raises():
    raise ValueError("bad batch 7")


def test_a_rank_that_raised_writes_its_dump_and_the_report_names_it(job, monkeypatch):
    from hpcring.errors import CollectiveError
    good = [("allreduce", "float32", 1024, None, "done")] * 3
    dogs = [_dog(job, r).start() for r in range(3)]
    comms = [_comm(_recorder(r, ops=good + ([("allreduce", "float32", 1024, None, None)] if r != 1 else [])))
             for r in range(3)]
    for d, c in zip(dogs, comms):
        d.register(c)
    try:
        _user_code_raises()
    except ValueError as exc:                   # what the rank entry does with the script's exception
        from hpcring import session
        from hpcring.diagnostics import torch_watch
        monkeypatch.setattr(session, "_SESSION", types.SimpleNamespace(watchdog=dogs[1]))
        torch_watch.on_error(exc)               # not a torch error: this rank's end, noted by its watchdog
    assert (job.diag / "flight-rank1.json").exists() and (job.diag / "fr-trace" / "fr_trace_rank_1").exists()
    dogs[1]._on_exit()                          # ... then the interpreter exits
    stuck = comms[0].recorder.records()[-1]
    dogs[0].on_failure(comms[0], stuck, CollectiveError("allreduce#4: rank 1 (nodeB) closed the connection"))
    rep = dogs[0].report
    assert rep.categories["exited"] == [1]
    assert rep.headline == "allreduce#4: rank 1 (nodeB) raised ValueError and exited without joining it"
    assert rep.details[1].startswith("raised ValueError: bad batch 7 in _user_code_raises at test_fr_trace.py:")
    assert rep.where[1].startswith("raised ValueError in _user_code_raises at test_fr_trace.py:")
    for d in dogs:
        d.close()
    _, dumps, missing = fr_trace.read_dir(job.diag)
    assert missing == [] and sorted(dumps) == [0, 1, 2]
    assert "raised ValueError" in dumps[1]["hpcring"]["reason"]
    assert [e["collective_seq_id"] for e in dumps[1]["entries"]] == [1, 2, 3]


def test_an_uncaught_exception_is_found_at_exit_and_the_dump_is_bounded(job, monkeypatch):
    from hpcring.diagnostics.watchdog import dumps
    dog = _dog(job, 2).start()
    dog.register(_comm(_recorder(2, ops=[("allreduce", "float32", 8, None, "done")])))
    try:
        _user_code_raises()
    except ValueError as exc:
        monkeypatch.setattr(sys, "last_value", exc, raising=False)   # as the interpreter leaves it
    stuck = threading.Event()
    monkeypatch.setattr(dog, "dump", lambda reason: stuck.wait(60))  # a file system that hangs
    monkeypatch.setattr(dumps, "EXIT_DUMP_S", 0.3)
    t0 = time.monotonic()
    dog._on_exit()
    assert time.monotonic() - t0 < 5.0                                # the exit is not held by the dump
    stuck.set()
    assert dog._raised["error"] == "ValueError: bad batch 7"
    dog.close()


def test_fr_trace_off(job, monkeypatch):
    monkeypatch.setenv("HPCRING_FR_TRACE", "0")
    dog = _dog(job, 0)
    dog.register(_comm(_recorder(0, ops=[("allreduce", "float32", 8, None, "done")])))
    assert dog.dump("test") is not None
    assert (job.diag / "flight-rank0.json").exists() and not (job.diag / "fr-trace").exists()


def test_torchs_own_dump_is_kept_and_hpcrings_groups_go_beside_it():
    torch_entry = {**_entry("allreduce"), "process_group": ("0", "default_pg"), "record_id": 0}
    own = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
           "pg_status": {}, "entries": [torch_entry]}
    torch_comm = types.SimpleNamespace(recorder=types.SimpleNamespace(fr_trace_dump=lambda: own))
    ours = _comm(_recorder(0, ops=[("barrier", None, 0, None, "done")]))
    dump = fr_trace.rank_dump([torch_comm, ours], 0)
    assert sorted(dump["pg_config"]) == ["0", "hpcring:0"]
    assert [(e["process_group"][0], e["record_id"]) for e in dump["entries"]] == [("0", 0), ("hpcring:0", 1)]
