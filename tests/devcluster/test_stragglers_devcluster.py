"""Straggler verdicts on the real dev cluster (3 nodes x 2 ranks, ring with shared memory and the
two-level allreduce): a rank computing 1.5x as long is named with its node; with node2's eth0
throttled by tc's tbf (its egress) and nobody slow, the link from node2 is named as a link, not a
rank; `hpcring report` shows the verdict. The job is benchmarks/straggler_train.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path



ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "benchmarks" / "straggler_train.py"



def submit(tag: str, **job_env):
    """`hpcring submit --wait` of the job on 3 nodes x 2 ranks; (rc, text, env, job folder's parent)."""
    base = Path("/srv/hpcring/pytest-stragglers") / f"{tag}-{uuid.uuid4().hex[:8]}"
    base.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(base / "state"),
               HPCRING_JOB_DIR=str(base / "jobs"), HPCRING_TIMEOUT="60", **job_env)
    cmd = [sys.executable, "-m", "hpcring", "submit", str(TRAIN), "--site", "devcluster", "--nodes", "3",
           "--tasks-per-node", "2", "--time", "5", "--wait"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                       timeout=400)
    (base / "submit.log").write_text(p.stdout + p.stderr)
    return p.returncode, p.stdout + p.stderr, env, base


def verdicts(base: Path) -> list[dict]:
    files = list((base / "jobs").glob("*/diag/stragglers.jsonl"))
    assert len(files) == 1, files
    return [json.loads(ln) for ln in files[0].read_text().splitlines()]


def tc(node: str, *words: str, check: bool = True):
    return subprocess.run([sys.executable, "-m", "hpcring", "devcluster", "exec", node, "--", "tc", *words],
                          capture_output=True, text=True, check=check, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))


def test_a_rank_computing_1_5x_as_long_is_named_with_its_node():
    rc, text, env, base = submit("slow", STEPS="160", SLOW_RANK="3", SLOW_FACTOR="1.5", WORK_MS="20")
    assert rc == 0, text[-3000:]
    named = [v for v in verdicts(base) if v["verdict"]]
    assert named and named[0]["verdict"]["kind"] == "rank" and named[0]["verdict"]["ranks"] == [3], named
    assert named[0]["verdict"]["host"] == "node2" and "straggler: rank 3 (node2) arrived last in " in named[0]["line"]
    job = re.findall(r"Submitted job (\S+)", text)[0]
    rep = subprocess.run([sys.executable, "-m", "hpcring", "report", job], capture_output=True, text=True,
                         env=env, timeout=120)
    assert rep.returncode == 0 and "straggler: rank 3 (node2)" in " ".join(rep.stdout.split()), rep.stdout + rep.stderr


def test_a_throttled_link_is_named_as_a_link_not_a_rank():
    tc("node2", "qdisc", "del", "dev", "eth0", "root", check=False)
    tc("node2", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "200mbit", "burst", "32kbit", "latency", "400ms")
    try:
        rc, text, env, base = submit("link", STEPS="80", WORK_MS="20", NBYTES=str(4 << 20))
    finally:
        tc("node2", "qdisc", "del", "dev", "eth0", "root", check=False)
    assert rc == 0, text[-3000:]
    named = [v["verdict"] for v in verdicts(base) if v["verdict"]]
    assert named and all(v["kind"] == "link" for v in named), named
    assert named[0]["host"].startswith("node2 -> ") and named[0]["ranks"][0] in (2, 3), named
