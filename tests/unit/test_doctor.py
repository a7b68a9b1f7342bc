"""hpcring doctor: the checks on synthetic per-node facts, the verdict, a thread-simulated world
(real store, probes and transfers on loopback); two real ranks through the CLI are in
tests/integration/test_doctor_local.py."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.bootstrap.topology import Topology
from hpcring.diagnostics import doctor as d
from hpcring.errors import BootstrapError, UsageError

UP = {"state": "up", "mtu": 1500}


def fact(rank, host, *, iface="eth0", links=None, addrs=None, env=None, site="=eth0", hcas=()):
    """One rank's facts as collect_facts would publish them; node i has eth0 10.0.0.i and ib0."""
    i = int(host[-1])
    return {"rank": rank, "host": host, "interface": iface, "address": f"10.0.0.{i}",
            "links": links if links is not None else {"lo": {"state": "up", "mtu": 65536}, "eth0": dict(UP),
                                                      "ib0": {"state": "up", "mtu": 2044}},
            "addrs": addrs if addrs is not None else {"lo": ["127.0.0.1/8"], "eth0": [f"10.0.0.{i}/24"],
                                                      "ib0": [f"10.1.0.{i}/24"]},
            "hcas": list(hcas), "env": dict(env or {}),
            "site": {"name": "mysite", "spec": site, "hcas": []} if site else None}


def world(n_hosts=3, per=2, **kw):
    return [fact(r, f"node{r // per + 1}", **kw) for r in range(n_hosts * per)]


def by_name(checks):
    return {c.name: c for c in checks}


# ------------------------------------------------------------------------------- interface selection

@pytest.mark.parametrize("syntax,value,usable", [
    ("nccl", "=eth0", ("eth0",)),
    ("nccl", "ib,eth", ("ib0", "eth0")),          # include list keeps its own order
    ("nccl", "^ib", ("eth0",)),                   # exclude: auto rules (no lo) minus ib*
    ("exact", "eth0,ib0", ("eth0", "ib0")),
    ("ompi", "10.1.0.0/24", ("ib0",)),             # Open MPI takes subnets too
    ("ompi", "eth0", ("eth0",)),
])
def test_select_resolves_each_syntax_like_its_framework(syntax, value, usable):
    f = fact(0, "node1")
    assert d.select(syntax, value, f["links"], f["addrs"]).usable == usable


def test_select_reports_what_is_absent():
    f = fact(0, "node1")
    sel = d.select("exact", "eth0,eth1", f["links"], f["addrs"])
    assert sel.usable == ("eth0",) and sel.absent == ("eth1",)
    assert d.select("nccl", "=", f["links"], f["addrs"]).error


# ------------------------------------------------------------------------------- interfaces / names / MTU

def test_healthy_world_is_ok_everywhere():
    facts = world(env={"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0",
                       "OMPI_MCA_btl_tcp_if_include": "10.0.0.0/24", "NCCL_IB_HCA": "=mlx5_0"}, hcas=["mlx5_0"])
    checks = by_name(d.evaluate(facts, pairs(facts), ring(facts, [1e9] * 6)))
    assert list(checks) == ["interfaces", "names/MTU", "env", "connectivity eth0", "bandwidth"]
    assert {c.status for c in checks.values()} == {d.OK}, checks
    assert "eth0 up on node[1-3]" in checks["interfaces"].detail
    assert "eth0 with MTU 1500 on node[1-3]" == checks["names/MTU"].detail


def test_configured_interface_missing_on_one_node_fails_naming_it():
    facts = world(site="=dead0")
    for f in facts:   # dead0 exists (down) on node1 and node2, not at all on node3
        if f["host"] != "node3":
            f["links"]["dead0"] = {"state": "down", "mtu": 1500}
            f["addrs"]["dead0"] = ["10.98.0.1/24"]
    c = d.check_interfaces(facts)
    assert c.status == d.FAIL
    assert "site mysite fabric='=dead0' selects nothing usable: dead0 is down on node[1-2]" in c.detail
    assert "site mysite fabric='=dead0' matches no interface (there: lo, eth0, ib0) on node3" in c.detail


def test_exact_list_naming_an_absent_interface_warns():
    c = d.check_interfaces(world(env={"GLOO_SOCKET_IFNAME": "eth0,eth1"}))
    assert c.status == d.WARN and "GLOO_SOCKET_IFNAME='eth0,eth1' names eth1, absent on node[1-3]" in c.detail


def test_interface_without_ipv4_is_not_usable():
    facts = world(env={"NCCL_SOCKET_IFNAME": "=ib0"})
    for f in facts:
        del f["addrs"]["ib0"]
    c = d.check_interfaces(facts)
    assert c.status == d.FAIL and "ib0 has no IPv4 address on node[1-3]" in c.detail


def test_names_and_mtus_differing_between_nodes_warn():
    facts = world()
    for f in facts:
        if f["host"] == "node2":
            f["links"]["eth0"]["mtu"] = 9000
        if f["host"] == "node3":
            f["interface"] = "ib0"
    c = d.check_consistency(facts)
    assert c.status == d.WARN
    assert "the chosen interface differs between nodes: eth0 on node[1-2], ib0 on node3" in c.detail
    assert "MTU of the chosen interface differs: 1500 on node1, 9000 on node2, 2044 on node3" in c.detail


# ------------------------------------------------------------------------------- env consistency

def test_nccl_ib_hca_prefix_without_equals_warns_and_names_the_extra_devices():
    c = d.check_env(world(env={"NCCL_IB_HCA": "mlx5_1"}, hcas=["mlx5_1", "mlx5_10", "mlx5_11"]))
    assert c.status == d.WARN
    assert "NCCL_IB_HCA='mlx5_1' is a prefix list: mlx5_1 also matches mlx5_10..mlx5_19" in c.detail
    assert "(on node1 also: mlx5_10, mlx5_11)" in c.detail and "write '=mlx5_1'" in c.detail
    assert d.check_env(world(env={"NCCL_IB_HCA": "=mlx5_1"}, hcas=["mlx5_1", "mlx5_10"])).status == d.OK
    assert d.check_env(world(env={"NCCL_IB_HCA": "^mlx5_1"}, hcas=["mlx5_0"])).status == d.OK


def test_nccl_ib_hca_naming_an_absent_device_fails_where_other_hcas_exist():
    c = d.check_env(world(env={"NCCL_IB_HCA": "=mlx5_3"}, hcas=["mlx5_0"]))
    assert c.status == d.FAIL and "NCCL_IB_HCA names mlx5_3, absent on node1 (there: mlx5_0)" in c.detail


def test_nccl_ib_hca_contradicting_the_site_hcas_warns():
    facts = world(env={"NCCL_IB_HCA": "=mlx5_0"}, hcas=["mlx5_0", "mlx5_1"])
    for f in facts:
        f["site"]["hcas"] = ["mlx5_1"]
    c = d.check_env(facts)
    assert c.status == d.WARN and "contradicts site mysite fabric.hcas (mlx5_1)" in c.detail


@pytest.mark.parametrize("var,value,picked", [
    ("NCCL_SOCKET_IFNAME", "=ib0", "ib0"),
    ("GLOO_SOCKET_IFNAME", "ib0", "ib0"),
    ("OMPI_MCA_btl_tcp_if_include", "10.1.0.0/24", "ib0"),
])
def test_framework_variable_contradicting_the_site_config_warns(var, value, picked):
    c = d.check_env(world(env={var: value}))
    assert c.status == d.WARN
    assert f"{var}={value!r} selects {picked} but site mysite fabric '=eth0' selects eth0 on node[1-3]" in c.detail


def test_without_a_site_variables_are_compared_with_the_chosen_interface():
    c = d.check_env(world(site=None, env={"NCCL_SOCKET_IFNAME": "ib"}))
    assert c.status == d.WARN and "selects ib0 but hpcring.init() selects eth0" in c.detail


def test_variable_differing_between_ranks_warns_naming_ranks_and_hosts():
    facts = world(env={"NCCL_SOCKET_IFNAME": "=eth0"})
    for f in facts[4:]:
        f["env"]["NCCL_SOCKET_IFNAME"] = "=ib0"
    facts[3]["env"].pop("NCCL_SOCKET_IFNAME")
    c = d.check_env(facts)
    assert c.status == d.WARN
    assert ("NCCL_SOCKET_IFNAME differs between ranks: '=eth0' on ranks 0-2 (node[1-2]), unset on rank 3 (node2), "
            "'=ib0' on ranks 4-5 (node3)") in c.detail


def test_a_fabric_differing_between_ranks_warns_since_auto_would_pick_different_backends():
    facts = world(env={"HPCRING_FABRIC": "tcp"})
    facts[5]["env"]["HPCRING_FABRIC"] = "infiniband"
    c = d.check_env(facts)
    assert c.status == d.WARN
    assert "HPCRING_FABRIC differs between ranks: 'tcp' on ranks 0-4 (node[1-3]), 'infiniband' on rank 5 (node3)" \
        in c.detail


# ------------------------------------------------------------------------------- connectivity / bandwidth

def pairs(facts, err_for=lambda s, t: None, label=d.CHOSEN):
    return [{label: {str(t): {"err": err_for(s, t), "ms": None if err_for(s, t) else 0.2 + s * 0.01}
                     for t in range(len(facts)) if t != s}} for s in range(len(facts))]


def test_all_pairs_connected_reports_latency():
    facts = world()
    (c,) = d.check_connectivity(facts, pairs(facts))
    assert c.name == "connectivity eth0" and c.status == d.OK
    assert "all 30 ordered pairs" in c.detail and "max 0.25 ms (rank 5 on node3" in c.detail


def test_unreachable_pairs_fail_grouped_by_hosts():
    facts = world()
    cut = lambda s, t: "timed out after 2.0s" if facts[t]["host"] == "node2" and facts[s]["host"] != "node2" else None
    (c,) = d.check_connectivity(facts, pairs(facts, cut))
    assert c.status == d.FAIL and c.detail.startswith("8 of 30 pairs failed")
    assert "node1 -> node2 eth0 10.0.0.2: timed out after 2.0s (ranks 0-1 -> 2-3)" in c.detail
    assert "node3 -> node2 eth0 10.0.0.2: timed out after 2.0s (ranks 4-5 -> 2-3)" in c.detail


def test_a_configured_interface_other_than_the_chosen_one_is_probed_too():
    facts = world(env={"NCCL_SOCKET_IFNAME": "=ib0"})
    assert d._targets(facts[0]) == {d.CHOSEN: ("eth0", "10.0.0.1"), "NCCL_SOCKET_IFNAME": ("ib0", "10.1.0.1")}
    conn = [{**a, **b} for a, b in zip(pairs(facts), pairs(facts, lambda s, t: "refused", "NCCL_SOCKET_IFNAME"))]
    checks = by_name(d.check_connectivity(facts, conn))
    assert checks["connectivity eth0"].status == d.OK
    assert checks["connectivity ib0 (NCCL_SOCKET_IFNAME)"].status == d.FAIL


def ring(facts, rates, errors=None):
    n = len(facts)
    return [{"src": i, "dst": (i + 1) % n, "rate": rates[i], "bytes": int(rates[i] * 0.6), "seconds": 0.6,
             **({"error": errors[i]} if errors and errors.get(i) else {})} for i in range(n)]


def test_slow_link_under_half_the_median_is_named_with_ranks_hosts_and_interface():
    facts = world()
    # links 0->1, 2->3, 4->5 stay on a node; 1->2, 3->4, 5->0 cross nodes; 1->2 is the slow one
    c = d.check_bandwidth(facts, ring(facts, [3e9, 2.4e7, 3e9, 1.1e9, 3e9, 1.0e9]))
    assert c.status == d.FAIL
    assert ("slow link rank 1 on node1 -> rank 2 on node2 via eth0 (10.0.0.1 -> 10.0.0.2): 0.19 Gbit/s = 24 MB/s, "
            "under 0.5x the median of inter-node ring links (8.00 Gbit/s = 1000 MB/s)") in c.detail
    assert c.detail.count("slow link") == 1


def test_links_are_compared_within_their_class_only():
    facts = world()
    # inter-node links at a quarter of loopback speed are not slow: they are compared with each other
    c = d.check_bandwidth(facts, ring(facts, [4e9, 1e9, 4e9, 1e9, 4e9, 0.9e9]))
    assert c.status == d.OK and "slowest rank 5 on node3 -> rank 0 on node1" in c.detail
    # just above half the median is not slow either
    assert d.check_bandwidth(facts, ring(facts, [4e9, 1e9, 4e9, 1e9, 4e9, 0.51e9])).status == d.OK
    assert d.check_bandwidth(facts, ring(facts, [4e9, 1e9, 4e9, 1e9, 4e9, 0.49e9])).status == d.FAIL


def test_failed_link_measurement_fails():
    facts = world()
    c = d.check_bandwidth(facts, ring(facts, [1e9] * 6, {3: "timed out after 2.0s"}))
    assert c.status == d.FAIL and "link rank 3 on node2 -> rank 4 on node3 via eth0" in c.detail


# ------------------------------------------------------------------------------- verdict

def test_verdict_and_exit_code():
    ok, warn, fail = d.Check("a", d.OK, "x"), d.Check("b", d.WARN, "y"), d.Check("c", d.FAIL, "z")
    hosts = ["n1", "n1", "n2"]
    assert (d.DoctorReport([ok], hosts).verdict, d.DoctorReport([ok], hosts).exit_code) == (d.OK, 0)
    assert (d.DoctorReport([ok, warn], hosts).verdict, d.DoctorReport([ok, warn], hosts).exit_code) == (d.WARN, 0)
    r = d.DoctorReport([ok, warn, fail], hosts, job_id="7")
    assert (r.verdict, r.exit_code) == (d.FAIL, 1)
    assert r.verdict_line() == "verdict: FAIL: 1 failed (c); 1 warning(s) (b)"
    text = r.format()
    assert text.splitlines()[0] == "hpcring doctor: 3 ranks on 2 hosts: n1 (ranks 0-1), n2 (rank 2), job 7"
    assert text.splitlines()[1].split() == ["CHECK", "STATUS", "DETAIL"]
    assert text.splitlines()[-1] == r.verdict_line()
    again = d.DoctorReport.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again.checks == r.checks and again.exit_code == 1 and again.hosts == hosts


def test_options_are_checked():
    with pytest.raises(UsageError, match="--timeout"):
        d.Options(timeout=0).check()
    with pytest.raises(UsageError, match="--bw-seconds"):
        d.Options(bw_seconds=-1).check()


# ------------------------------------------------------------------------------- a thread-simulated world

SECRET = "ab" * 32


def run_world(size, ranks=None, timeout=20.0, bw_seconds=0.1):
    """Ranks as threads on loopback with a real store: ``{rank: report or exception}``."""
    hosts = tuple(f"h{r // 2}" for r in range(size))
    server = StoreServer("127.0.0.1", 0, secret=SECRET.encode())
    env = {"HPCRING_SECRET": SECRET}
    out = {}

    def one(rank):
        topo = Topology(rank=rank, size=size, local_rank=rank % 2, local_size=2, node_rank=rank // 2,
                        num_nodes=(size + 1) // 2, hosts=hosts, launcher="local", job_id="t",
                        interface="lo", address="127.0.0.1")
        store = StoreClient("127.0.0.1", server.port, SECRET.encode(), 30)
        session = SimpleNamespace(topology=topo, store=store, secret=store.secret)
        try:
            out[rank] = d.run_doctor(session, d.Options(timeout=timeout, bw_seconds=bw_seconds), env)
        except Exception as e:   # noqa: BLE001 - the test inspects it
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (ranks if ranks is not None else range(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    server.close()
    return out


def test_every_rank_gets_the_same_report_with_all_pairs_and_ring_links():
    out = run_world(3)
    assert all(isinstance(r, d.DoctorReport) for r in out.values()), out
    assert {r.verdict_line() for r in out.values()} == {out[0].verdict_line()}
    checks = by_name(out[0].checks)
    assert "all 6 ordered pairs connect and authenticate" in checks["connectivity lo"].detail
    assert len(out[0].data["links"]) == 3 and all("rate" in lk for lk in out[0].data["links"])


def test_a_rank_that_never_runs_the_doctor_is_named_on_every_rank():
    out = run_world(3, ranks=[0, 1], timeout=3.0)
    for rank in (0, 1):
        assert isinstance(out[rank], BootstrapError), out
        assert "rank 2 on h1 did not report its facts" in out[rank].message
