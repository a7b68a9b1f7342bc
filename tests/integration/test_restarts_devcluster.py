"""Restarts that avoid a bad node, end to end (hpcring.restarts; README "Restarts that avoid a bad node").

On the real dev cluster (3 nodes): a 2-node job whose rank 1 freezes (SIGSTOP, its node gone
silent) on the first attempt is diagnosed (rank unreachable), resubmitted with that rank's node
excluded (`#SBATCH --exclude=`), runs on the two other nodes, resumes from its checkpoint
(hpcring.requeue_count() > 0) and ends with the weights of an uninterrupted run; `hpcring status`
shows the chain. A code error (an exception on every rank) is not restarted. On the local backend
(no node to exclude): a frozen rank is restarted as is, and --max-restarts 0 restarts nothing.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "tests" / "restart_train.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_submit_devcluster import _cluster_up  # noqa: E402

needs_cluster = pytest.mark.skipif(not _cluster_up(), reason="dev cluster is not up (hpcring devcluster up)")


def run(site: str, base: Path, restarts: str | None, *script_args: str, nodes: int = 2, timeout_s: int = 8,
        env_extra=None):
    """`hpcring submit --wait` of restart_train.py; (rc, output, env, out dir)."""
    out = base / "out"
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(base / "state"),
               HPCRING_JOB_DIR=str(base / "jobs"), HPCRING_TIMEOUT=str(timeout_s), **(env_extra or {}))
    env.pop("HPCRING_MAX_RESTARTS", None)
    cmd = [sys.executable, "-m", "hpcring", "submit", str(TRAIN), "--site", site, "--nodes", str(nodes),
           "--tasks-per-node", "1", "--time", "5", "--wait",
           *(["--max-restarts", restarts] if restarts is not None else []), "--", str(out), *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                       timeout=420)
    (base / "submit.log").write_text(p.stdout + p.stderr)      # kept for a failure's post-mortem
    return p.returncode, p.stdout + p.stderr, env, out


def jobs_of(text: str) -> list[str]:
    return re.findall(r"Submitted job (\S+)", text)


def status(env, job: str) -> str:
    return subprocess.run([sys.executable, "-m", "hpcring", "status", job], env=env, capture_output=True,
                          text=True, timeout=60).stdout


def hosts(out: Path, attempt: int) -> dict[int, str]:
    return {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in out.glob(f"hosts-{attempt}-*")}


@pytest.mark.devcluster
@needs_cluster
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


@pytest.mark.devcluster
@needs_cluster
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


@pytest.mark.devcluster
@needs_cluster
def test_code_error_on_every_rank_is_not_restarted():
    base = Path("/srv/hpcring/pytest-restarts") / f"codeerr-{uuid.uuid4().hex[:8]}"
    rc, text, env, out = run("devcluster", base, "3", "--steps", "6", "--fail-step", "2")
    assert rc == 1, text[-3000:]
    assert len(jobs_of(text)) == 1, text[-3000:]
    assert "not restarted: code error: rank " in text and "ValueError: bad batch at step 2" in text, text[-3000:]
    st = status(env, jobs_of(text)[0])
    assert "-> not restarted (no node-level fault)" in st, st


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
