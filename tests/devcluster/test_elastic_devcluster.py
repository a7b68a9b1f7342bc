"""``hpcring run --elastic`` inside a real Slurm allocation on the dev cluster: the first nodes run
the workers (one srun step each), the allocation's last node is a spare. A node's worker killed
(SIGKILL: its step ends as a lost node's does) is counted lost at once, a frozen one (SIGSTOP)
after its heartbeat's silence (and its step ended by the driver); the spare's step starts,
and its worker joins the running job with the committed state; the job ends COMPLETED with the
weights Horovod's semantics give for the rounds it ran, every sample of every epoch once."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


pytest.importorskip("torch")
from helpers.elastic import (BATCH, COMMIT, EPOCHS, N, WORKER, counted_samples, kinds, logs_of,  # noqa: E402
                             rounds_of, simulate)

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_node_is_replaced_by_the_spare_and_training_goes_on(how):
    """kill: node2's worker SIGKILLed (its step ends at once); stop: SIGSTOPped (a frozen node: its
    heartbeat stops, it counts dead after HPCRING_ELASTIC_DEAD_AFTER (4 s here) and the driver
    ends its step)."""
    logs = Path("/srv/hpcring") / f"elastic-{os.getpid()}-{time.monotonic_ns()}"     # seen by every node
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HPCRING_TIMEOUT": "60", "HPCRING_ELASTIC_DEAD_AFTER": "4"}
    env.pop("HPCRING_SECRET_FILE", None)
    try:
        r = subprocess.run(["salloc", "-N", "3", "--no-kill", "--time=5", PY, "-m", "hpcring", "run", "--site",
                            "devcluster", "--elastic", "-N", "2", "--tasks-per-node", "1", "--min-nodes", "1", "--",
                            PY, WORKER, "train", str(logs), "--epochs", str(EPOCHS), "--n", str(N), "--batch",
                            str(BATCH), "--commit", str(COMMIT), "--pace", "0.3", "--die", "node2:4", "--die-how", how],
                           capture_output=True, text=True, timeout=300, env=env, cwd="/srv/hpcring",
                           stdin=subprocess.DEVNULL)
        recs = logs_of(logs)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    err = r.stderr
    assert r.returncode == 0, err[-5000:]
    assert "node2's step" in err and "starting its workers on spare node node3" in err, err[-5000:]
    if how == "stop":
        assert "no heartbeat for" in err and "ending node2: counted dead" in err, err[-5000:]
    rounds = rounds_of(recs)
    sizes = [o["size"] for o in rounds.values()]
    assert sizes[0] == 2 and sizes[-1] == 2 and set(sizes[1:-1]) <= {1}, rounds     # 2, (1 while node3 starts), 2
    dying = [wid for wid, rs in recs.items() if kinds(rs, "dying")]
    assert len(dying) == 1 and dying[0] in rounds[1]["members"].values()
    last = rounds[max(rounds)]
    assert dying[0] not in last["members"].values()
    newcomer = [w for w in last["members"].values() if w not in rounds[1]["members"].values()]
    assert len(newcomer) == 1 and kinds(recs[newcomer[0]], "final"), "the spare's worker finished the job"
    schedule = [(o["size"], o["pos"]) for o in rounds.values()]
    for wid in last["members"].values():
        assert kinds(recs[wid], "final")[0]["w"] == simulate(schedule), "weights as Horovod's semantics give"
    for epoch, idx in counted_samples(recs, rounds).items():
        assert sorted(idx) == list(range(N)), f"epoch {epoch}: {sorted(idx)}"
    killed_at = kinds(recs[dying[0]], "dying")[0]["t"]
    survivors = [w for w in last["members"].values() if w != newcomer[0]]
    first = min(s["t"] for w in survivors for s in kinds(recs[w], "step") if s["round"] > 1)
    print(f"node2's worker {how} -> the survivor's next step: {first - killed_at:.2f} s; rounds "
          f"{[(k, o['size'], o['pos']) for k, o in rounds.items()]}")
    assert first - killed_at < (15.0 if how == "kill" else 4 + 15.0)
