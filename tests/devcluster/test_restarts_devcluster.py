"""Restarts that avoid a bad node, end to end (hpcring.restarts; README "Restarts that avoid a bad node").

On the real dev cluster (3 nodes): a 2-node job whose rank 1 freezes (SIGSTOP, its node gone
silent) on the first attempt is diagnosed (rank unreachable), resubmitted with that rank's node
excluded (`#SBATCH --exclude=`), runs on the two other nodes, resumes from its checkpoint
(hpcring.requeue_count() > 0) and ends with the weights of an uninterrupted run; `hpcring status`
shows the chain. A code error (an exception on every rank) is not restarted. The local backend's
half: tests/integration/test_restarts_local.py.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

from helpers.restarts import jobs_of, run, status


ROOT = Path(__file__).resolve().parents[2]



def hosts(out: Path, attempt: int) -> dict[int, str]:
    return {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in out.glob(f"hosts-{attempt}-*")}


def test_frozen_rank_restarts_without_its_node_and_resumes():
    base = Path("/srv/hpcring/pytest-restarts") / f"frozen-{uuid.uuid4().hex[:8]}"
    rc, text, env, out = run("devcluster", base, "2", "--steps", "10", "--freeze-rank", "1", "--freeze-step", "3")
    assert rc == 0, text[-5000:]
    first, second = jobs_of(text)[:2]
    assert len(jobs_of(text)) == 2, text[-3000:]
    bad = hosts(out, 0)[1]                       # the frozen rank's node
    assert re.search(rf"rank 1 \({re.escape(bad)}\) unreachable", text), text[-3000:]
    assert f"restart 1 of at most 2 (excluding {bad})" in text, text[-3000:]
    again = hosts(out, 1)
    assert len(again) == 2 and bad not in again.values() and len(set(again.values())) == 2, again
    script = next((base / "jobs" / second).glob("*submission*.sh"), None) or next((base / "jobs").rglob(f"{second}*.sh"))
    assert f"#SBATCH --exclude={bad}\n" in script.read_text()
    res = json.loads((out / "result.json").read_text())
    assert res["w"] == res["expected"] and res["attempt"] == 1 and res["requeue_count"] == 1, res
    assert "start step=3 requeue_count=1" in text or "start step=4 requeue_count=1" in text, text[-3000:]
    for job in (first, second):                  # either attempt's status shows the whole chain
        st = status(env, job)
        assert f"attempt 0  job {first}  ended: FAILED: " in st and "unreachable  -> restarted as attempt 1" in st, st
        assert f"attempt 1  job {second}  excluding {bad}  ended: COMPLETED" in st, st


def test_lsf_frozen_rank_restarts_with_select_hname(tmp_path):
    """The LSF emulation (tests/lsf_emulation) places jobs on the dev cluster's nodes and honours
    select[hname!=...]: the restart runs on the two other hosts."""
    base = Path("/srv/hpcring/pytest-restarts") / f"lsf-{uuid.uuid4().hex[:8]}"
    emu = base / "emu"
    emu.mkdir(parents=True)
    rc, text, env, out = run("devcluster-lsf", base, "1", "--steps", "8", "--freeze-rank", "1",
                             env_extra={"PATH": f"{ROOT / 'tests' / 'lsf_emulation' / 'bin'}:{os.environ['PATH']}",
                                        "HPCRING_LSF_EMU_DIR": str(emu)})
    assert rc == 0, text[-5000:]
    bad = hosts(out, 0)[1]
    assert f"restart 1 of at most 1 (excluding {bad})" in text, text[-3000:]
    again = hosts(out, 1)
    assert len(again) == 2 and bad not in again.values(), again
    res = json.loads((out / "result.json").read_text())
    assert res["w"] == res["expected"] and res["requeue_count"] == 1, res


def test_an_lsf_restart_that_no_host_set_can_take_is_refused_not_left_pending(tmp_path):
    """A 3-host job on the emulation's 3 hosts: the restart that leaves the frozen rank's host out
    needs 3 hosts of 2. LSF would take it and keep it pending (sbatch refuses it at once): bhosts
    is asked first, and the follower says why and ends instead of waiting."""
    base = Path("/srv/hpcring/pytest-restarts") / f"lsf-nofit-{uuid.uuid4().hex[:8]}"
    emu = base / "emu"
    emu.mkdir(parents=True)
    rc, text, env, out = run("devcluster-lsf", base, "1", "--steps", "8", "--freeze-rank", "1", nodes=3,
                             env_extra={"PATH": f"{ROOT / 'tests' / 'lsf_emulation' / 'bin'}:{os.environ['PATH']}",
                                        "HPCRING_LSF_EMU_DIR": str(emu)})
    assert rc != 0, text[-3000:]
    assert len(jobs_of(text)) == 1, text[-3000:]
    bad = hosts(out, 0)[1]
    assert "bsub would take this job and never start it: it asks for 3 hosts" in text, text[-3000:]
    assert f"{bad} (excluded)" in text and "2 of the cluster's 3 hosts" in text, text[-3000:]
    assert [p.name for p in (emu / "jobs").iterdir()] == [jobs_of(text)[0]]     # nothing else reached bsub
    st = status(env, jobs_of(text)[0])
    assert "restart 1 refused: bsub would take this job and never start it" in st, st


def test_code_error_on_every_rank_is_not_restarted():
    base = Path("/srv/hpcring/pytest-restarts") / f"codeerr-{uuid.uuid4().hex[:8]}"
    rc, text, env, out = run("devcluster", base, "3", "--steps", "6", "--fail-step", "2")
    assert rc == 1, text[-3000:]
    assert len(jobs_of(text)) == 1, text[-3000:]
    assert "not restarted: code error: rank " in text and "ValueError: bad batch at step 2" in text, text[-3000:]
    st = status(env, jobs_of(text)[0])
    assert "-> not restarted (no node-level fault)" in st, st
