"""Restarts on the local backend (no node to exclude): a frozen rank is restarted as is, and
--max-restarts 0 restarts nothing (the dev cluster's half: tests/devcluster/test_restarts_devcluster.py)."""
from __future__ import annotations

import json

from helpers.restarts import jobs_of, run, status


def test_local_frozen_rank_restarts_as_is_and_max_restarts_0_means_none(tmp_path):
    rc, text, env, out = run("local", tmp_path / "a", "1", "--steps", "6", "--freeze-rank", "1", timeout_s=5)
    assert rc == 0, text[-3000:]
    assert len(jobs_of(text)) == 2 and "no node to exclude: restarting as is" in text, text[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["w"] == res["expected"] and res["requeue_count"] == 1, res
    rc, text, env, out = run("local", tmp_path / "b", "0", "--steps", "6", "--freeze-rank", "1", timeout_s=5)
    assert rc == 1 and len(jobs_of(text)) == 1 and "node-level fault" not in text, text[-3000:]
    assert not (out / "result.json").exists()
    st = status(env, jobs_of(text)[0])       # status says what a restart would have done
    assert "node-level fault (allreduce#" in st and "not restarted (not followed with --max-restarts" in st, st
