"""torch_watch's pure parts: Flight Recorder entries as flight records, the verdict, the env."""
from __future__ import annotations

import os
from datetime import timedelta

from hpcring.diagnostics import torch_watch as tw


def entry(seq, retired=True, op="gloo:all_reduce", sizes=((110,),), pg="0"):
    return {"collective_seq_id": seq, "profiling_name": op, "input_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"], "retired": retired, "timeout_ms": 4000, "time_created_ns": 10**18,
            "time_discovered_completed_ns": None, "process_group": (pg, "default_pg"), "is_p2p": False}


def test_entry_becomes_a_flight_record():
    rec = tw.to_record(entry(9, retired=False, sizes=((4, 5), (3,))))
    assert (rec["seq"], rec["op"], rec["backend"], rec["dtype"], rec["count"], rec["state"], rec["timeout"]) == \
        (9, "all_reduce", "gloo", "float32", 23, "started", 4.0)
    assert tw.to_record(entry(3))["state"] == "done"
    assert (tw.to_record(entry(3), 2.5)["timeout"], tw.to_record(entry(3), 2.5)["torch_timeout"]) == (2.5, 4.0)


def snap(rank, seqs, where, error=None, open_=None):
    recs = [tw.to_record(entry(s, retired=s != open_)) for s in seqs]
    return {"rank": rank, "records": recs, "last_done": max(seqs) - 1, "where": where, "error": error}


def test_a_silent_rank_is_dead_when_torch_saw_its_connection_closed():
    gone = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4: Connection reset by peer"
    snaps = {0: snap(0, [7, 8, 9], "raised RuntimeError in torch backward at t.py:48 (main)", gone, 9),
             2: snap(2, [7, 8], "in torch backward at t.py:48 (main)")}
    rep = tw.diagnose_torch(3, ["n1", "n2", "n3"], snaps, {}, {"rank": 0, "error": gone, "op": None})
    assert rep.categories["dead"] == [1] and not rep.categories["unreachable"]
    assert rep.categories["joined"] == [0, 2] and not rep.categories["missing"]   # rank 2 is on its way in
    assert rep.headline == "all_reduce#9: rank 1 (n2) died"


def test_a_silent_rank_without_a_reset_stays_unreachable_and_a_rank_elsewhere_is_missing():
    timeout = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv"
    snaps = {0: snap(0, [8, 9], "raised RuntimeError in torch backward at t.py:48 (main)", timeout, 9),
             2: snap(2, [7, 8], "in load_batch at t.py:24")}
    rep = tw.diagnose_torch(3, ["n1", "n2", "n3"], snaps, {}, {"rank": 0, "error": timeout})
    assert rep.categories["unreachable"] == [1] and rep.categories["missing"] == [2]
    assert "now in load_batch at t.py:24" in rep.details[2]


def test_torch_error_filter():
    assert tw.is_torch_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:1] Connection closed by peer"))
    assert not tw.is_torch_error(RuntimeError("CUDA out of memory"))
    assert not tw.is_torch_error(ValueError("gloo"))


def test_env_respects_what_the_user_set(monkeypatch, tmp_path):
    from hpcring import rank_life      # hpcring run's CMD: the torch variables and the rank site
    env = {"HPCRING_JOB_DIR": str(tmp_path), "PYTHONPATH": "/mine"}
    out = rank_life.child_env(env)
    assert out["TORCH_FR_BUFFER_SIZE"] == tw.FR_SIZE and out["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert out["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "0" / "diag" / "torch-fr-rank")   # job id "0"
    assert out["PYTHONPATH"] == rank_life.SITE_DIR + os.pathsep + "/mine"
    assert os.path.isfile(os.path.join(rank_life.SITE_DIR, "sitecustomize.py"))
    mine = rank_life.child_env({**env, "TORCH_NCCL_TRACE_BUFFER_SIZE": "5", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert "TORCH_FR_BUFFER_SIZE" not in mine and "TORCH_NCCL_DUMP_ON_TIMEOUT" not in mine
    assert rank_life.child_env({**env, "HPCRING_TORCH_WATCH": "0"}) == {}
    assert rank_life.child_env({**env, "HPCRING_TORCH_WATCH": "maybe"})["PYTHONPATH"].startswith(rank_life.SITE_DIR)


def test_process_group_timeout_follows_the_deadline(monkeypatch):
    monkeypatch.setenv("HPCRING_TIMEOUT", "7")
    monkeypatch.setenv("HPCRING_DIAG_GRACE", "2")
    assert tw.pg_timeout("gloo") == timedelta(seconds=7)
    assert tw.pg_timeout("nccl") == timedelta(seconds=7 + 2 + tw.NCCL_MARGIN)   # after hpcring's report


def test_site_hook_wraps_init_process_group_and_runs_the_sitecustomize_it_shadows(tmp_path):
    import subprocess
    import sys

    import pytest
    pytest.importorskip("torch")
    from hpcring.rank_life import child_env
    (tmp_path / "sitecustomize.py").write_text("print('SHADOWED SITECUSTOMIZE RAN')\n")
    code = ("import torch.distributed as dist\n"
            "from torch.distributed import init_process_group\n"
            "print(getattr(dist.init_process_group, '_hpcring', False), getattr(init_process_group, '_hpcring', False))\n")
    env = {**os.environ, **child_env({"HPCRING_JOB_DIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}),
           "HPCRING_SESSION": "{}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["SHADOWED SITECUSTOMIZE RAN", "True True"]
    env.pop("HPCRING_SESSION")                     # not inside hpcring run: nothing is wrapped
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["SHADOWED SITECUSTOMIZE RAN", "False False"]


def test_hpcring_backend_is_left_alone():
    assert tw._only_hpcring("hpcring") and tw._only_hpcring("cpu:hpcring,cuda:hpcring")
    assert not tw._only_hpcring("cpu:gloo,cuda:hpcring") and not tw._only_hpcring(None)
    assert not tw._only_hpcring("gloo")
