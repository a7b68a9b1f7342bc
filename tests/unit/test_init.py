"""init_bootstrap with the local backend's environment: ranks in processes meet and agree."""
from __future__ import annotations

import json
import random
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpcring.bootstrap import frameworks, init_store
from hpcring.bootstrap.auth import new_secret_file
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError, UsageError

SRC = str(Path(__file__).resolve().parents[2] / "src")

RANK_SCRIPT = r"""
import json, sys
from hpcring.bootstrap.init import init_bootstrap
from hpcring.bootstrap.frameworks import framework_env
from hpcring.errors import BootstrapError
try:
    topo, client = init_bootstrap(timeout=float(sys.argv[1]), port_range=(int(sys.argv[2]), int(sys.argv[3])))
except BootstrapError as e:
    print(json.dumps({"error": str(e)})); sys.exit(0)
client.barrier("after-init", topo.size, timeout=20)
print(json.dumps({"rank": topo.rank, "hosts": topo.hosts, "launcher": topo.launcher,
                  "interface": topo.interface, "address": topo.address, "master_addr": topo.master_addr,
                  "master_port": topo.master_port, "node_rank": topo.node_rank, "num_nodes": topo.num_nodes,
                  "local_rank": topo.local_rank, "store_port": client.port if topo.rank else client.server.port,
                  "MASTER_ADDR": client.get("MASTER_ADDR").decode(), "env": framework_env(topo, 2)}))
client.leave(topo.rank, topo.size, linger=20)   # rank 0 hosts the store: it leaves last
"""


def local_env(rank, nodes, per_node, job_id, secret_file):
    return {
        "HPCRING_LAUNCHER": "local", "HPCRING_JOB_ID": job_id,
        "HPCRING_RANK": str(rank), "HPCRING_SIZE": str(nodes * per_node),
        "HPCRING_LOCAL_RANK": str(rank % per_node), "HPCRING_LOCAL_SIZE": str(per_node),
        "HPCRING_NODE_RANK": str(rank // per_node), "HPCRING_NUM_NODES": str(nodes),
        "HPCRING_NODELIST": f"local[0-{nodes - 1}]" if nodes > 1 else "local0",
        "HPCRING_HOSTNAME": f"local{rank // per_node}", "HPCRING_MASTER_ADDR": "127.0.0.1",
        "HPCRING_SECRET_FILE": str(secret_file),
    }


def run_job(tmp_path, *, nodes=2, per_node=2, ranks=None, timeout=30.0, port_range=(29500, 29999), job_id=None):
    job_id = job_id or f"t{uuid.uuid4().hex[:8]}"
    secret = new_secret_file(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HPCRING_", "SLURM_", "OMPI_", "PMI"))}
    base["PYTHONPATH"] = SRC
    ranks = range(nodes * per_node) if ranks is None else ranks
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(timeout), *map(str, port_range)],
                              env={**base, **local_env(r, nodes, per_node, job_id, secret)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ranks]
    outs = [p.communicate(timeout=timeout + 30) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(e[-3000:] for _, e in outs)
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def test_four_local_ranks_meet_and_agree(tmp_path):
    results = run_job(tmp_path)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["launcher"] == "local"
        assert r["hosts"] == ["local0", "local0", "local1", "local1"]
        assert r["interface"] == "lo" and r["address"] == "127.0.0.1"
        assert r["master_addr"] == "127.0.0.1" == r["MASTER_ADDR"]
        assert r["master_port"] == results[0]["master_port"]
        assert r["store_port"] == results[0]["store_port"]
        assert r["master_port"] != r["store_port"] and r["master_port"] > r["store_port"]
        assert 29500 <= r["store_port"] <= 29999
    assert [r["node_rank"] for r in results] == [0, 0, 1, 1]
    env = results[3]["env"]
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["NCCL_SOCKET_IFNAME"] == "=lo"
    assert env["MASTER_PORT"] == str(results[0]["master_port"])


def test_store_port_collision_moves_to_the_next_port(tmp_path):
    lo = free_port_block(8)
    job = f"c{uuid.uuid4().hex[:8]}"
    taken = init_store.derive_port(f"{job}/2", (lo, lo + 7))
    with socket.socket() as squatter:   # a foreign listener that never speaks our protocol
        squatter.bind(("0.0.0.0", taken))
        squatter.listen(16)
        results = run_job(tmp_path, nodes=1, per_node=2, port_range=(lo, lo + 7), job_id=job, timeout=30)
    assert "error" not in results[0], results
    assert results[0]["store_port"] == results[1]["store_port"] == init_store.candidate_ports(taken, (lo, lo + 7))[1]


def test_missing_rank_times_out_naming_the_key(tmp_path):
    t0 = time.monotonic()
    results = run_job(tmp_path, nodes=1, per_node=3, ranks=[0, 1], timeout=3.0)
    assert time.monotonic() - t0 < 3.0 + 15
    err = results[0]["error"]
    assert "init/host/2" in err and "timed out" in err and "127.0.0.1:" in err
    # every rank that came names the one that did not, with its host (rank 0 tells them)
    for r in results:
        assert "1 of 3 ranks never reached hpcring.init(): rank 2 on local0" in r["error"], r
        assert "HPCRING_INIT_TIMEOUT" in r["error"]


def test_missing_ranks_named_with_hosts_across_nodes(tmp_path):
    results = run_job(tmp_path, nodes=3, per_node=2, ranks=[0, 1, 2, 4], timeout=3.0)
    for r in results:
        assert "2 of 6 ranks never reached hpcring.init(): rank 3 on local1, rank 5 on local2" in r["error"], r


def test_describe_ranks_unknown_hosts_and_limit():
    from hpcring.ranks import each_on_host
    assert each_on_host([1, 2], ("a", "?", "b")) == "rank 1 (host unknown), rank 2 on b"
    assert each_on_host(list(range(20)), ("h",) * 20, limit=2) == "rank 0 on h, rank 1 on h and 18 more"


# ------------------------------------------------------------------------------------ helpers

def free_port_block(n):
    """A run of ``n`` ports that are free right now (best effort)."""
    for start in range(40000, 60000, 97):
        socks = []
        try:
            for p in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    pytest.skip("no free port block")


def topo(**kw):
    base = dict(rank=1, size=4, local_rank=1, local_size=2, node_rank=0, num_nodes=2,
                hosts=("a", "a", "b", "b"), launcher="slurm", job_id="7", master_addr="10.0.0.1",
                master_port=29601, interface="ib0", address="10.0.0.2")
    base.update(kw)
    return Topology(**base)


def test_framework_env_contents(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")          # the user's choice stands
    env = frameworks.framework_env(topo(), gpus_per_node=4)
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29601", "RANK": "1", "WORLD_SIZE": "4",
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "0",
                   "NCCL_SOCKET_IFNAME": "=ib0", "GLOO_SOCKET_IFNAME": "ib0", "CUDA_VISIBLE_DEVICES": "1"}


def test_framework_env_respects_existing_cuda_devices_and_cpu_jobs(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert "CUDA_VISIBLE_DEVICES" not in frameworks.framework_env(topo(), gpus_per_node=4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in frameworks.framework_env(topo(), gpus_per_node=0)


def test_omp_threads_follow_the_cpus_a_rank_has(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert frameworks.framework_env(topo(), 0)["OMP_NUM_THREADS"] == str(frameworks.threads_per_rank(2))
    machine = set(range(16))
    assert frameworks.threads_per_rank(4, {}, machine, 16) == 4          # 4 unpinned ranks share 16 CPUs
    assert frameworks.threads_per_rank(4, {}, {2, 3, 4}, 16) == 3         # pinned by the launcher: all of its own
    assert frameworks.threads_per_rank(8, {}, set(range(2)), 2) == 1      # never 0
    assert frameworks.threads_per_rank(4, {"SLURM_CPUS_PER_TASK": "6"}, machine, 16) == 6
    assert frameworks.threads_per_rank(4, {"SLURM_CPUS_PER_TASK": "junk"}, machine, 16) == 4


def test_framework_env_needs_a_completed_topology():
    with pytest.raises(BootstrapError, match="init_bootstrap"):
        frameworks.framework_env(topo(master_addr=None))


def test_apply_framework_env_exports(monkeypatch):
    for k in ("MASTER_ADDR", "RANK", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(k, raising=False)
    # every variable it exports (RANK, LOCAL_RANK, WORLD_SIZE, ...) must vanish after the test:
    # later tests start fake ranks from this process's environment
    monkeypatch.setattr(os, "environ", os.environ.copy())
    frameworks.apply_framework_env(topo(rank=2, local_rank=0))
    assert os.environ["RANK"] == "2" and os.environ["NCCL_SOCKET_IFNAME"] == "=ib0"


def test_derive_port_is_stable_and_in_range():
    ports = {init_store.derive_port(f"job{i}", (29500, 29999)) for i in range(200)}
    assert all(29500 <= p <= 29999 for p in ports) and len(ports) > 100
    assert init_store.derive_port("42") == init_store.derive_port("42")
    assert init_store.candidate_ports(29998, (29500, 29999), 4) == [29998, 29999, 29500, 29501]
    with pytest.raises(BootstrapError):
        init_store.derive_port("x", (0, 10))


def test_bootstrap_master_addr_precedence():
    t = topo(master_addr=None, hosts=("localhost", "x", "y", "z"))
    assert init_store.bootstrap_master_addr(t, {"HPCRING_MASTER_ADDR": "10.1.1.1", "MASTER_ADDR": "10.2.2.2"}) == "10.1.1.1"
    assert init_store.bootstrap_master_addr(t, {"MASTER_ADDR": "10.2.2.2"}) == "10.2.2.2"
    assert init_store.bootstrap_master_addr(t, {}) == "127.0.0.1"   # first host resolved
    with pytest.raises(BootstrapError, match="cannot tell where rank 0 runs"):
        init_store.bootstrap_master_addr(topo(master_addr=None, hosts=("?", "a", "b", "c")), {})


def test_backend_given_to_init_becomes_the_sessions_default(monkeypatch):
    import hpcring.session as hs
    from hpcring.collectives import api
    made = []

    class Comm:
        size = 1                  # as a Communicator's: one rank, so no straggler watcher starts

        def __init__(self, backend):
            self.backend = backend

        def allreduce(self, x):
            return (self.backend, x)
    monkeypatch.setattr(api.Communicator, "create", classmethod(
        lambda cls, topo, store, secret, *, timeout=None, backend="ring", watchdog=None, **kw:
        made.append(backend) or Comm(backend)))
    monkeypatch.setattr(hs, "auto_backend", lambda topo, environ=None: "nccl")   # as on a GPU node
    s = hs.Session(topo(), store=None, secret=b"x" * 32)
    s.use("ring")
    assert s.allreduce(1) == ("ring", 1) and s.communicator().backend == "ring" and made == ["ring"]
    with pytest.raises(UsageError, match="unknown backend 'gloo'"):
        s.use("gloo")
    fresh = hs.Session(topo(), store=None, secret=b"x" * 32)
    assert fresh.allreduce(2) == ("nccl", 2)                                     # no default: auto


def test_refused_store_connects_back_off_more_in_large_jobs(monkeypatch):
    """Until rank 0's store listens, a rank retries with jittered waits whose cap grows with the job
    size: 0.2 s up to RETRY_RANKS ranks, up to 1 s beyond (4096 ranks at 0.2 s: 20 000 connects/s)."""
    from hpcring.bootstrap import init_store
    from hpcring.errors import BootstrapError

    def refused(*a, **k):
        raise BootstrapError("connection refused")
    for ranks, cap in ((8, 0.2), (256, 0.2), (1024, 0.8), (8192, 1.0)):
        waits: list[float] = []
        clock = [0.0]
        monkeypatch.setattr(init_store, "StoreClient", refused)
        monkeypatch.setattr(init_store.time, "monotonic", lambda: clock[0])
        monkeypatch.setattr(init_store, "time_left", lambda deadline: deadline - clock[0])

        def sleep(s, waits=waits):
            waits.append(s)
            clock[0] += s
        monkeypatch.setattr(init_store.time, "sleep", sleep)
        with pytest.raises(BootstrapError, match="could not reach the rendezvous store"):
            init_store._connect_any("127.0.0.1", [29500], b"s" * 32, 60.0, ranks=ranks)
        late = waits[10:-1]
        assert late and max(late) <= cap + 1e-9 and min(late) >= cap / 2 - 1e-9, (ranks, late[:5])
        assert len(set(late)) > 1                     # jittered: ranks do not retry in step


@pytest.mark.parametrize("hosts", [
    [f"node{r // 8 + 1}" for r in range(4096)],                         # block placement
    [f"node{r % 512 + 1}" for r in range(4096)],                         # cyclic placement
    ["a1", "a1", "b07", "b08", "b08", "b08", "c", "a1"],                 # uneven, padded, bare, revisits
    ["gpu-3.cluster", "gpu-4.cluster", "login"],
    ["?"], ["h[1]", "h,2", "h 3"],                                       # no hostlist denotes these: plain list
    [f"n{r}" for r in random.Random(7).sample(range(10_000), 300)],     # random order
])
def test_init_hosts_round_trip_exactly_and_stay_small(hosts):
    from hpcring.bootstrap.init_hosts import decode_hosts, encode_hosts
    wire = encode_hosts(hosts)
    assert decode_hosts(wire, len(hosts)) == hosts
    assert len(wire) <= len(json.dumps(hosts)) + 16


def test_init_hosts_of_a_block_layout_are_a_few_bytes_at_any_size():
    from hpcring.bootstrap.init_hosts import encode_hosts
    assert encode_hosts([f"node{r // 8 + 1}" for r in range(4096)]) == b'{"runs": [["node[1-512]", 8]]}'
    assert len(encode_hosts([f"node{r // 8 + 1}" for r in range(65536)])) < 40


def test_a_rank_passes_over_the_store_of_another_step_of_its_job():
    """A restarted step's rank 0 finds its first port still held by the failed step's store (same
    job, same secret, dying on the same node) and binds the next one; a rank of the new step that
    reaches the old store first must pass over it, not meet the old world there."""
    secret = b"s" * 32
    old = init_store._start_server([0], secret, ranks=2, world="2425/2/step0")
    new = init_store._start_server([0], secret, ranks=2, world="2425/2/step1")
    try:
        ports = [old.port, new.port]
        client = init_store._connect_any("127.0.0.1", ports, secret, time.monotonic() + 10, world="2425/2/step1")
        assert client.port == new.port and client.check(init_store.WORLD_KEY) == b"2425/2/step1"
        client.close()
        with pytest.raises(BootstrapError, match=r"another world's store \('2425/2/step0', not '2425/2/step3'\)"):
            init_store._connect_any("127.0.0.1", [old.port], secret, time.monotonic() + 1.5, world="2425/2/step3")
        legacy = init_store._start_server([0], secret, ranks=2)           # no world key at all
        try:
            with pytest.raises(BootstrapError, match="a store with no world key"):
                init_store._connect_any("127.0.0.1", [legacy.port], secret, time.monotonic() + 1.5, world="w")
        finally:
            legacy.close()
    finally:
        old.close()
        new.close()


def test_consecutive_steps_of_a_job_never_share_a_store_port():
    """Hashed per step, job 2425's steps 0 and 1 both derived port 29515; a step's ports now follow
    the previous step's, so a restart's ports are disjoint from the failed step's."""
    topo = Topology(rank=0, size=2, local_rank=0, local_size=1, node_rank=0, num_nodes=2,
                    hosts=("node1", "node2"), launcher="slurm", job_id="2425")
    for lo, hi in ((29500, 29999), (40000, 40015)):
        lists = [init_store._store_ports(topo, {"SLURM_STEP_ID": str(s)}, (lo, hi)) for s in range(6)]
        for a, b in zip(lists, lists[1:]):
            assert not set(a) & set(b), (a, b)
        assert all(len(x) == min(init_store.PORT_TRIES, hi - lo + 1) and lo <= min(x) and max(x) <= hi for x in lists)
    assert init_store._store_ports(topo, {"SLURM_STEP_ID": "1"}, (29500, 29999)) == \
        init_store._store_ports(topo, {"SLURM_STEP_ID": "1"}, (29500, 29999))        # every rank of the step agrees
