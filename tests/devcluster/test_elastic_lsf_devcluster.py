"""``hpcring run --elastic`` inside an LSF job (the LSF emulation, tests/lsf_emulation, on the dev
cluster's nodes): the job's first hosts run the workers (one ``blaunch -z HOST`` each), its last
host is a spare. A node's worker killed (its blaunch ends) is counted lost at once, a frozen one
(SIGSTOP) after its heartbeat's silence (the driver then ends its blaunch); the spare's blaunch
starts and its worker joins with the committed state; the job ends DONE with the weights Horovod's
semantics give for the rounds it ran, every sample of every epoch once. Without a spare,
--min-nodes lets the job go on smaller; bad options are refused (exit 2) before any blaunch."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")
from helpers.elastic import (BATCH, COMMIT, EPOCHS, N, WORKER, counted_samples, kinds, logs_of,  # noqa: E402
                             rounds_of, simulate)

ROOT = Path(__file__).resolve().parents[2]
EMU_BIN = ROOT / "tests" / "lsf_emulation" / "bin"
SHARED = Path("/srv/hpcring")
PY = sys.executable
DIE_SECOND = '"$(sed -n 2p "$LSB_DJOB_HOSTFILE"):4"'      # the job's second host's worker, at step 4


@pytest.fixture
def base():
    """A folder every node sees: the emulation's state, the job script, its output, the workers' logs."""
    d = SHARED / "pytest-elastic-lsf" / uuid.uuid4().hex[:10]
    (d / "emu").mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _env(base: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PATH": f"{EMU_BIN}:{os.environ['PATH']}",
           "HPCRING_LSF_EMU_DIR": str(base / "emu"), "HPCRING_STATE_DIR": str(base / "state"),
           "HPCRING_TIMEOUT": "60", "HPCRING_ELASTIC_DEAD_AFTER": "4"}
    env.pop("HPCRING_SECRET_FILE", None)
    return env


def bsub_job(base: Path, hosts: int, body: str, timeout: float = 240) -> tuple[str, str]:
    """Submit a job of ``hosts`` hosts x 1 slot running ``body`` (bash, in /srv/hpcring), wait for
    its end; (its LSF state, its output)."""
    out = base / "job.out"
    script = base / "job.sh"
    script.write_text(f"#!/bin/bash\n#BSUB -n {hosts}\n#BSUB -R \"span[ptile=1]\"\n#BSUB -W 5\n#BSUB -oo {out}\n"
                      f"cd {SHARED}\n{body}\n")
    env = _env(base)
    r = subprocess.run(["/bin/sh", "-c", 'exec bsub < "$1"', "bsub", str(script)], capture_output=True, text=True,
                       env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    jid = r.stdout.split("<")[1].split(">")[0]
    deadline = time.monotonic() + timeout
    stat = ""
    while time.monotonic() < deadline:
        b = subprocess.run(["bjobs", "-o", "stat", "-noheader", jid], capture_output=True, text=True, env=env,
                           timeout=30, stdin=subprocess.DEVNULL)
        stat = b.stdout.strip()
        if stat in ("DONE", "EXIT") and out.is_file():
            return stat, out.read_text(errors="replace")
        time.sleep(0.5)
    subprocess.run(["bkill", jid], env=env, timeout=30, capture_output=True)
    pytest.fail(f"LSF job {jid} did not end within {timeout:.0f} s (state {stat})")


def elastic_line(logs: Path, nodes: int, min_nodes: int, die: str, how: str) -> str:
    """``hpcring run --elastic`` of the Horovod elastic worker; ``die``: a shell word (the host is
    read from the job's host file)."""
    worker = [PY, WORKER, "train", str(logs), "--epochs", str(EPOCHS), "--n", str(N), "--batch", str(BATCH),
              "--commit", str(COMMIT), "--pace", "0.3", "--die-how", how]
    run = [PY, "-m", "hpcring", "run", "--site", "devcluster-lsf", "--elastic", "-N", str(nodes),
           "--tasks-per-node", "1", "--min-nodes", str(min_nodes), "--"]
    return f"{shlex.join(run + worker)} --die {die}"


def job_hosts(text: str) -> list[str]:
    return next(line.split()[1:] for line in text.splitlines() if line.startswith("HOSTS "))


def check_training(recs: dict, sizes_after: set[int], last_size: int) -> tuple[dict, str]:
    """The rounds agree with Horovod's semantics; (rounds, the worker that died)."""
    rounds = rounds_of(recs)
    sizes = [o["size"] for o in rounds.values()]
    assert sizes[0] == 2 and sizes[-1] == last_size and set(sizes[1:-1]) <= sizes_after, rounds
    dying = [wid for wid, rs in recs.items() if kinds(rs, "dying")]
    assert len(dying) == 1 and dying[0] in rounds[1]["members"].values()
    last = rounds[max(rounds)]
    assert dying[0] not in last["members"].values()
    schedule = [(o["size"], o["pos"]) for o in rounds.values()]
    for wid in last["members"].values():
        assert kinds(recs[wid], "final")[0]["w"] == simulate(schedule), "weights as Horovod's semantics give"
    for epoch, idx in counted_samples(recs, rounds).items():
        assert sorted(idx) == list(range(N)), f"epoch {epoch}: {sorted(idx)}"
    return rounds, dying[0]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_node_is_replaced_by_the_spare_and_training_goes_on(base, how):
    """kill: the second host's worker SIGKILLed (its blaunch ends at once); stop: SIGSTOPped (counted
    dead after HPCRING_ELASTIC_DEAD_AFTER, 4 s here, and its blaunch ended by the driver)."""
    logs = base / "logs"
    body = (f'echo HOSTS $(cat "$LSB_DJOB_HOSTFILE")\n'
            f'exec {elastic_line(logs, 2, 1, DIE_SECOND, how)}')
    stat, text = bsub_job(base, 3, body)
    recs = logs_of(logs)
    assert stat == "DONE", text[-5000:]
    first, second, spare = job_hosts(text)
    assert f"{second}'s step" in text and f"starting its workers on spare node {spare}" in text, text[-5000:]
    if how == "stop":
        assert "no heartbeat for" in text and f"ending {second}: counted dead" in text, text[-5000:]
        # the driver's SIGTERM went through blaunch to the frozen (continued) worker: it ended at once
        assert f"{second}'s step exited with code 143" in text, text[-5000:]
    rounds, dead = check_training(recs, {1}, 2)
    last = rounds[max(rounds)]
    newcomer = [w for w in last["members"].values() if w not in rounds[1]["members"].values()]
    assert len(newcomer) == 1 and kinds(recs[newcomer[0]], "final"), "the spare's worker finished the job"
    killed_at = kinds(recs[dead], "dying")[0]["t"]
    survivors = [w for w in last["members"].values() if w != newcomer[0]]
    nxt = min(s["t"] for w in survivors for s in kinds(recs[w], "step") if s["round"] > 1)
    print(f"LSF: {second}'s worker {how} -> the survivor's next step: {nxt - killed_at:.2f} s; rounds "
          f"{[(k, o['size'], o['pos']) for k, o in rounds.items()]}")
    assert nxt - killed_at < (15.0 if how == "kill" else 4 + 15.0)


def test_without_a_spare_min_nodes_lets_the_job_go_on_smaller(base):
    """Two hosts, both working: the second's worker killed, no spare: with --min-nodes 1 the
    survivor trains on alone to the end (weights as Horovod's semantics give for 2 then 1 worker)."""
    logs = base / "logs"
    body = (f'echo HOSTS $(cat "$LSB_DJOB_HOSTFILE")\n'
            f'exec {elastic_line(logs, 2, 1, DIE_SECOND, "kill")}')
    stat, text = bsub_job(base, 2, body)
    assert stat == "DONE", text[-5000:]
    _, second = job_hosts(text)
    assert f"{second}'s step" in text and "no spare node left: going on with the others" in text, text[-5000:]
    rounds, _ = check_training(logs_of(logs), {1}, 1)
    assert len(rounds[max(rounds)]["members"]) == 1


def test_bad_options_are_refused_before_any_blaunch(base):
    """Inside a 2-host LSF job: more nodes than hosts, --min-nodes above --nodes, a container, a
    negative --reset-limit: each exits 2 with what is wrong, and no worker starts."""
    logs = base / "logs"
    boxed = base / "lsf-apptainer.yaml"       # the LSF site with a container runtime
    boxed.write_text((ROOT / "site_configs" / "devcluster-lsf.yaml").read_text()
                     + "container:\n  runtime: apptainer\n  image: /nonexistent/train.sif\n")
    run = shlex.join([PY, "-m", "hpcring", "run", "--elastic"])
    worker = shlex.join([PY, WORKER, "train", str(logs), "--epochs", "1", "--n", str(N)])
    lsf = "--site devcluster-lsf"
    cases = {"nodes": f"{lsf} -N 3 --tasks-per-node 1 -- {worker}",
             "min": f"{lsf} -N 2 --min-nodes 3 --tasks-per-node 1 -- {worker}",
             "container": f"--site {boxed} -N 2 --tasks-per-node 1 -- {worker}",
             "reset": f"{lsf} -N 2 --tasks-per-node 1 --reset-limit -1 -- {worker}"}
    body = "\n".join(f"{run} {args} 2>&1; echo RC {name} $?" for name, args in cases.items())
    stat, text = bsub_job(base, 2, body)
    codes = dict(line.split()[1:3] for line in text.splitlines() if line.startswith("RC "))
    assert codes == {name: "2" for name in cases}, text[-5000:]
    assert "--nodes 3 but this allocation has 2 node(s)" in text, text
    assert "--min-nodes 3 must be between 1 and --nodes (2)" in text, text
    assert "--elastic runs its workers on the host: a container is not supported" in text, text
    assert "Invalid value for '--reset-limit'" in text, text
    assert not logs.exists() or not any(logs.iterdir()), "no worker may start"
