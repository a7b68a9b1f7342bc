"""Interface specs, automatic filtering, and verification by real connections between processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcring.bootstrap import netif_choice, netif_list, netif_probe
from hpcring.bootstrap.netif_choice import InterfaceSpec, parse_spec, select_candidates
from hpcring.bootstrap.netif_list import Interface
from hpcring.bootstrap.store_server import StoreServer
from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact

SECRET = b"netif-test-secret-" + b"9" * 20
SRC = str(Path(__file__).resolve().parents[2] / "src")

FAKE = [
    Interface("lo", "127.0.0.1", 8, loopback=True),
    Interface("docker0", "172.17.0.1", 16),
    Interface("virbr0", "192.168.122.1", 24),
    Interface("veth12ab", "10.9.0.1", 24),
    Interface("eth0", "169.254.3.4", 16),            # link-local only
    Interface("eth1", "10.1.0.5", 24, up=False),
    Interface("eth2", "10.2.0.5", 24, speed=10000),
    Interface("enp65s0", "10.3.0.5", 24, speed=25000),
    Interface("ib0", "10.4.0.5", 16, speed=100000),
]


def names(ifaces):
    return [f.name for f in ifaces]


# ------------------------------------------------------------------------------------ specs

@pytest.mark.parametrize("text, expected", [
    ("^docker,lo", InterfaceSpec(("docker", "lo"), exclude=True, exact=False)),
    ("=eth0", InterfaceSpec(("eth0",), exclude=False, exact=True)),
    ("^=eth0,ib0", InterfaceSpec(("eth0", "ib0"), exclude=True, exact=True)),
    (" ib , eth ", InterfaceSpec(("ib", "eth"))),
    ("", None),
    (None, None),
])
def test_parse_spec(text, expected):
    assert parse_spec(text) == expected


def test_parse_spec_rejects_empty_lists():
    with pytest.raises(BootstrapError, match="names no interface"):
        parse_spec("^ , ")


def test_exact_vs_prefix_matching():
    assert parse_spec("eth").matches("eth10") and not parse_spec("=eth").matches("eth10")
    assert parse_spec("=eth0").matches("eth0")


# ------------------------------------------------------------------------------------ selection

def test_auto_rules_drop_loopback_bridges_linklocal_down_and_order_by_fabric_then_speed():
    assert names(select_candidates(FAKE)) == ["ib0", "enp65s0", "eth2"]


@pytest.mark.parametrize("iface, reason", [
    (FAKE[0], "loopback"), (FAKE[1], "container"), (FAKE[2], "container"), (FAKE[3], "veth"),
    (FAKE[4], "link-local"), (FAKE[5], "down"), (FAKE[6], None)])
def test_auto_reject_reasons(iface, reason):
    got = netif_choice.auto_reject_reason(iface)
    assert (got is None) if reason is None else (reason in got)


def test_include_spec_keeps_its_own_order_and_allows_loopback():
    assert names(select_candidates(FAKE, "eth,ib")) == ["eth0", "eth2", "ib0"]   # eth1 is down
    assert names(select_candidates(FAKE, "=lo")) == ["lo"]
    assert names(select_candidates(FAKE, "=eth2,enp65s0")) == ["eth2", "enp65s0"]


def test_exclude_spec_applies_auto_rules_then_exclusions():
    assert names(select_candidates(FAKE, "^ib")) == ["enp65s0", "eth2"]
    assert names(select_candidates(FAKE, "^=enp65s0")) == ["ib0", "eth2"]


def test_unknown_configured_interface_lists_what_exists():
    with pytest.raises(BootstrapError) as ei:
        select_candidates(FAKE, "=ib7")
    assert "ib7" in str(ei.value) and "eth2 10.2.0.5/24" in str(ei.value)


def test_only_loopback_left_falls_back_to_loopback():
    assert names(select_candidates([FAKE[0], FAKE[1]])) == ["lo"]
    with pytest.raises(BootstrapError, match="no usable network interface"):
        select_candidates([FAKE[1]])


def test_ip_json_parsing():
    text = json.dumps([
        {"ifname": "lo", "flags": ["LOOPBACK", "UP"], "mtu": 65536,
         "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {"ifname": "nosuchif0", "flags": ["BROADCAST"], "mtu": 9000,
         "addr_info": [{"family": "inet", "local": "10.0.0.2", "prefixlen": 24},
                       {"family": "inet6", "local": "fe80::1", "prefixlen": 64}]}])
    got = netif_list._from_ip_json(text)
    assert [(f.name, f.address, f.prefixlen, f.up, f.loopback, f.mtu) for f in got] == [
        ("lo", "127.0.0.1", 8, True, True, 65536), ("nosuchif0", "10.0.0.2", 24, False, False, 9000)]


def test_this_machine_lists_loopback_both_ways():
    for listing in (netif_list.list_interfaces(), netif_list._from_ioctl()):
        lo = [f for f in listing if f.name == "lo"]
        assert lo and lo[0].address == "127.0.0.1" and lo[0].up and lo[0].prefixlen == 8


# ------------------------------------------------------------------------------------ probes

def test_probe_succeeds_with_right_secret_and_fails_with_wrong_one(caplog):
    lst = netif_probe.ProbeListener("127.0.0.1", SECRET)
    try:
        assert netif_probe.probe("127.0.0.1", lst.port, SECRET) is None
        with caplog.at_level("WARNING", logger="hpcring.bootstrap.netif"):
            err = netif_probe.probe("127.0.0.1", lst.port, b"other job", timeout=1)
            time.sleep(0.2)
        assert err is not None
        assert any("unauthenticated peer 127.0.0.1" in r.getMessage() for r in caplog.records)
    finally:
        lst.close()


def test_probe_connect_hands_the_authenticated_socket_to_both_sides():
    got = []

    def echo_once(conn):
        got.append(conn.recv(5))
        conn.sendall(b"back")

    lst = netif_probe.ProbeListener("127.0.0.1", SECRET, on_authenticated=echo_once)
    try:
        with netif_probe.probe_connect("127.0.0.1", lst.port, SECRET) as s:
            s.sendall(b"hello")
            assert recv_exact(s, 4) == b"back"
        with pytest.raises(netif_probe.ProbeFailed):
            netif_probe.probe_connect("127.0.0.1", lst.port, b"other job", timeout=1)
    finally:
        lst.close()
    assert got == [b"hello"]   # the hook never ran for the unauthenticated peer


def test_list_links_includes_loopback_with_state_and_mtu():
    lo = [link for link in netif_list.list_links() if link.name == "lo"]
    assert lo and lo[0].state == "up" and lo[0].mtu > 0
    assert netif_list.Link("x", up=True, carrier=False, mtu=1500).state == "no-carrier"
    assert netif_list.Link("x", up=False, carrier=False, mtu=1500).state == "down"


def test_probe_refused_and_blackholed_fail_within_the_connect_timeout():
    refused = netif_probe.ProbeListener("127.0.0.1", SECRET, listen=False)
    hole = netif_probe.ProbeListener("127.0.0.1", SECRET, listen="blackhole")
    try:
        t0 = time.monotonic()
        assert "Refused" in netif_probe.probe("127.0.0.1", refused.port, SECRET, timeout=1.0)
        t1 = time.monotonic()
        assert "timed out" in netif_probe.probe("127.0.0.1", hole.port, SECRET, timeout=1.0)
        t2 = time.monotonic()
    finally:
        refused.close()
        hole.close()
    assert t1 - t0 < 0.5 and 0.9 <= t2 - t1 < 1.8


# ------------------------------------------------------------------------------------ verification

RANK_SCRIPT = r"""
import json, sys, time
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap import netif_choice, netif_list, netif_verify
from hpcring.errors import BootstrapError
a = json.loads(sys.argv[1])
c = StoreClient("127.0.0.1", a["port"], a["secret"].encode(), timeout=30)
if a["cands"] is None:
    cands = netif_choice.select_candidates(netif_list.list_interfaces(), a["spec"])
else:
    cands = [netif_list.Interface(**d) for d in a["cands"]]
t0 = time.monotonic()
try:
    choice = netif_verify.verify_interfaces(c, rank=a["rank"], size=a["size"], host=f"h{a['rank']}",
                                            candidates=cands, secret=a["secret"].encode(), mode=a["mode"],
                                            timeout=30, connect_timeout=2.0, prefix=a["prefix"], _dead=a["dead"])
    print(json.dumps({"ok": list(choice.mine.__dict__.values()), "summary": choice.summary,
                      "s": time.monotonic() - t0}))
except BootstrapError as e:
    print(json.dumps({"error": str(e), "s": time.monotonic() - t0}))
"""


def run_ranks(size, *, spec="=lo", cands=None, dead=None, mode="ring"):
    """Run ``size`` ranks as processes against one store; returns each rank's JSON result."""
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    env = {**os.environ, "PYTHONPATH": SRC}
    try:
        procs = []
        for r in range(size):
            arg = {"port": srv.port, "secret": SECRET.decode(), "rank": r, "size": size, "spec": spec,
                   "cands": cands(r) if cands else None, "dead": (dead or {}).get(r, []),
                   "mode": mode, "prefix": "t"}
            procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, json.dumps(arg)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * size, outs
        return [json.loads(o) for o, _ in outs]
    finally:
        srv.close()


def test_verification_on_loopback_when_configured():
    results = run_ranks(4, spec="=lo")
    assert [r["ok"] for r in results] == [[r, f"h{r}", "lo", "127.0.0.1"] for r in range(4)]
    assert {r["summary"] for r in results} == {"0->h0 lo 127.0.0.1, 1->h1 lo 127.0.0.1, 2->h2 lo 127.0.0.1, "
                                               "3->h3 lo 127.0.0.1"}


def test_all_pairs_mode_agrees_too():
    results = run_ranks(3, spec="=lo", mode="all")
    assert [r["ok"] for r in results] == [[r, f"h{r}", "lo", "127.0.0.1"] for r in range(3)]
    assert len({r["summary"] for r in results}) == 1


def iface(name, address="127.0.0.1"):
    return {"name": name, "address": address, "prefixlen": 8}


def test_names_may_differ_per_host_and_first_working_candidate_wins():
    # Rank 1's preferred candidate is dead; its second one works. Others' names differ from rank 1's.
    def cands(r):
        return [iface("ibp65s0"), iface("eth0")] if r == 1 else [iface("ib0"), iface("eth0")]
    results = run_ranks(3, cands=cands, dead={1: ["ibp65s0"]})
    assert [r["ok"][2] for r in results] == ["ib0", "eth0", "ib0"]
    assert {r["summary"] for r in results} == {"0->h0 ib0 127.0.0.1, 1->h1 eth0 127.0.0.1, 2->h2 ib0 127.0.0.1"}


def test_dead_configured_interface_fails_fast_and_names_hosts_interfaces_addresses():
    t0 = time.monotonic()
    results = run_ranks(3, cands=lambda r: [iface("ib0")], dead={1: ["ib0"]})
    wall = time.monotonic() - t0
    errors = [r.get("error") for r in results]
    assert all(errors), results                      # every rank fails, none hangs
    assert max(r["s"] for r in results) < 15.0
    assert wall < 15.0 + 5.0                         # includes starting three interpreters
    msg = errors[0]
    assert "rank 1 on h1 unreachable from rank 0 on h0" in msg
    assert "ib0 127.0.0.1:" in msg and "timed out" in msg
    assert "Interfaces that did connect: h0 ib0 127.0.0.1, h2 ib0 127.0.0.1" in msg
    print(f"dead-interface time to error: {max(r['s'] for r in results):.2f}s")


def test_mode_none_takes_first_candidate_without_connecting():
    results = run_ranks(2, cands=lambda r: [iface("ib0"), iface("eth0")], dead={0: ["ib0"], 1: ["ib0"]},
                        mode="none")
    assert [r["ok"][2] for r in results] == ["ib0", "ib0"]


def test_choice_summary_stays_one_line_at_any_size():
    from hpcring.bootstrap.netif_verify import SUMMARY_RUNS, _summarise
    table = [[r, f"node{r // 8}", "ib0", f"10.0.{r // 8}.{r % 8}"] for r in range(4096)]
    text = _summarise(table)
    assert text.startswith("0->node0 ib0 10.0.0.0, 1->node0 ib0 10.0.0.1")
    assert text.count("->") == SUMMARY_RUNS and text.endswith(f"... ({4096 - SUMMARY_RUNS} more runs)")
