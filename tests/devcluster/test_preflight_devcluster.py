"""The preflight gang check on the real dev cluster (3 nodes in network namespaces; Slurm 22.05).

One task per node through srun, as the job script's step loop runs it:
`srun -N3 --ntasks-per-node=1 python -m hpcring.preflight --out DIR --expect-nodes node[1-3]`,
DIR in /srv/hpcring (every node sees it), the job secret in a 0600 file. HPCRING_IFNAME is what
the site's fabric gives (`=eth0`). The fault: on one node (drawn at random) the configured
interface is `dead0`, which exists on every node and routes nowhere; that node's HPCRING_IFNAME is
set in the task's own environment (srun runs a shell that exports it on that node only), as a
node whose configuration differs. Then the same through `--ifname-for HOST==dead0`; and a node
whose task never starts. Each verdict within 30 s (the default deadline), timing printed.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpcring.bootstrap.auth import write_secret_file
from hpcring.preflight import read_verdict


ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["node1", "node2", "node3"]


@pytest.fixture
def base():
    d = Path("/srv/hpcring/pytest-preflight") / uuid.uuid4().hex[:10]
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    write_secret_file(d / "secret.key")
    return d


def srun_preflight(base: Path, *, shell: str = "", args=()):
    """srun one preflight task per node (``shell``: lines run before it on each node, in bash);
    (CompletedProcess, wall seconds, the run's folder)."""
    out = base / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCRING_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), HPCRING_SECRET_FILE=str(base / "secret.key"), HPCRING_IFNAME="=eth0")
    task = [sys.executable, "-m", "hpcring.preflight", "--out", str(out), "--expect-nodes", "node[1-3]", *args]
    cmd = ["srun", "-p", "debug", "-N3", "--ntasks-per-node=1", "--time=3", "-J", "pytest-preflight",
           "--kill-on-bad-exit=1"]
    cmd += ["bash", "-c", shell + '\nexec "$@"', "preflight", *task] if shell else task
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=600)
    took = time.monotonic() - t0
    (base / "srun.log").write_text(p.stdout + p.stderr)
    return p, took, out


def verdict_of(base: Path, out: Path):
    return read_verdict(out, HOSTS, secret=(base / "secret.key").read_text().strip().encode())


def report(what: str, took: float, v) -> None:
    line = f"{what}: srun {took:.1f} s (queue wait included), preflight {v.seconds:g} s"
    print(f"\n{line}\n" + "\n".join(v.lines))
    with open("/srv/hpcring/pytest-preflight/timings.log", "a") as fh:
        fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def test_healthy_nodes_ok_within_30s(base):
    p, took, out = srun_preflight(base)
    assert p.returncode == 0, p.stdout + p.stderr
    v = verdict_of(base, out)
    report("healthy", took, v)
    assert v.ok and v.good == HOSTS, v.lines
    assert v.seconds < 30
    assert "6 of 6 probes authenticated" in "\n".join(v.lines)
    assert all(f"hpcring preflight {h}: done in" in p.stdout for h in HOSTS), p.stdout


def test_a_node_configured_on_dead0_is_named_within_30s(base):
    victim = random.choice(HOSTS)
    shell = f'if [ "$SLURMD_NODENAME" = {victim} ]; then export HPCRING_IFNAME==dead0; fi'
    p, took, out = srun_preflight(base, shell=shell)
    assert p.returncode == 0, p.stdout + p.stderr
    v = verdict_of(base, out)
    report(f"{victim} on dead0 (HPCRING_IFNAME on that node)", took, v)
    assert list(v.bad) == [victim] and not v.unsure, v.lines
    assert v.bad[victim].startswith(f"nobody could connect to it on dead0 10.98.0.{victim[-1]} (2 of 2 peers failed; ")
    assert v.seconds < 30


def test_ifname_for_one_host(base):
    victim = random.choice(HOSTS)
    p, took, out = srun_preflight(base, args=["--ifname-for", f"{victim}==dead0"])
    assert p.returncode == 0, p.stdout + p.stderr
    v = verdict_of(base, out)
    report(f"{victim} on dead0 (--ifname-for)", took, v)
    assert list(v.bad) == [victim] and "nobody could connect to it on dead0" in v.bad[victim], v.lines
    assert v.seconds < 30


def test_a_node_whose_task_never_starts_is_no_answer_within_30s(base):
    victim = random.choice(HOSTS)
    p, took, out = srun_preflight(base, shell=f'if [ "$SLURMD_NODENAME" = {victim} ]; then exit 0; fi')
    assert p.returncode == 0, p.stdout + p.stderr
    v = verdict_of(base, out)
    report(f"{victim} never started", took, v)
    assert v.bad == {victim: "no answer in 30 s (wrote no preflight file)"}, v.lines
    assert v.seconds < 30
