"""``hpcring top`` on a real local job: a 4-rank ``hpcring submit`` (ring) of
benchmarks/straggler_train.py whose rank 2 computes 3x as long, windows of 10 collectives. While it
runs, ``hpcring top JOB --once`` shows every rank and the verdict naming rank 2, and each rank's
Prometheus textfile (HPCRING_METRICS=textfile:DIR) is there and parses; once it has ended, ``top``
says it finished and points to ``hpcring report`` (``--once``: the last frame, marked final), and
the textfiles are gone.

Compute is a sleep (4 ranks on 2 busy cores do not fight for it); every wait is bounded by a
deadline, never a fixed sleep that a loaded machine could outrun."""
from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest

from helpers.jobs import job_id_of, local_env_for

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "benchmarks" / "straggler_train.py"
SLOW = 2


@pytest.fixture(scope="session")
def hpcring(hpcring):
    """The conftest runner with this file's 120 s bound."""
    return functools.partial(hpcring, timeout=120)


def rank_rows(stdout: str) -> dict[int, str]:
    """{rank: its row} of a plain frame (rows start with the rank number)."""
    rows = {}
    for line in stdout.splitlines()[1:]:
        first = line.split()[0] if line.split() else ""
        if first.isdigit():
            rows[int(first)] = line
    return rows


def figures(path: Path) -> dict:
    out: dict = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_top_shows_a_running_job_and_says_when_it_finished(hpcring, tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    env = local_env_for(tmp_path, OMP_NUM_THREADS="1", HPCRING_STRAGGLER_WINDOW="20", STEPS="300",
                        SLOW_RANK=str(SLOW), SLOW_FACTOR="3", WORK_MS="20", HPCRING_METRICS=f"textfile:{prom}")
    r = hpcring("submit", str(TRAIN), "--nodes", "1", "--tasks-per-node", "4", env=env)
    assert r.returncode == 0, r.stderr
    job = job_id_of(r)
    seen, files_seen, last, ended = None, False, None, False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (seen is None or not files_seen):
            last = hpcring("top", job, "--once", env=env)
            assert "Traceback" not in last.stderr, last.stderr
            if last.returncode == 1 and "has finished" in last.stderr:
                ended = True
                break
            rows = rank_rows(last.stdout)
            if last.returncode == 0 and sorted(rows) == [0, 1, 2, 3] and \
                    f"straggler: rank {SLOW} (local0)" in last.stdout:
                seen = last.stdout
            elif last.returncode != 0:        # before the first window: the reason, nothing else
                assert "has no live view yet" in last.stderr or "has not started yet" in last.stderr, last.stderr
            if not files_seen and all((prom / f"hpcring_rank{k}.prom").exists() for k in range(4)):
                got = [figures(prom / f"hpcring_rank{k}.prom") for k in range(4)]
                done = [sum(v for lab, v in g["hpcring_collectives_total"].items() if ("state", "done") in lab)
                        for g in got]
                assert all(d >= 0 for d in done) and ("job", job) in next(iter(got[0]["hpcring_collectives_total"]))
                files_seen = "hpcring_rank_lateness_ms" in got[0]
            time.sleep(0.3)
        assert seen is not None, f"no frame with every rank and the verdict (ended: {ended}):\n" \
                                 f"{last.stdout}\n{last.stderr}"
        assert files_seen, sorted(p.name for p in prom.iterdir())
        lines = seen.splitlines()
        assert lines[0].startswith(f"job {job} (straggler_train), RUNNING, 4 ranks, last op allreduce, window #")
        assert lines[1].startswith(f"straggler: rank {SLOW} (local0) arrived last in ")
        assert rank_rows(seen)[SLOW].endswith("<- straggler")
        assert all(not row.endswith("<- straggler") for k, row in rank_rows(seen).items() if k != SLOW)

        while time.monotonic() < deadline:          # its end
            last = hpcring("top", job, "--once", env=env)
            if last.returncode != 0 and "has finished" in last.stderr:
                ended = True
                break
            time.sleep(0.5)
        assert ended, last.stderr
    finally:
        if not ended:
            hpcring("cancel", job, env=env)
    assert f"job {job} has finished (COMPLETED): the frame above is its last" in last.stderr, last.stderr
    assert f"`hpcring report {job}`" in last.stderr
    assert last.stdout.startswith(f"FINAL (the job has ended): job {job} (straggler_train), COMPLETED, 4 ranks")
    assert sorted(rank_rows(last.stdout)) == [0, 1, 2, 3]
    live = hpcring("top", job, env=env)
    assert live.returncode == 1 and f"job {job} has finished (COMPLETED)" in live.stderr and live.stdout == ""
    assert "Traceback" not in live.stderr and f"hpcring report {job}" in live.stderr
    assert sorted(p.name for p in prom.iterdir()) == []          # each rank removed its file at exit
