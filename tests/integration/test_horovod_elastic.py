"""Horovod Elastic on hpcring, end to end: the elastic driver (python -m hpcring.elastic.driver)
starts real worker processes (tests/workers/horovod_elastic_worker.py: hpcring.torch, the ring over
loopback TCP and shared memory); a worker is SIGKILLed from here mid-epoch, or a new one started
from here joins. Nothing of hpcring is faked.

The final weights are checked exactly against :func:`simulate`, which replays the committed-state
semantics independently (Horovod's sampler partition, gradients summed over the ranks' batches,
SGD with momentum): the rounds' sizes and the positions they resumed from (read from the workers'
logs) determine them. Every number in the worker is an exact binary fraction, so equality is exact.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from helpers.elastic import (BATCH, COMMIT, EPOCHS, N, WORKER, counted_samples, kinds, logs_of,  # noqa: E402
                             rounds_of, simulate)
DEADLINE_S = 150          # a whole job, under load


class Job:
    def __init__(self, tmp: Path, mode: str, *driver_args: str, pace: float = 0.15, hold_at: int = -1,
                 env: dict | None = None) -> None:
        self.tmp, self.logs, self.info = tmp, tmp / "logs", tmp / "info.json"
        self.env = {**os.environ, "HPCRING_TIMEOUT": "60", "HPCRING_JOB_DIR": str(tmp), **(env or {})}
        self.env.pop("HPCRING_SECRET_FILE", None)
        self.worker_args = [sys.executable, WORKER, mode, str(self.logs), "--epochs", str(EPOCHS), "--n", str(N),
                            "--batch", str(BATCH), "--commit", str(COMMIT), "--pace", str(pace),
                            "--hold-at", str(hold_at)]
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcring.elastic.driver", *driver_args,
                                      "--info", str(self.info), "--", *self.worker_args], env=self.env, cwd=tmp,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.extra: list[subprocess.Popen] = []

    def records(self) -> dict[str, list[dict]]:
        out = {}
        for f in sorted(self.logs.glob("*.jsonl")):
            lines = f.read_text().splitlines()
            out[f.stem] = [json.loads(x) for x in lines if x.endswith("}")]
        return out

    def wait_for(self, what: str, pred, timeout: float = 90.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = pred(self.records())
            if got:
                return got
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        out, err = self.finish(5)
        raise AssertionError(f"never saw {what}:\n{out}\n{err}")

    def join(self, wid: str) -> subprocess.Popen:
        info = json.loads(self.info.read_text())
        p = subprocess.Popen(self.worker_args, env={**self.env, **info["env"], "HPCRING_ELASTIC_ID": wid}, cwd=self.tmp,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.extra.append(p)
        return p

    def finish(self, timeout: float = DEADLINE_S) -> tuple[str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for rs in self.records().values():       # every worker's stacks, through the driver's output
                try:
                    os.kill(rs[0]["pid"], signal.SIGUSR1)
                except (OSError, IndexError, KeyError):
                    pass
            time.sleep(2)
            self.proc.kill()
            out, err = self.proc.communicate()
            err += "\n[test: the driver did not end in time]"
        for p in self.extra:
            try:
                o, e = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                o, e = p.communicate()
            out, err = out + o, err + e
        return out, err


@pytest.fixture
def jobs():
    made: list[Job] = []
    yield made
    for j in made:                      # never leave a driver or worker behind
        for p in [j.proc, *j.extra]:
            if p.poll() is None:
                p.kill()
                p.communicate()


def check_shrunk(job: Job, victim: str, killed_at: float, how: str = "killed by signal 9", bound_s: float = 15.0) -> dict:
    out, err = job.finish()
    assert job.proc.returncode == 0, f"{out}\n{err}"
    assert f"worker {victim} lost ({how}" in err and "; a member of round 1)" in err, err
    recs = job.records()
    rounds = rounds_of(recs)
    assert [(r, o["size"]) for r, o in rounds.items()] == [(1, 3), (2, 2)], rounds
    old = rounds[1]["members"]
    survivors = [old[k] for k in sorted(old) if old[k] != victim]
    assert [rounds[2]["members"][k] for k in (0, 1)] == survivors, "survivors keep their order, oldest first"
    for wid in survivors:
        rs = recs[wid]
        assert len(kinds(rs, "restored", round=1)) == 1, "HorovodInternalError -> restore, once"
        assert [(r["round"], r["size"]) for r in kinds(rs, "reset_cb")] == [(2, 2)]
        assert kinds(rs, "final")[0]["w"] == simulate([(3, (0, 0)), (2, rounds[2]["pos"])])
    # the position resumed from is a commit of round 1 that the victim had started working past
    resumed = rounds[2]["pos"]
    assert resumed[0] < EPOCHS and (resumed[1] % (COMMIT * BATCH * 3) == 0)
    # ElasticSampler: within each epoch every sample once, none skipped, across the shrink
    for epoch, idx in counted_samples(recs, rounds).items():
        assert sorted(idx) == list(range(N)), f"epoch {epoch}: {sorted(idx)}"
    first = min(s["t"] for wid in survivors for s in kinds(recs[wid], "step", round=2))
    took = first - killed_at
    print(f"kill -> survivors' next step: {took:.2f} s (resumed from {resumed}, "
          f"rolled back to commit; driver stderr:\n{err})")
    assert took < bound_s
    return rounds


@pytest.mark.parametrize("victim_rank", [1, 0])
def test_rank_killed_mid_epoch_survivors_go_on_from_the_last_commit(tmp_path, jobs, victim_rank):
    job = Job(tmp_path, "train", "--np", "3", "--min-np", "2", "--max-np", "3")
    jobs.append(job)

    def victim_started(recs):
        for wid, rs in recs.items():
            steps = kinds(rs, "step", round=1, rank=victim_rank)
            if len(steps) >= 3:
                return wid, steps[0]["pid"]
        return None
    wid, pid = job.wait_for(f"round 1's rank {victim_rank} at its third step", victim_started)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    check_shrunk(job, wid, killed_at)


def test_a_frozen_worker_is_counted_dead_and_the_survivors_go_on(tmp_path, jobs):
    """SIGSTOP (a node stuck in the kernel, in swap, on a hung GPU): no exit, no broken connection;
    its heartbeat stops, the coordinator counts it dead after --dead-after and aborts the round's
    collectives; the driver ends the frozen process itself, so the job can end."""
    job = Job(tmp_path, "train", "--np", "3", "--min-np", "2", "--max-np", "3", "--dead-after", "4")
    jobs.append(job)
    wid, pid = job.wait_for("round 1's rank 1 at its third step", lambda recs: next(
        ((w, rs[0]["pid"]) for w, rs in recs.items() if len(kinds(rs, "step", round=1, rank=1)) >= 3), None))
    frozen_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    check_shrunk(job, wid, frozen_at, how="no heartbeat for", bound_s=4 + 15.0)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                          # the driver ended it


def test_worker_joining_later_receives_the_committed_state(tmp_path, jobs):
    # round 1 waits at its commit of step 4 (check_host_updates in a loop) until the newcomer asks
    job = Job(tmp_path, "train", "--np", "2", "--min-np", "2", "--max-np", "3", hold_at=4)
    jobs.append(job)
    job.wait_for("round 1 holding at step 4", lambda recs: any(kinds(rs, "holding") for rs in recs.values()))
    joiner = job.join("w9")
    out, err = job.finish()
    assert job.proc.returncode == 0 and joiner.returncode == 0, f"{out}\n{err}"
    assert "w9 waiting to join: asking round 1's members to reset at their next commit" in err, err
    recs = job.records()
    rounds = rounds_of(recs)
    assert [(r, o["size"]) for r, o in rounds.items()] == [(1, 2), (2, 3)], rounds
    assert rounds[2]["members"][2] == "w9" and set(rounds[2]["members"].values()) == {"w0", "w1", "w9"}
    assert [rounds[2]["members"][k] for k in (0, 1)] == [rounds[1]["members"][k] for k in (0, 1)]
    # HostsUpdatedInterrupt: no restore; the newcomer holds the committed state after the sync
    # (rounds_of checked that every rank of round 2 synced to the same position and weights)
    for wid in ("w0", "w1"):
        assert not kinds(recs[wid], "restored") and [r["size"] for r in kinds(recs[wid], "reset_cb")] == [3]
    assert kinds(recs["w9"], "synced")[0]["round"] == 2 and rounds[2]["pos"] == (0, 4 * BATCH * 2)
    asked = kinds(recs["w9"], "start")[0]["t"]
    first = min(s["t"] for rs in recs.values() for s in kinds(rs, "step", round=2))
    print(f"newcomer started -> first step of the 3-worker round: {first - asked:.2f} s")
    want = simulate([(2, (0, 0)), (3, rounds[2]["pos"])])
    for wid in ("w0", "w1", "w9"):
        assert kinds(recs[wid], "final")[0]["w"] == want


def test_fewer_than_min_np_left_ends_the_job_after_the_elastic_timeout(tmp_path, jobs):
    job = Job(tmp_path, "train", "--np", "2", "--min-np", "2", "--timeout", "20")
    jobs.append(job)
    wid, pid = job.wait_for("a step", lambda recs: next(((w, rs[0]["pid"]) for w, rs in recs.items()
                                                          if kinds(rs, "step", round=1, rank=1)), None))
    os.kill(pid, signal.SIGKILL)
    out, err = job.finish(60)
    assert job.proc.returncode == 1, f"{out}\n{err}"
    assert "fewer than min_np 2" in err and "ElasticJobError" in err, err


def test_contract_commit_restore_sync_host_updates_reset_callbacks_and_reset_limit(tmp_path, jobs):
    job = Job(tmp_path, "contract", "--np", "2", "--reset-limit", "2")
    jobs.append(job)
    out, err = job.finish()
    assert "OK contract 0" in out and "OK contract 1" in out, f"{out}\n{err}"
    # the reset limit ends the job: the workers caught it, the driver fails it
    assert job.proc.returncode == 1 and "reaches the reset limit 2" in err, err
    recs = job.records()
    for wid in ("w0", "w1"):
        assert [r["what"] for r in kinds(recs[wid], "ok")] == ["torchstate", "objectstate", "check_host_updates",
                                                              "reset_limit", "run"]


def test_serve_mode_workers_started_elsewhere_a_silent_one_counted_dead(tmp_path, jobs):
    """--serve: the driver starts no worker; two started from here with its variables train, one
    is SIGKILLed: not the driver's child, so the coordinator knows it only by its heartbeat
    stopping (--dead-after 4); the survivor goes on alone (min_np 1)."""
    job = Job(tmp_path, "train", "--serve", "--np", "2", "--min-np", "1", "--dead-after", "4")
    jobs.append(job)
    end = time.monotonic() + 60
    while not job.info.exists() and time.monotonic() < end:
        time.sleep(0.05)
    a, b = job.join("a"), job.join("b")
    wid, pid = job.wait_for("round 1 at step 3", lambda recs: next(
        ((w, rs[0]["pid"]) for w, rs in recs.items() if len(kinds(rs, "step", round=1, rank=1)) >= 3), None))
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    out, err = job.finish()
    assert job.proc.returncode == 0, f"{out}\n{err}"
    assert out.startswith("HPCRING_ELASTIC_STORE=127.0.0.1:"), out
    assert f"worker {wid} lost (no heartbeat for" in err, err
    recs = job.records()
    rounds = rounds_of(recs)
    assert [(r, o["size"]) for r, o in rounds.items()] == [(1, 2), (2, 1)], rounds
    survivor = rounds[2]["members"][0]
    assert kinds(recs[survivor], "final")[0]["w"] == simulate([(2, (0, 0)), (1, rounds[2]["pos"])])
    first = min(s["t"] for s in kinds(recs[survivor], "step", round=2))
    print(f"kill -> next step without the driver's knowledge (dead after 4 s): {first - killed_at:.2f} s")
    assert 3.0 <= first - killed_at < 25.0      # 4 s from its last beat, up to a beat before the kill


def test_the_example_goes_on_when_a_worker_is_killed(tmp_path, jobs):
    example = str(Path(__file__).resolve().parents[2] / "examples" / "train_horovod_elastic.py")
    env = {**os.environ, "HPCRING_TIMEOUT": "60"}
    env.pop("HPCRING_SECRET_FILE", None)
    p = subprocess.Popen([sys.executable, "-m", "hpcring.elastic.driver", "--np", "3", "--min-np", "2", "--", sys.executable,
                          example, "--epochs", "3", "--samples", "384", "--pace", "0.1"], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    killed = False
    deadline = threading.Timer(DEADLINE_S, p.kill)      # the reads below end when the driver does
    deadline.start()
    try:
        for line in p.stdout:
            lines.append(line)
            if not killed and "epoch 0: accuracy" in line:
                pid = next(int(x.split(" pid ")[1].split(":")[0]) for x in lines if "worker w2 pid" in x)
                os.kill(pid, signal.SIGKILL)
                killed = True
    finally:
        deadline.cancel()
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    text = "".join(lines)
    assert p.returncode == 0 and killed, text
    assert "reset: now 2 workers" in text and "epoch 2: accuracy" in text and "on 2 workers" in text, text


# ---------------------------------------------------------------------------------------------
# hpcring run --elastic (the same driver behind the CLI; its dev-cluster side, spare nodes, is in
# test_elastic_devcluster.py)
# ---------------------------------------------------------------------------------------------
def _run_cli(tmp: Path, *args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "HPCRING_TIMEOUT": "60", "HPCRING_JOB_DIR": str(tmp)}
    env.pop("HPCRING_SECRET_FILE", None)
    return subprocess.run([sys.executable, "-m", "hpcring", "run", *args], env=env, cwd=tmp, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_hpcring_run_elastic_goes_on_without_a_killed_worker(tmp_path):
    logs = tmp_path / "logs"
    r = _run_cli(tmp_path, "--elastic", "-N", "3", "--tasks-per-node", "1", "--min-nodes", "2", "--",
                 sys.executable, WORKER, "train", str(logs), "--epochs", str(EPOCHS), "--n", str(N), "--batch",
                 str(BATCH), "--commit", str(COMMIT), "--pace", "0.1", "--die", "w1:4")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "worker w1 lost (killed by signal 9; a member of round 1)" in r.stderr, r.stderr[-4000:]
    recs = logs_of(logs)
    assert kinds(recs["w1"], "dying")
    rounds = rounds_of(recs)
    assert [(k, o["size"]) for k, o in rounds.items()] == [(1, 3), (2, 2)], rounds
    for wid in set(rounds[2]["members"].values()):
        assert kinds(recs[wid], "final")[0]["w"] == simulate([(3, (0, 0)), (2, rounds[2]["pos"])])
    for epoch, idx in counted_samples(recs, rounds).items():
        assert sorted(idx) == list(range(N)), f"epoch {epoch}: {sorted(idx)}"


@pytest.mark.parametrize("args,words", [
    (("--elastic", "-N", "2", "--min-nodes", "3"), "--min-nodes 3 must be between 1 and --nodes (2)"),
    (("-N", "2", "--min-nodes", "1"), "--min-nodes and --reset-limit are options of --elastic"),
    (("--reset-limit", "2"), "--min-nodes and --reset-limit are options of --elastic"),
    (("--elastic", "--reset-limit", "-1"), "-1"),
    (("--elastic", "--min-nodes", "0"), "0"),
])
def test_hpcring_run_elastic_bad_options_start_nothing(tmp_path, args, words):
    r = _run_cli(tmp_path, *args, "--", sys.executable, "-c", "open('started', 'w')", timeout=60)
    assert r.returncode == 2 and words in " ".join(r.stderr.split()), r.stderr
    assert not (tmp_path / "started").exists() and not list(tmp_path.glob("hpcring-run-*"))
