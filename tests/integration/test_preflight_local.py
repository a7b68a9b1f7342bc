"""The preflight gang check with real tasks on this one machine (hpcring.preflight).

Each task is a real `python -m hpcring.preflight` process that plays one node (`--host fakeN`),
listening on loopback (`--ifname =lo`); they meet through a folder as on a cluster. Healthy: ok
within the deadline. A node that never starts, one whose listener takes no connection (the test
seam --test-blackhole: connects time out, as on an unrouted interface), and one holding another
job's secret: each named bad, the others not, every task ending by the deadline with exit 0.
Above 16 nodes the sampled probe graph (ring neighbours + random peers) is used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcring.bootstrap.auth import new_secret
from hpcring.preflight import read_verdict

ROOT = Path(__file__).resolve().parents[2]


def run_tasks(out: Path, hosts: list[str], *, start=None, deadline: float = 30, extra=None, secrets=None):
    """Start one task per host in ``start`` (default all), wait for all; (exit codes, outputs, seconds)."""
    secret = new_secret()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRING_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    procs = {}
    t0 = time.monotonic()
    for h in (start if start is not None else hosts):
        cmd = [sys.executable, "-m", "hpcring.preflight", "--out", str(out), "--expect-nodes", ",".join(hosts),
               "--host", h, "--ifname", "=lo", "--deadline", str(deadline), *((extra or {}).get(h, []))]
        procs[h] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**env, "HPCRING_SECRET": (secrets or {}).get(h, secret)})
    outputs, codes = {}, {}
    for h, p in procs.items():
        outputs[h] = p.communicate(timeout=deadline + 120)[0]
        codes[h] = p.returncode
    return codes, outputs, time.monotonic() - t0, secret.encode()


def test_healthy_nodes_are_ok_within_the_deadline(tmp_path):
    hosts = ["fake1", "fake2", "fake3"]
    codes, outs, took, secret = run_tasks(tmp_path, hosts)
    assert codes == {h: 0 for h in hosts}, outs
    v = read_verdict(tmp_path, hosts, secret=secret)
    print(f"\n3 local tasks healthy: {took:.1f} s wall, verdict {v.seconds} s\n" + "\n".join(v.lines))
    assert v.ok and v.good == hosts, v.lines
    assert took < 30 and v.seconds < 30
    assert all(f"hpcring preflight {h}: done in" in outs[h] and "2 of 2 peers connected" in outs[h] for h in hosts)
    done = json.loads(json.loads((tmp_path / "fake2.json").read_text())["body"])
    assert done["state"] == "done" and done["listen"][0]["name"] == "lo" and done["bw"]["to"] == "fake3"
    assert done["versions"]["python"] and done["pairs"]["fake1"]["ok"]


def test_gpus_without_a_cuda_torch_are_skipped_not_blamed(tmp_path):
    """--gpus imports torch in the child process; torch here is a CPU build: said, nobody blamed."""
    pytest.importorskip("torch")
    hosts = ["fake1", "fake2"]
    codes, outs, took, secret = run_tasks(tmp_path, hosts, extra={h: ["--gpus", "1"] for h in hosts})
    assert set(codes.values()) == {0}, outs
    v = read_verdict(tmp_path, hosts, secret=secret)
    assert v.ok, v.lines
    assert any("gpus: 0 nodes passed (count and GEMM); skipped: torch" in line and "has no CUDA support" in line
               for line in v.lines), v.lines


def test_a_node_that_never_starts_is_no_answer(tmp_path):
    hosts = ["fake1", "fake2", "fake3"]
    codes, outs, took, secret = run_tasks(tmp_path, hosts, start=["fake1", "fake3"], deadline=10)
    assert codes == {"fake1": 0, "fake3": 0}, outs
    assert took < 10 + 5, took          # the deadline, plus the Python start
    v = read_verdict(tmp_path, hosts, secret=secret)
    assert v.bad == {"fake2": "no answer in 10 s (wrote no preflight file)"}, v.lines
    assert "no file from fake2" in outs["fake1"]


def test_a_node_nobody_can_connect_to_is_named(tmp_path):
    hosts = ["fake1", "fake2", "fake3", "fake4"]
    codes, outs, took, secret = run_tasks(tmp_path, hosts, extra={"fake3": ["--test-blackhole"]}, deadline=12)
    assert set(codes.values()) == {0}, outs
    v = read_verdict(tmp_path, hosts, secret=secret)
    print(f"\nblackholed fake3: {took:.1f} s wall\n" + "\n".join(v.lines))
    assert list(v.bad) == ["fake3"] and not v.unsure, v.lines
    assert v.bad["fake3"].startswith("nobody could connect to it on lo 127.0.0.1 (3 of 3 peers failed; ")
    assert took < 12 + 5


def test_a_node_with_another_jobs_secret_is_refused(tmp_path):
    hosts = ["fake1", "fake2", "fake3"]
    codes, outs, took, secret = run_tasks(tmp_path, hosts, secrets={"fake2": new_secret()}, deadline=10)
    assert set(codes.values()) == {0}, outs
    v = read_verdict(tmp_path, hosts, secret=secret)
    assert list(v.bad) == ["fake2"], v.lines
    assert "not signed with this job's secret" in v.bad["fake2"]


def test_above_sixteen_nodes_the_sampled_graph(tmp_path):
    hosts = [f"fake{i:02d}" for i in range(18)]
    codes, outs, took, secret = run_tasks(tmp_path, hosts, start=hosts[:9] + hosts[10:], deadline=60)
    assert set(codes.values()) == {0}, outs
    v = read_verdict(tmp_path, hosts, secret=secret)
    print(f"\n18 local tasks, one never started: {took:.1f} s wall\n" + "\n".join(v.lines))
    assert v.bad == {"fake09": "no answer in 60 s (wrote no preflight file)"}, v.lines
    assert "ring neighbours + 3 random peers probed" in v.lines[0]
    body = json.loads(json.loads((tmp_path / "fake00.json").read_text())["body"])
    assert len(body["pairs"]) + len(body["unseen"]) == 5 and body["mode"] == "ring + 3 random"
    assert set(body["unseen"]) <= {"fake09"}
