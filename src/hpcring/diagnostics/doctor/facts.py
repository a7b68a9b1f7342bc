"""Step 1 of the doctor, per rank: what this node has (interfaces, HCAs, the variables frameworks read,
the site's interface spec) and what each configured interface spec selects."""
from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from hpcring.bootstrap import netif_choice, netif_list
from hpcring.errors import BootstrapError, HpcringError
from hpcring.diagnostics.doctor.model import CHOSEN, ENV_VARS, IFACE_VARS


def collect_facts(topology, environ: Mapping[str, str] | None = None) -> dict:
    """This rank's view of its node, as JSON-able data: interfaces with state, MTU and IPv4
    addresses, InfiniBand devices, the framework variables, and the site config's interface spec."""
    env = os.environ if environ is None else environ
    addrs: dict[str, list[str]] = {}
    for f in netif_list.list_interfaces():
        addrs.setdefault(f.name, []).append(f"{f.address}/{f.prefixlen}")
    return {"rank": topology.rank, "host": topology.host, "interface": topology.interface,
            "address": topology.address,
            "links": {lk.name: {"state": lk.state, "mtu": lk.mtu} for lk in netif_list.list_links()},
            "addrs": addrs, "hcas": _hcas(), "env": {v: env[v] for v in ENV_VARS if v in env},
            "site": site_facts(env)}


def _hcas() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:   # no RDMA devices, or no sysfs here
        return []


def site_facts(env: Mapping[str, str]) -> dict | None:
    """The site config named by HPCRING_SITE (job scripts export it): its interface spec and HCAs."""
    ref = env.get("HPCRING_SITE")
    if not ref:
        return None
    from hpcring.config.fabric import bootstrap_spec  # deferred: pulls pydantic
    from hpcring.config.site import load_site  # deferred: pulls pydantic, yaml
    try:
        site = load_site(ref, env)
    except HpcringError as e:
        return {"name": ref, "error": str(e).splitlines()[0]}
    fab = site.config.fabric
    return {"name": site.name, "spec": bootstrap_spec(fab), "hcas": [h.split(":")[0] for h in fab.hcas]}


def iface_sources(fact: Mapping) -> list[tuple[str, str, str]]:
    """``(label, syntax, value)`` of every interface setting this rank has, site config first."""
    out = []
    site = fact.get("site") or {}
    if site.get("spec"):
        out.append((f"site {site['name']} fabric", "nccl", site["spec"]))
    env = fact.get("env", {})
    out += [(var, syntax, env[var]) for var, syntax in IFACE_VARS if env.get(var, "").strip()]
    return out


@dataclass(frozen=True)
class Selection:
    """What one interface setting selects on one node. ``usable``: matched, up and with IPv4."""
    matched: tuple[str, ...]
    usable: tuple[str, ...]
    absent: tuple[str, ...]       # exact names / patterns / subnets that match nothing here
    error: str | None = None


def select(syntax: str, value: str, links: Mapping[str, dict], addrs: Mapping[str, list]) -> Selection:
    """Resolve an interface setting on a node with ``links`` ({name: {state, mtu}}) and ``addrs``
    ({name: ["a.b.c.d/len", ...]}), the way the framework that reads it would."""
    if syntax == "nccl":
        try:
            spec = netif_choice.parse_spec(value)
        except BootstrapError as e:
            return Selection((), (), (), e.message)
        if spec is None:
            return Selection((), (), ())
        if spec.exclude:
            matched = [n for n in links if not spec.matches(n) and n != "lo"
                       and not n.startswith(netif_choice.AUTO_EXCLUDED_PREFIXES)]
            absent: list[str] = []
        else:
            matched = sorted((n for n in links if spec.matches(n)), key=spec.rank_of)
            absent = [p for p in spec.names
                      if not any(netif_choice.InterfaceSpec((p,), exact=spec.exact).matches(n) for n in links)]
    else:
        matched, absent = [], []
        for entry in (e.strip() for e in value.split(",") if e.strip()):
            hits = _subnet_members(entry, addrs) if syntax == "ompi" and "/" in entry else \
                ([entry] if entry in links else [])
            matched += [h for h in hits if h not in matched]
            if not hits:
                absent.append(entry)
    usable = [n for n in matched if links.get(n, {}).get("state") == "up" and addrs.get(n)]
    return Selection(tuple(matched), tuple(usable), tuple(absent))


def _subnet_members(cidr: str, addrs: Mapping[str, list]) -> list[str]:
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return []
    return [n for n, lst in addrs.items() if any(ipaddress.ip_interface(a).ip in net for a in lst)]


def _targets(fact: Mapping) -> dict[str, tuple[str, str]]:
    """``{label: (interface, address)}`` this rank is probed on: the chosen interface, and the first
    usable interface of each configured setting that selects another one."""
    out = {}
    if fact.get("interface") and fact.get("address"):
        out[CHOSEN] = (fact["interface"], fact["address"])
    for label, syntax, value in iface_sources(fact):
        sel = select(syntax, value, fact["links"], fact["addrs"])
        if sel.usable and sel.usable[0] != fact.get("interface"):
            name = sel.usable[0]
            out[label] = (name, fact["addrs"][name][0].split("/")[0])
    return out

