"""The preflight's files, blame rules and verdict (hpcring.preflight), on synthetic records.

Every rule of hpcring.preflight.verdict on small hand-made clusters; then generated bad input:
every field of a good record replaced by values of the wrong type or removed, random JSON bodies,
and files on disk that are corrupt, truncated, too big, unsigned or signed for another host.
Each must give a clear one-line reason naming the node, never an exception.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcring.errors import BootstrapError
from hpcring.preflight import Verdict, judge, probe_graph, read_verdict
from hpcring.preflight import checks
from hpcring.preflight.record import FORMAT, BadRecord, read_record, write_record

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"ab" * 32
VERS = {"python": "3.11.7", "hpcring": "0.1.0", "torch": "2.13.0+cpu", "openmpi": "4.1.4", "nccl": None}


def rec(host: str, hosts: list[str], *, fail_to=(), gbps: float = 10.0, **over) -> dict:
    """A done record of ``host`` in a cluster of ``hosts``: it reached every other host except
    ``fail_to``; its ring link to the next host ran at ``gbps``."""
    i = hosts.index(host)
    nxt = hosts[(i + 1) % len(hosts)]
    body = {"state": "done", "started": 1000.0 + i * 0.1, "ended": 1003.0 + i * 0.1, "deadline": 30,
            "spec": "=eth0", "listen": [{"name": "eth0", "address": f"10.0.0.{i + 1}", "port": 5000 + i, "error": None}],
            "iface_error": None, "versions": dict(VERS), "gpu": None, "local_error": None, "min_gbps": 0,
            "pairs": {p: ({"ok": True, "iface": "eth0", "address": "10.0.0.9", "port": 1, "ms": 1.5} if p not in fail_to
                          else {"ok": False, "err": "eth0 10.0.0.9:1: timed out after 3.0s"})
                      for p in hosts if p != host},
            "bw": {"to": nxt, "iface": "eth0", "gbps": gbps, "bytes": 1 << 25, "seconds": 0.03}}
    if nxt in fail_to:
        body["bw"] = {"to": nxt, "error": "not connected (timed out)"}
    body.update(over)
    return body


def cluster(n: int = 3) -> tuple[list[str], dict]:
    hosts = [f"node{i + 1}" for i in range(n)]
    return hosts, {h: rec(h, hosts) for h in hosts}


# ------------------------------------------------------------------------------ healthy, missing

def test_all_healthy_is_ok_with_a_summary():
    hosts, recs = cluster()
    v = judge(recs, hosts)
    assert isinstance(v, Verdict) and v.ok and v.bad == {} and v.good == hosts
    assert v.seconds == pytest.approx(3.2)
    assert v.lines[0] == "preflight: 3 nodes, 3 ok, 0 bad, 3.2 s (all pairs probed)"
    text = "\n".join(v.lines)
    assert "python 3.11.7" in text and "nccl absent" in text and "6 of 6 probes" in text
    assert "node1->node2 10 Gbit/s" in text and "report only" in text


def test_a_node_with_no_file_is_no_answer_in_the_deadline():
    hosts, recs = cluster()
    del recs["node3"]
    v = judge(recs, hosts)
    assert not v.ok and list(v.bad) == ["node3"] and v.bad["node3"] == "no answer in 30 s (wrote no preflight file)"
    assert "node3" not in v.unsure


def test_most_nodes_bad_points_at_the_environment():
    hosts, recs = cluster()
    del recs["node1"], recs["node2"]
    v = judge(recs, hosts)
    assert set(v.bad) == {"node1", "node2"} and any("suspect the environment" in line for line in v.lines)
    hosts, recs = cluster()
    del recs["node1"]
    assert not any("suspect" in line for line in judge(recs, hosts).lines)


def test_a_node_that_never_finished():
    hosts, recs = cluster()
    recs["node2"] = {k: recs["node2"][k] for k in ("started", "deadline", "listen")} | {"state": "listening"}
    v = judge(recs, hosts)
    assert list(v.bad) == ["node2"]
    assert v.bad["node2"] == "started (listening on eth0 10.0.0.2) but did not finish within 30 s"


def test_no_interface_and_failed_local_checks():
    hosts, recs = cluster()
    recs["node1"]["iface_error"] = "no usable interface matches '=ib0' on node1"
    recs["node3"]["local_error"] = "RuntimeError: boom"
    v = judge(recs, hosts)
    assert "no interface to listen on: no usable interface matches '=ib0'" in v.bad["node1"]
    assert v.bad["node3"] == "its local checks failed: RuntimeError: boom"


# ------------------------------------------------------------------------------ versions, GPUs

def test_the_majoritys_versions_win():
    hosts, recs = cluster()
    recs["node2"]["versions"]["torch"] = "2.12.0+cpu"
    recs["node3"]["versions"]["openmpi"] = None
    v = judge(recs, hosts)
    assert v.bad == {"node2": "torch 2.12.0+cpu where 2 of 3 nodes have 2.13.0+cpu",
                     "node3": "openmpi absent where 2 of 3 nodes have 4.1.4"}
    assert not v.unsure


def test_a_version_tie_blames_both_sides_unsure():
    hosts, recs = cluster(2)
    recs["node2"]["versions"]["python"] = "3.12.1"
    v = judge(recs, hosts)
    assert set(v.bad) == {"node1", "node2"} and v.unsure == {"node1", "node2"}
    assert "python 3.12.1: versions differ with no majority (3.11.7 on 1; 3.12.1 on 1)" == v.bad["node2"]
    assert any("python: no majority" in line for line in v.lines)


def test_gpu_errors_blame_the_node_and_skips_do_not():
    hosts, recs = cluster()
    recs["node1"]["gpu"] = {"expected": 4, "count": 3, "error": "3 GPUs visible, expected 4"}
    recs["node2"]["gpu"] = {"expected": 4, "skipped": "torch 2.13.0+cpu has no CUDA support"}
    recs["node3"]["gpu"] = {"expected": 4, "count": 4, "gemm_ms": 3.1}
    v = judge(recs, hosts)
    assert v.bad == {"node1": "GPU check: 3 GPUs visible, expected 4"}
    assert any("gpus: 1 node passed (count and GEMM); skipped: torch 2.13.0+cpu has no CUDA support" in line
               for line in v.lines)


# ------------------------------------------------------------------------------ connections

def test_a_node_nobody_can_reach_is_bad():
    hosts, recs = cluster()
    for h in ("node1", "node3"):
        recs[h] = rec(h, hosts, fail_to=("node2",))
    v = judge(recs, hosts)
    assert list(v.bad) == ["node2"] and not v.unsure
    assert v.bad["node2"].startswith("nobody could connect to it on eth0 10.0.0.2 (2 of 2 peers failed; node1: ")


def test_a_node_cut_off_both_ways_is_bad_and_only_it():
    hosts, recs = cluster(4)
    for h in hosts:
        recs[h] = rec(h, hosts, fail_to=hosts if h == "node3" else ("node3",))
    v = judge(recs, hosts)
    assert list(v.bad) == ["node3"], v.bad
    # its ring links fail too, but they are explained by the node already blamed
    assert "ring link" not in v.bad["node3"]


def test_a_node_that_reaches_nobody_whose_peers_others_reach():
    hosts, recs = cluster(4)
    recs["node4"] = rec("node4", hosts, fail_to=("node1", "node2", "node3"))
    v = judge(recs, hosts)
    assert list(v.bad) == ["node4"] and v.bad["node4"].startswith("connected to none of its 3 peers (node1: ")


def test_two_nodes_one_way_failure_names_the_unreachable_listener():
    hosts, recs = cluster(2)
    recs["node1"] = rec("node1", hosts, fail_to=("node2",))   # node2 reached node1, node1 not node2
    v = judge(recs, hosts)
    assert list(v.bad) == ["node2"] and not v.unsure


def test_two_nodes_failing_both_ways_blame_both_unsure():
    hosts, recs = cluster(2)
    recs = {h: rec(h, hosts, fail_to=hosts) for h in hosts}
    v = judge(recs, hosts)
    assert set(v.bad) == set(hosts) and v.unsure == set(hosts)
    assert "no clear culprit: both ends blamed (conservative)" in v.bad["node1"]


def test_a_single_failing_pair_among_working_nodes_blames_both_ends_unsure():
    hosts, recs = cluster(4)
    recs["node1"] = rec("node1", hosts, fail_to=("node3",))
    v = judge(recs, hosts)
    assert set(v.bad) == {"node1", "node3"} and v.unsure == {"node1", "node3"}
    assert v.bad["node3"].startswith("link node1 -> node3 failed (eth0 10.0.0.9:1: timed out after 3.0s)")


# ------------------------------------------------------------------------------ ring links

def test_slow_links_are_only_reported_without_a_threshold():
    hosts, recs = cluster()
    recs["node1"] = rec("node1", hosts, gbps=0.1)
    assert judge(recs, hosts).ok


def test_one_slow_link_blames_both_ends_unsure():
    hosts, recs = cluster()
    recs["node1"] = rec("node1", hosts, gbps=0.1)
    v = judge(recs, hosts, min_gbps=1)
    assert set(v.bad) == {"node1", "node2"} and v.unsure == {"node1", "node2"}
    assert v.bad["node1"] == "ring link node1->node2 0.1 Gbit/s < 1; no clear culprit: both ends blamed (conservative)"


def test_both_ring_links_of_a_node_slow_name_that_node():
    hosts, recs = cluster(4)
    recs["node1"] = rec("node1", hosts, gbps=0.1)
    recs["node2"] = rec("node2", hosts, gbps=0.2)
    v = judge(recs, hosts, min_gbps=1)
    assert list(v.bad) == ["node2"] and not v.unsure
    assert v.bad["node2"].startswith("both its ring links fail or are slow: node1->node2 0.1 Gbit/s < 1")


def test_the_threshold_the_nodes_recorded_applies_when_none_is_given():
    hosts, recs = cluster()
    recs["node3"] = rec("node3", hosts, gbps=0.5, min_gbps=2)
    v = judge(recs, hosts)
    assert set(v.bad) == {"node3", "node1"} and "threshold" in "\n".join(v.lines)
    assert judge(recs, hosts, min_gbps=0).ok


def test_many_nodes_summarise():
    hosts, recs = cluster(40)
    for h in hosts:
        recs[h]["pairs"] = {p: recs[h]["pairs"][p] for p in probe_graph(hosts)[h]}
    recs["node7"] = rec("node7", hosts, gbps=0.01, min_gbps=1)
    recs["node7"]["pairs"] = {p: recs["node8"]["pairs"]["node9"] for p in probe_graph(hosts)["node7"]}
    v = judge(recs, hosts)
    assert "ring neighbours + 3 random peers probed" in v.lines[0]
    assert len(v.lines) < 12 and any("median 10 Gbit/s" in line for line in v.lines)


# ------------------------------------------------------------------------------ the probe graph

def test_probe_graph_small_is_all_pairs():
    hosts = [f"n{i}" for i in range(16)]
    g = probe_graph(hosts)
    assert all(sorted(g[h]) == sorted(set(hosts) - {h}) for h in hosts)


@pytest.mark.parametrize("n", [17, 18, 100, 3000])
def test_probe_graph_large_is_ring_plus_random_and_the_same_everywhere(n):
    hosts = [f"n{i}" for i in range(n)]
    g = probe_graph(hosts)
    assert g == probe_graph(list(hosts))
    testers = {h: 0 for h in hosts}
    for i, h in enumerate(hosts):
        ts = g[h]
        assert len(ts) == len(set(ts)) == min(5, n - 1) and h not in ts
        assert ts[:2] == [hosts[(i + 1) % n], hosts[(i - 1) % n]]
        for t in ts:
            testers[t] += 1
    assert min(testers.values()) >= 2
    assert sum(len(v) for v in g.values()) <= 5 * n


# ------------------------------------------------------------------------------ files

def test_record_round_trip_and_refusals(tmp_path):
    write_record(tmp_path, "node1", {"state": "listening", "x": 1}, SECRET)
    assert read_record(tmp_path, "node1", SECRET) == {"state": "listening", "x": 1, "host": "node1"}
    assert read_record(tmp_path, "node2", SECRET) is None
    with pytest.raises(BadRecord, match="not signed with this job's secret"):
        read_record(tmp_path, "node1", b"cd" * 32)
    (tmp_path / "node1.json").rename(tmp_path / "node2.json")
    with pytest.raises(BadRecord, match="was written for host 'node1'"):
        read_record(tmp_path, "node2", SECRET)
    env = json.loads((tmp_path / "node2.json").read_text())
    env["host"] = "node2"
    (tmp_path / "node2.json").write_text(json.dumps(env))
    with pytest.raises(BadRecord, match="not signed"):
        read_record(tmp_path, "node2", SECRET)
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("content, reason", [
    (b"", "is not JSON"),
    (b"{\"format\": \"hpcring-preflight-v1\", \"mac\"", "is not JSON"),
    (b"\xff\xfe\x00", "is not JSON"),
    (b"[]", "is not a hpcring-preflight-v1 file"),
    (b"{\"format\": \"v0\"}", "is not a hpcring-preflight-v1 file"),
    (json.dumps({"format": FORMAT, "host": "node1", "mac": 5, "body": "{}"}).encode(), "missing or not text"),
    (json.dumps({"format": FORMAT, "host": ["node1"], "mac": "00", "body": "{}"}).encode(), "missing or not text"),
    (json.dumps({"format": FORMAT, "host": "node1", "mac": "\u00ff", "body": "{}"}).encode(), "not signed"),
    (b"[" * 100000, "is not JSON"),
    (b" " * (1 << 20) + b"{}", "larger than"),
])
def test_corrupt_files_are_named_not_raised(tmp_path, content, reason):
    (tmp_path / "node1.json").write_bytes(content)
    with pytest.raises(BadRecord, match=reason):
        read_record(tmp_path, "node1", SECRET)
    hosts = ["node1", "node2"]
    write_record(tmp_path, "node2", rec("node2", hosts), SECRET)
    v = read_verdict(tmp_path, hosts, secret=SECRET)
    assert list(v.bad) == ["node1"] and v.bad["node1"].startswith("its preflight file is unusable: node1.json")


def test_a_signed_body_that_is_not_an_object(tmp_path):
    from hpcring.preflight import record
    body = "[1, 2]"
    (tmp_path / "node1.json").write_text(json.dumps(
        {"format": FORMAT, "host": "node1", "mac": record._mac(SECRET, "node1", body), "body": body}))
    with pytest.raises(BadRecord, match="body is not an object"):
        read_record(tmp_path, "node1", SECRET)


def test_a_folder_in_place_of_a_file(tmp_path):
    (tmp_path / "node1.json").mkdir()
    with pytest.raises(BadRecord, match="cannot read node1.json"):
        read_record(tmp_path, "node1", SECRET)


def test_read_verdict_needs_the_secret_and_sane_host_names(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCRING_SECRET_FILE", raising=False)
    monkeypatch.delenv("HPCRING_SECRET", raising=False)
    with pytest.raises(BootstrapError, match="no per-job secret"):
        read_verdict(tmp_path, ["node1"])
    for bad in ("../etc", ".hidden", "a/b", "", "x" * 300):
        with pytest.raises(ValueError, match="cannot name a preflight file"):
            read_verdict(tmp_path, [bad], secret=SECRET)
    monkeypatch.setenv("HPCRING_SECRET", SECRET.decode())
    v = read_verdict(tmp_path / "absent", ["node1"])
    assert v.bad == {"node1": "no answer in 30 s (wrote no preflight file)"}


# ------------------------------------------------------------------------------ generated bad input

WRONG = [None, "", "x" * 5000, 0, -1, 1.5, float("nan"), True, [], [1, "a"], {}, {"a": None}, "\x1b[31m"]
FIELDS = ["state", "started", "ended", "deadline", "listen", "iface_error", "versions", "gpu", "local_error",
          "min_gbps", "pairs", "bw"]


def _mutations():
    for key in FIELDS:
        yield key, "<removed>"
        for w in WRONG:
            yield key, w
    for sub in ("pairs", "bw", "versions", "gpu", "listen"):
        for w in WRONG:
            yield f"{sub}.*", w


@pytest.mark.parametrize("key, value", list(_mutations()), ids=lambda x: repr(x)[:30])
def test_every_field_of_a_record_mutated_never_raises(key, value):
    hosts, recs = cluster()
    body = recs["node2"]
    if key.endswith(".*"):
        sub = body[key[:-2]]
        if isinstance(sub, dict) and sub:
            for k in list(sub):
                sub[k] = copy.deepcopy(value)
        elif isinstance(sub, list):
            body[key[:-2]] = [copy.deepcopy(value)]
        else:
            body[key[:-2]] = {"node1": copy.deepcopy(value)}
    elif value == "<removed>":
        del body[key]
    else:
        body[key] = copy.deepcopy(value)
    v = judge(recs, hosts)
    assert isinstance(v, Verdict) and v.lines
    for h, reason in v.bad.items():
        assert isinstance(reason, str) and "\n" not in reason and len(reason) < 800, (h, reason)
    # whatever went wrong, it is node2's fault or nobody's: healthy peers are not blamed with certainty
    assert set(v.bad) - v.unsure <= {"node2"}, v.bad


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(FIELDS + ["host", "other"]), json_values, max_size=12),
       keep=st.sets(st.sampled_from(FIELDS)))
def test_random_bodies_never_raise(body, keep):
    hosts, recs = cluster()
    good = recs["node3"]
    recs["node3"] = {**{k: good[k] for k in keep}, **body}
    v = judge(recs, hosts)
    assert all(isinstance(r, str) and "\n" not in r for r in v.bad.values())
    assert set(v.bad) - v.unsure <= {"node3"}, v.bad


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_random_file_contents_never_raise(tmp_path, content):
    (tmp_path / "node1.json").write_bytes(content)
    v = read_verdict(tmp_path, ["node1"], secret=SECRET)
    assert v.bad["node1"].startswith("its preflight file is unusable: node1.json")


# ------------------------------------------------------------------------------ the GPU check

class _T:
    """A numpy tensor that can move to fake devices; ``bad`` devices corrupt a product."""
    bad: set = set()

    def __init__(self, a, dev="cpu"):
        self.a, self.dev = np.asarray(a, dtype=np.float32), dev

    def to(self, dev):
        return _T(self.a, dev)

    def cpu(self):
        return _T(self.a)

    def __matmul__(self, o):
        r = self.a @ o.a
        return _T(r + (1.0 if self.dev in _T.bad else 0.0), self.dev)

    def __sub__(self, o):
        return _T(self.a - o.a, self.dev)

    def abs(self):
        return _T(np.abs(self.a), self.dev)

    def max(self):
        return float(self.a.max())


class _FakeTorch:
    float32 = "float32"
    __version__ = "2.9.0+cu121"

    def __init__(self, count, cuda="12.1"):
        self.version = type("V", (), {"cuda": cuda})
        self.cuda = type("C", (), {"device_count": staticmethod(lambda: count)})

    class Generator:
        def manual_seed(self, s):
            self.rng = np.random.default_rng(s)
            return self

    def randn(self, *shape, generator, dtype):
        return _T(generator.rng.standard_normal(shape))


def test_gpu_check_cases():
    assert checks.gpu_check(2, None) == {"expected": 2, "skipped": "torch is not importable here"}
    assert checks.gpu_check(2, _FakeTorch(2, cuda=None))["skipped"] == "torch 2.9.0+cu121 has no CUDA support"
    assert checks.gpu_check(4, _FakeTorch(3)) == {"expected": 4, "count": 3, "error": "3 GPUs visible, expected 4"}
    ok = checks.gpu_check(2, _FakeTorch(2))
    assert ok["count"] == 2 and "gemm_ms" in ok and "error" not in ok
    _T.bad = {"cuda:1"}
    try:
        bad = checks.gpu_check(2, _FakeTorch(2))
    finally:
        _T.bad = set()
    assert bad["error"].startswith("GEMM on cuda:1 differs from the CPU's (max relative error")


def test_gpu_check_with_real_cpu_torch_skips():
    torch = pytest.importorskip("torch")
    out = checks.gpu_check(1, torch)
    assert "skipped" in out or out.get("count") is not None


# ------------------------------------------------------------------------------ the command line

@pytest.mark.parametrize("args, msg", [
    (["--expect-nodes", "a,b"], "--out"),
    (["--out", "x", "--expect-nodes", "a,a"], "names a node twice"),
    (["--out", "x", "--expect-nodes", "a[1-"], "--expect-nodes"),
    (["--out", "x", "--expect-nodes", ""], "names no node"),
    (["--out", "x", "--expect-nodes", "a", "--deadline", "nan"], "--deadline must be between"),
    (["--out", "x", "--expect-nodes", "a", "--deadline", "0"], "--deadline must be between"),
    (["--out", "x", "--expect-nodes", "a", "--min-gbps", "-1"], "--min-gbps must be between"),
    (["--out", "x", "--expect-nodes", "a", "--gpus", "1.5"], "--gpus must be an integer"),
    (["--out", "x", "--expect-nodes", "a", "--ifname-for", "node2"], "HOST=SPEC"),
])
def test_cli_usage_errors(args, msg):
    p = subprocess.run([sys.executable, "-m", "hpcring.preflight", *args], capture_output=True, text=True,
                       timeout=60, cwd=str(ROOT))
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_cli_task_without_secret_or_not_expected(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HPCRING_")}
    base = [sys.executable, "-m", "hpcring.preflight", "--out", str(tmp_path), "--expect-nodes", "a,b"]
    p = subprocess.run([*base, "--host", "c"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1 and "this node 'c' is not among --expect-nodes (a, b)" in p.stderr
    p = subprocess.run([*base, "--host", "a"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1 and "no per-job secret" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([*base, "--verdict"], capture_output=True, text=True, timeout=60,
                       env={**env, "HPCRING_SECRET": SECRET.decode()})
    assert p.returncode == 3 and "BAD a: no answer in 30 s" in p.stdout
    assert json.loads((tmp_path / "verdict.json").read_text())["bad"]["b"].startswith("no answer")
