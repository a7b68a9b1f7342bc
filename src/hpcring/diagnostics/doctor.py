"""``hpcring doctor``: is this allocation's network fit for collectives? One report for the whole job.

Every rank runs :func:`run_doctor` (collectively: ``hpcring run -- hpcring doctor``, ``srun``,
``mpirun``, or a submitted script); each gets the same :class:`DoctorReport`, rank 0 prints it.
The side channel is the session's authenticated store (``hpcring.init()``); every connection
between ranks is authenticated with the job secret by the interface probe of
:mod:`hpcring.bootstrap.netif` before a byte of payload flows. Steps, each bounded by one deadline
(``Options.timeout`` from the start):

1. facts: each rank lists its node's interfaces (name, state, MTU, IPv4 addresses), InfiniBand
   devices, the variables NCCL, Gloo and Open MPI read, and its site config's interface spec; it
   opens probe listeners (see 2 and 3) and publishes all that; rank 0 gathers it into one key.
2. connectivity: every rank probes every other rank (all pairs) on the interface ``hpcring.init()``
   chose, and on each other interface a configured variable selects; reachability in parallel,
   then latency as the best of a few sequential connect+authenticate round trips.
3. bandwidth: ring links rank i -> i+1 (mod n), one at a time (a token passed through the store,
   so no two transfers share a CPU or a link): a timed bulk transfer over an authenticated probe
   connection, the receiver acknowledging the byte count; best of ``BW_ROUNDS``.
4. rank 0 evaluates the checks with the pure functions below (unit-tested on synthetic facts) and
   publishes the report; when a rank is missing, rank 0 publishes the error instead, naming it, so
   every rank fails with the same message before the deadline.

Status rules: FAIL for what breaks or hangs jobs (a configured interface missing or down on some
node, an unreachable pair, a slow ring link: under half the median of its class, inter-node links
compared with inter-node links and intra-node with intra-node); WARN for what is suspicious but
may work (NCCL_IB_HCA as a prefix list, names or MTUs differing between nodes, variables that
contradict the site config or differ between ranks).
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from statistics import median

from hpcring.bootstrap import netif
from hpcring.bootstrap.init import describe_ranks
from hpcring.bootstrap.store import StoreTimeoutError, load_secret
from hpcring.diagnostics.report import rank_ranges
from hpcring.errors import BootstrapError, HpcringError, UsageError
from hpcring.netio import recv_exact

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_ORDER = {OK: 0, WARN: 1, FAIL: 2}

# What frameworks read to pick interfaces and HCAs; compared with the site config and between ranks.
ENV_VARS = ("HPCRING_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include",
            "OMPI_MCA_oob_tcp_if_include", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX",
            "UCX_NET_DEVICES", "HPCRING_SITE")
# (variable, syntax): "nccl" = NCCL_SOCKET_IFNAME syntax, "exact" = comma list of names,
# "ompi" = comma list of names or CIDR subnets (Open MPI's if_include).
IFACE_VARS = (("HPCRING_IFNAME", "nccl"), ("NCCL_SOCKET_IFNAME", "nccl"), ("GLOO_SOCKET_IFNAME", "exact"),
              ("OMPI_MCA_btl_tcp_if_include", "ompi"), ("OMPI_MCA_oob_tcp_if_include", "ompi"))
CHOSEN = "chosen"               # target label of the interface hpcring.init() verified

SLOW_FACTOR = 0.5               # a ring link under this fraction of its class's median is slow
DEFAULT_TIMEOUT = 60.0
DEFAULT_BW_SECONDS = 0.6        # per ring link, all rounds together
BW_ROUNDS = 2                   # best of: one round disturbed by another process does not flag a link
CHUNK = 256 * 1024
CONNECT_TIMEOUT = 2.0
LATENCY_TRIES = 3
GATHER_MARGIN_S = 2.0           # rank 0 gives up this much before the others, to tell them why
_COUNT = struct.Struct(">Q")
_STEP_NAMES = {"facts": "facts", "conn": "connectivity results", "bw": "ring link measurement",
               "bw2": "ring link re-measurement"}


@dataclass(frozen=True)
class Options:
    """``timeout``: seconds from the start by which every rank returns or raises (every wait is
    bounded by it). ``bw_seconds``: bulk-transfer time per ring link (shrunk when n links would not
    fit in half the timeout)."""
    timeout: float = DEFAULT_TIMEOUT
    bw_seconds: float = DEFAULT_BW_SECONDS
    connect_timeout: float = CONNECT_TIMEOUT

    def check(self) -> "Options":
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, not {self.timeout}")
        if self.bw_seconds <= 0:
            raise UsageError(f"--bw-seconds must be > 0, not {self.bw_seconds}")
        return self


@dataclass(frozen=True)
class Check:
    name: str
    status: str     # OK, WARN or FAIL
    detail: str


@dataclass
class DoctorReport:
    """The verdict of one doctor run, the same on every rank. ``data`` holds what it is based on
    (per-rank facts, pair probes, ring links) for ``--json``."""
    checks: list[Check]
    hosts: list[str]
    job_id: str | None = None
    started: float = 0.0        # epoch seconds (time.time()), rank 0's clock
    finished: float = 0.0
    data: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return max((c.status for c in self.checks), key=_ORDER.__getitem__, default=OK)

    @property
    def exit_code(self) -> int:
        """1 when any check FAILed (every rank exits with it); WARN alone is 0."""
        return 1 if self.verdict == FAIL else 0

    def verdict_line(self) -> str:
        bad = [c.name for c in self.checks if c.status == FAIL]
        warn = [c.name for c in self.checks if c.status == WARN]
        parts = ([f"{len(bad)} failed ({', '.join(bad)})"] if bad else []) + \
                ([f"{len(warn)} warning(s) ({', '.join(warn)})"] if warn else [])
        return f"verdict: {self.verdict}" + (f": {'; '.join(parts)}" if parts else f": all {len(self.checks)} checks passed")

    def format(self) -> str:
        """The table rank 0 prints: a title, one row per check, the verdict line."""
        rows = [("CHECK", "STATUS", "DETAIL")] + [(c.name, c.status, c.detail) for c in self.checks]
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        lines = [self.title()] + [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
        return "\n".join(lines + [self.verdict_line()])

    def title(self) -> str:
        """``hpcring doctor: 6 ranks on 3 hosts: node1 (ranks 0-1), ..., job 42``."""
        hosts = _distinct(self.hosts)
        ranks = {h: [i for i, x in enumerate(self.hosts) if x == h] for h in hosts}
        layout = ", ".join(f"{h} ({'rank' if len(rs) == 1 else 'ranks'} {rank_ranges(rs)})" for h, rs in ranks.items())
        return (f"hpcring doctor: {_plural(len(self.hosts), 'rank')} on {_plural(len(hosts), 'host')}: {layout}"
                + (f", job {self.job_id}" if self.job_id else ""))

    def to_dict(self, with_data: bool = True) -> dict:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "job_id": self.job_id,
                "hosts": self.hosts, "started": self.started, "finished": self.finished,
                "checks": [asdict(c) for c in self.checks], **(self.data if with_data else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "DoctorReport":
        extra = {k: v for k, v in d.items() if k not in
                 ("verdict", "exit_code", "job_id", "hosts", "started", "finished", "checks")}
        return cls([Check(**c) for c in d["checks"]], list(d["hosts"]), d.get("job_id"),
                   d.get("started", 0.0), d.get("finished", 0.0), extra)


# =============================================================================== facts (per rank)

def collect_facts(topology, environ: Mapping[str, str] | None = None) -> dict:
    """This rank's view of its node, as JSON-able data: interfaces with state, MTU and IPv4
    addresses, InfiniBand devices, the framework variables, and the site config's interface spec."""
    env = os.environ if environ is None else environ
    addrs: dict[str, list[str]] = {}
    for f in netif.list_interfaces():
        addrs.setdefault(f.name, []).append(f"{f.address}/{f.prefixlen}")
    return {"rank": topology.rank, "host": topology.host, "interface": topology.interface,
            "address": topology.address,
            "links": {lk.name: {"state": lk.state, "mtu": lk.mtu} for lk in netif.list_links()},
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
    from hpcring.config.fabric import bootstrap_spec
    from hpcring.config.site import load_site
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
            spec = netif.parse_spec(value)
        except BootstrapError as e:
            return Selection((), (), (), e.message)
        if spec is None:
            return Selection((), (), ())
        if spec.exclude:
            matched = [n for n in links if not spec.matches(n) and n != "lo"
                       and not n.startswith(netif.AUTO_EXCLUDED_PREFIXES)]
            absent: list[str] = []
        else:
            matched = sorted((n for n in links if spec.matches(n)), key=spec.rank_of)
            absent = [p for p in spec.names
                      if not any(netif.InterfaceSpec((p,), exact=spec.exact).matches(n) for n in links)]
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


# =============================================================================== checks (pure)

def evaluate(facts: Sequence[Mapping], conn: Sequence[Mapping] = (), links: Sequence[Mapping] = (),
             bw_seconds: float = DEFAULT_BW_SECONDS) -> list[Check]:
    """Every check, from every rank's facts, pair probes (``conn[r]`` = rank r's results) and ring
    link measurements. Pure: the unit tests feed synthetic data."""
    checks = [check_interfaces(facts), check_consistency(facts), check_env(facts)]
    if len(facts) > 1:
        checks += check_connectivity(facts, conn)
        checks.append(check_bandwidth(facts, links, bw_seconds))
    return checks


def _by_host(facts: Sequence[Mapping]) -> dict[str, Mapping]:
    """The first rank's facts of each host (node facts are the same for every rank there)."""
    out: dict[str, Mapping] = {}
    for f in facts:
        out.setdefault(f["host"], f)
    return out


def check_interfaces(facts: Sequence[Mapping]) -> Check:
    """Every configured interface setting selects an interface that exists, is up and has IPv4 on
    every node (FAIL otherwise; WARN when an exact list names some interface absent on a node)."""
    problems: dict[tuple[str, str], list[str]] = {}
    chosen: dict[str, dict[str, list[str]]] = {}     # interface -> label -> hosts
    for host, f in _by_host(facts).items():
        for label, syntax, value in iface_sources(f):
            sel = select(syntax, value, f["links"], f["addrs"])
            if sel.usable:
                chosen.setdefault(sel.usable[0], {}).setdefault(label, []).append(host)
                if sel.absent:
                    problems.setdefault((WARN, f"{label}={value!r} names {', '.join(sel.absent)}, absent"), []).append(host)
            else:
                problems.setdefault((FAIL, f"{label}={value!r} {_why_unusable(sel, f)}"), []).append(host)
        if f.get("interface") and f["links"].get(f["interface"], {}).get("state") != "up":
            problems.setdefault((FAIL, f"the interface hpcring.init() chose, {f['interface']}, is "
                                       f"{f['links'].get(f['interface'], {}).get('state', 'gone')}"), []).append(host)
    if problems:
        status = FAIL if any(s == FAIL for s, _ in problems) else WARN
        return Check("interfaces", status, "; ".join(f"{what} on {_hosts(h)}" for (_, what), h in
                                                     sorted(problems.items(), key=lambda kv: -_ORDER[kv[0][0]])))
    if not chosen:
        names = sorted({f.get("interface") or "?" for f in facts})
        return Check("interfaces", OK, f"nothing configured; hpcring.init() chose {', '.join(names)}")
    return Check("interfaces", OK, "; ".join(
        f"{name} up on {_hosts(sorted({h for hs in by.values() for h in hs}, key=_host_order(facts)))} "
        f"(selected by {', '.join(by)})" for name, by in chosen.items()))


def _why_unusable(sel: Selection, f: Mapping) -> str:
    if sel.error:
        return f"is not valid: {sel.error}"
    if not sel.matched:
        return f"matches no interface (there: {', '.join(f['links'])})"
    states = [f"{n} is {f['links'][n]['state']}" if f["links"][n]["state"] != "up" else f"{n} has no IPv4 address"
              for n in sel.matched]
    return "selects nothing usable: " + ", ".join(states)


def check_consistency(facts: Sequence[Mapping]) -> Check:
    """The chosen interface (and each configured setting's) has the same name and MTU on every
    node (WARN otherwise: exact-name variables cannot name two interfaces; MTU mismatches drop
    large frames on some paths)."""
    per_label: dict[str, dict[str, tuple[str, int | None]]] = {}   # label -> host -> (name, mtu)
    for host, f in _by_host(facts).items():
        for label, (name, _addr) in _targets(f).items():
            per_label.setdefault(label, {})[host] = (name, f["links"].get(name, {}).get("mtu"))
    problems = []
    for label, by_host in per_label.items():
        what = "the chosen interface" if label == CHOSEN else f"the interface {label} selects"
        names = _group(by_host, lambda v: v[0])
        if len(names) > 1:
            problems.append(f"{what} differs between nodes: " + ", ".join(f"{n} on {_hosts(h)}" for n, h in names.items()))
        mtus = _group(by_host, lambda v: v[1])
        if len(mtus) > 1:
            problems.append(f"MTU of {what} differs: " + ", ".join(f"{m} on {_hosts(h)}" for m, h in mtus.items()))
    if problems:
        return Check("names/MTU", WARN, "; ".join(problems))
    chosen = per_label.get(CHOSEN, {})
    if not chosen:
        return Check("names/MTU", OK, "no interface to compare")
    (name, mtu), = set(chosen.values())
    return Check("names/MTU", OK, f"{name} with MTU {mtu} on {_hosts(chosen)}")


def check_env(facts: Sequence[Mapping]) -> Check:
    """NCCL_IB_HCA written as an exact list; interface variables agreeing with the site config (or,
    without one, with the interface hpcring.init() chose); every rank seeing the same values."""
    problems: list[tuple[str, str]] = []
    problems += _differs_between_ranks(facts)
    problems += _hca_problems(facts)
    problems += _contradictions(facts)
    for f in _by_host(facts).values():
        if "error" in (f.get("site") or {}):
            problems.append((WARN, f"site config {f['site']['name']} could not be loaded: {f['site']['error']}"))
    if problems:
        status = max((s for s, _ in problems), key=_ORDER.__getitem__)
        return Check("env", status, "; ".join(dict.fromkeys(p for _, p in problems)))
    ref = next((f"site {f['site']['name']} fabric" for f in facts if (f.get("site") or {}).get("spec")), None)
    set_vars = sorted({v for f in facts for v in f.get("env", {}) if v != "HPCRING_SITE"})
    return Check("env", OK, (f"{', '.join(set_vars)} " if set_vars else "no framework variables set; ")
                 + (f"agree with {ref}" if ref else "agree with the chosen interface") + " and between ranks")


def _differs_between_ranks(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    out = []
    hosts = [f["host"] for f in sorted(facts, key=lambda f: f["rank"])]
    for var in ENV_VARS:
        values = _group({f["rank"]: f.get("env", {}).get(var) for f in facts}, lambda v: v)
        if len(values) > 1:
            out.append((WARN, f"{var} differs between ranks: " + ", ".join(
                f"{'unset' if v is None else repr(v)} on {describe_ranks_short(rs, hosts)}" for v, rs in values.items())))
    return out


def describe_ranks_short(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    """``ranks 0-3 (node[1-2])``."""
    hs = _distinct(hosts[r] for r in sorted(ranks) if r < len(hosts))
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)} ({_hosts(hs)})"


def _hca_problems(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    out = []
    for host, f in _by_host(facts).items():
        value = f.get("env", {}).get("NCCL_IB_HCA", "").strip()
        if not value or value.startswith("^"):
            continue
        exact = value.startswith("=")
        names = [e.split(":")[0] for e in value.lstrip("=").split(",") if e.strip()]
        if not exact:
            extra = sorted(d for d in f.get("hcas", []) for n in names if d != n and d.startswith(n) and d not in names)
            seen = f" (on {host} also: {', '.join(extra)})" if extra else ""
            out.append((WARN, f"NCCL_IB_HCA={value!r} is a prefix list: {names[0]} also matches "
                              f"{names[0]}0..{names[0]}9{seen}; write '={value}' for exactly these"))
        present = f.get("hcas", [])
        gone = [n for n in names if exact and n not in present]
        if gone:
            status = FAIL if present else WARN
            there = f"there: {', '.join(present)}" if present else "no InfiniBand devices there; NCCL falls back to sockets"
            out.append((status, f"NCCL_IB_HCA names {', '.join(gone)}, absent on {host} ({there})"))
        site_hcas = (f.get("site") or {}).get("hcas")
        if site_hcas and sorted(names) != sorted(site_hcas):
            out.append((WARN, f"NCCL_IB_HCA={value!r} contradicts site {f['site']['name']} fabric.hcas "
                              f"({', '.join(site_hcas)})"))
    return out


def _contradictions(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    """Per node: a variable whose usable selection does not include the reference interface (the
    site config's choice, else the one hpcring.init() chose)."""
    found: dict[str, list[str]] = {}
    for host, f in _by_host(facts).items():
        sources = iface_sources(f)
        ref_label, ref = "hpcring.init()", f.get("interface")
        if sources and sources[0][0].startswith("site "):
            label, syntax, value = sources[0]
            sel = select(syntax, value, f["links"], f["addrs"])
            if sel.usable:
                ref_label, ref = f"{label} {value!r}", sel.usable[0]
            sources = sources[1:]
        for label, syntax, value in sources:
            sel = select(syntax, value, f["links"], f["addrs"])
            if ref and sel.usable and ref not in sel.usable:
                text = f"{label}={value!r} selects {sel.usable[0]} but {ref_label} selects {ref}"
                found.setdefault(text, []).append(host)
        if ref and f.get("interface") and f["interface"] != ref:
            text = (f"hpcring.init() chose {f['interface']} but {ref_label} selects {ref} "
                    "(HPCRING_IFNAME not set from the site config?)")
            found.setdefault(text, []).append(host)
    return [(WARN, f"{text} on {_hosts(hosts)}") for text, hosts in found.items()]


def check_connectivity(facts: Sequence[Mapping], conn: Sequence[Mapping]) -> list[Check]:
    """One check per probed interface: every ordered pair of ranks connected and authenticated
    (FAIL naming the pairs that did not), with the connect+authenticate latency."""
    facts = sorted(facts, key=lambda f: f["rank"])
    hosts = [f["host"] for f in facts]
    labels = list(dict.fromkeys(lbl for f in facts for lbl in _targets(f)))
    checks = []
    for label in labels:
        fails, lat, total = [], [], 0
        for src, results in enumerate(conn):
            for dst, res in results.get(label, {}).items():
                total += 1
                if res.get("err"):
                    fails.append((src, int(dst), res["err"]))
                elif res.get("ms") is not None:
                    lat.append((res["ms"], src, int(dst)))
        names = _distinct(_targets(f)[label][0] for f in facts if label in _targets(f))
        name = f"connectivity {'/'.join(names)}" + ("" if label == CHOSEN else f" ({label})")
        if not total:
            checks.append(Check(name, WARN, "no pair could be probed (no rank listens there)"))
        elif fails:
            checks.append(Check(name, FAIL, f"{len(fails)} of {total} pairs failed: " + _pair_failures(fails, facts, label)))
        else:
            ms, a, b = max(lat) if lat else (None, 0, 0)
            lat_text = (f"; connect+auth latency median {median(x[0] for x in lat):.2f} ms, max {ms:.2f} ms "
                        f"(rank {a} on {hosts[a]} -> rank {b} on {hosts[b]})") if lat else ""
            checks.append(Check(name, OK, f"all {total} ordered pairs connect and authenticate{lat_text}"))
    return checks


def _pair_failures(fails: list[tuple[int, int, str]], facts: Sequence[Mapping], label: str, limit: int = 6) -> str:
    """Grouped by (source host, target host, error): ``node1 -> node2 dead0 10.98.0.2: timed out (ranks 0-1 -> 2-3)``."""
    groups: dict[tuple, tuple[list, list]] = {}
    for src, dst, err in fails:
        name, addr = _targets(facts[dst]).get(label, ("?", "?"))
        key = (facts[src]["host"], facts[dst]["host"], name, addr, err)
        s, d = groups.setdefault(key, ([], []))
        s.append(src)
        d.append(dst)
    parts = [f"{sh} -> {dh} {name} {addr}: {err} (ranks {rank_ranges(s)} -> {rank_ranges(d)})"
             for (sh, dh, name, addr, err), (s, d) in list(groups.items())[:limit]]
    more = f"; and {len(groups) - limit} more groups" if len(groups) > limit else ""
    return "; ".join(parts) + more


def slow_links(facts: Sequence[Mapping], links: Sequence[Mapping]) -> tuple[list[tuple[Mapping, str, float]], dict]:
    """``([(link, class, class median)] of the slow links, {class: (median, count)})``: a measured
    link is slow when under SLOW_FACTOR times the median of its class (inter-node links against
    inter-node, intra-node against intra-node: a loopback link is no yardstick for a network link)."""
    hosts = [f["host"] for f in sorted(facts, key=lambda f: f["rank"])]
    measured = [lk for lk in links if not lk.get("error")]
    slow, classes = [], {}
    for cls in ("inter-node", "intra-node"):
        members = [lk for lk in measured if _link_class(lk, hosts) == cls]
        if members:
            med = median(lk["rate"] for lk in members)
            classes[cls] = (med, len(members))
            slow += [(lk, cls, med) for lk in members if lk["rate"] < SLOW_FACTOR * med]
    return slow, classes


def check_bandwidth(facts: Sequence[Mapping], links: Sequence[Mapping], bw_seconds: float = DEFAULT_BW_SECONDS) -> Check:
    """Ring links i -> i+1: FAIL naming each link that failed or is slow (see :func:`slow_links`)."""
    facts = sorted(facts, key=lambda f: f["rank"])
    failed = [lk for lk in links if lk.get("error")]
    measured = [lk for lk in links if not lk.get("error")]
    slow, classes = slow_links(facts, links)
    summary = "; ".join(f"{cls} median {_rate(med)} ({n} link{'' if n == 1 else 's'})" for cls, (med, n) in classes.items())
    if failed or slow:
        parts = [f"link {_link_name(lk, facts)} failed: {lk['error']}" for lk in failed]
        parts += [f"slow link {_link_name(lk, facts)}: {_rate(lk['rate'])}, under {SLOW_FACTOR:g}x the median of "
                  f"{cls} ring links ({_rate(med)})" for lk, cls, med in slow]
        return Check("bandwidth", FAIL, "; ".join(parts) + (f" [{summary}]" if summary else ""))
    if not measured:
        return Check("bandwidth", WARN, "no ring link measured")
    low = min(measured, key=lambda lk: lk["rate"])
    return Check("bandwidth", OK, f"{len(measured)} ring links, {bw_seconds:g} s each: {summary}; "
                                  f"slowest {_link_name(low, facts)} {_rate(low['rate'])}")


def _link_class(lk: Mapping, hosts: Sequence[str]) -> str:
    return "intra-node" if hosts[lk["src"]] == hosts[lk["dst"]] else "inter-node"


def _link_name(lk: Mapping, facts: Sequence[Mapping]) -> str:
    """``rank 1 on node1 -> rank 2 on node2 via eth0 (10.99.0.1 -> 10.99.0.2)``."""
    a, b = facts[lk["src"]], facts[lk["dst"]]
    via = f"{a.get('interface')}" if a.get("interface") == b.get("interface") else f"{a.get('interface')}/{b.get('interface')}"
    return (f"rank {lk['src']} on {a['host']} -> rank {lk['dst']} on {b['host']} via {via} "
            f"({a.get('address')} -> {b.get('address')})")


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e9:.2f} Gbit/s = {bytes_per_s / 1e6:.0f} MB/s"


def _group(mapping: Mapping, key) -> dict:
    """{key(value): [keys of mapping with that value]} in first-seen order."""
    out: dict = {}
    for k, v in mapping.items():
        out.setdefault(key(v), []).append(k)
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _distinct(items) -> list:
    return list(dict.fromkeys(items))


def _host_order(facts: Sequence[Mapping]):
    order = {h: i for i, h in enumerate(_distinct(f["host"] for f in sorted(facts, key=lambda f: f["rank"])))}
    return lambda h: order.get(h, len(order))


def _hosts(hosts) -> str:
    """node[1-3] for node1, node2, node3 (hostlist syntax), else a comma list."""
    hosts = _distinct(hosts)
    try:
        from hpcring.bootstrap.hostlist import compress
        return compress(hosts)
    except HpcringError:
        return ", ".join(hosts)


# =============================================================================== probes (per rank)

def _sink(conn: socket.socket) -> None:
    """Bandwidth receiver, run after a peer authenticated: count bytes until EOF, acknowledge the count."""
    conn.settimeout(10.0)   # one recv; the sender stops after its seconds, or dies and we give up
    buf, total = bytearray(1 << 20), 0
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        total += n
    conn.sendall(_COUNT.pack(total))


def measure_link(address: str, port: int, secret: bytes, seconds: float, deadline: float,
                 rounds: int = BW_ROUNDS, connect_timeout: float = CONNECT_TIMEOUT) -> tuple[float, int]:
    """``(best rate in bytes/s, bytes of that round)`` to a listener with the :func:`_sink` hook.

    Each round sends for ``seconds / rounds`` then waits for the receiver's count, so the rate
    covers delivery, not just filling socket buffers. Raises netif.ProbeFailed or OSError; never
    waits past ``deadline`` (monotonic)."""
    best = (0.0, 0)
    chunk = memoryview(bytes(CHUNK))
    for _ in range(rounds):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline reached before the transfer")
        with netif.probe_connect(address, port, secret, timeout=min(connect_timeout, left)) as s:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds / rounds:
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)
            (got,) = _COUNT.unpack(recv_exact(s, _COUNT.size))
            rate = got / (time.perf_counter() - t0)
        best = max(best, (rate, got))
    return best


def _latency(address: str, port: int, secret: bytes, timeout: float) -> float:
    """Best of LATENCY_TRIES connect+authenticate round trips, in ms (sequential: no self-contention)."""
    best = float("inf")
    for _ in range(LATENCY_TRIES):
        t0 = time.perf_counter()
        netif.probe_connect(address, port, secret, timeout=timeout).close()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


class _DoctorRank:
    """One rank's part of a doctor run (see the module doc for the steps and keys)."""

    def __init__(self, topology, store, secret: bytes, opts: Options, environ: Mapping[str, str], emit=None) -> None:
        self.topo, self.store, self.secret, self.opts, self.env = topology, store, secret, opts, environ
        self.emit = emit
        self.rank, self.size = topology.rank, topology.size
        self.started = time.time()
        self.deadline = time.monotonic() + opts.timeout
        # The n-th doctor run of a session has generation n on every rank: keys of two runs never mix.
        self.prefix = f"doctor/{store.add(f'doctor/gen/{self.rank}', 1)}"
        self.listeners: list[netif.ProbeListener] = []
        per_link = 0.5 * opts.timeout / max(1, self.size) - 0.3   # the ring chain must fit in half the time
        self.bw_seconds = max(0.05, min(opts.bw_seconds, per_link))

    def run(self) -> DoctorReport:
        try:
            mine = collect_facts(self.topo, self.env)
            mine["listen"] = self._listen(mine)
            facts = self._share_facts(mine)
            self.store.set(self._key("conn", self.rank), _dumps(self._probe_all(facts)))
            # Rank 0 starts the bandwidth chain only once every rank has finished probing, so no
            # probe competes with a transfer for the CPU.
            conn = [json.loads(v) for v in self._gather("conn")] if self.rank == 0 else None
            if self.size > 1:
                self._measure_link(facts, "bw", after=self.rank - 1 if self.rank else None)
            links = self._recheck(facts) if self.size > 1 else []
            return self._conclude(facts, conn, links) if self.rank == 0 else self._wait_report()
        finally:
            for lst in self.listeners:
                lst.close()

    # -- steps ------------------------------------------------------------------------------
    def _listen(self, fact: dict) -> dict:
        """Probe listeners on every target address, a bandwidth sink on the chosen one."""
        out: dict = {"targets": {}, "bulk": None}
        by_addr: dict[str, int] = {}
        for label, (name, addr) in _targets(fact).items():
            if addr not in by_addr:
                lst = netif.ProbeListener(addr, self.secret)
                self.listeners.append(lst)
                by_addr[addr] = lst.port
            out["targets"][label] = [name, addr, by_addr[addr]]
        if CHOSEN in out["targets"]:
            addr = out["targets"][CHOSEN][1]
            sink = netif.ProbeListener(addr, self.secret, on_authenticated=_sink)
            self.listeners.append(sink)
            out["bulk"] = [addr, sink.port]
        return out

    def _share_facts(self, mine: dict) -> list[dict]:
        """Rank 0 gets every rank's facts; the others only where to probe each rank (O(size) bytes
        each instead of everything rank 0 evaluates)."""
        self.store.set(self._key("facts", self.rank), _dumps(mine))
        if self.rank == 0:
            facts = [json.loads(v) for v in self._gather("facts")]
            self.store.set(f"{self.prefix}/facts", _dumps([{k: f[k] for k in ("rank", "host", "listen")} for f in facts]))
            return facts
        return self._get(f"{self.prefix}/facts", "rank 0 to publish everyone's facts")

    def _probe_all(self, facts: list[dict]) -> dict:
        """``{label: {peer: {"err": reason or None, "ms": latency}}}`` for every peer and target."""
        jobs = [(label, peer, *f["listen"]["targets"][label][1:])
                for label in (facts[self.rank]["listen"]["targets"]) for peer, f in enumerate(facts)
                if peer != self.rank and label in f["listen"]["targets"]]
        timeout = max(0.1, min(self.opts.connect_timeout, self._left()))
        errors: list[str | None] = []
        if jobs:
            with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:   # dead links time out together
                errors = list(pool.map(lambda j: netif.probe(j[2], j[3], self.secret, timeout), jobs))
        out: dict = {}
        for (label, peer, addr, port), err in zip(jobs, errors):
            ms = None
            if err is None:
                try:
                    ms = _latency(addr, port, self.secret, timeout)
                except netif.ProbeFailed as e:
                    err = f"latency probe: {e}"
            out.setdefault(label, {})[str(peer)] = {"err": err, "ms": ms}
        return out

    def _measure_link(self, facts: list[dict], what: str, after: int | None) -> None:
        """Measure link rank -> rank+1 once rank ``after`` published its ``what`` record (None: now),
        then publish this one: a chain, so transfers never overlap."""
        if after is not None:
            self._get(self._key(what, after), f"rank {after} to finish its ring link measurement")
        dst = (self.rank + 1) % self.size
        record: dict = {"src": self.rank, "dst": dst, "seconds": self.bw_seconds}
        bulk = facts[dst]["listen"]["bulk"]
        try:
            if not bulk:
                raise netif.ProbeFailed(f"rank {dst} has no bandwidth listener (no chosen interface)")
            record["rate"], record["bytes"] = measure_link(bulk[0], bulk[1], self.secret, self.bw_seconds,
                                                           self.deadline, connect_timeout=self.opts.connect_timeout)
        except (netif.ProbeFailed, OSError, EOFError) as e:
            record["error"] = str(e) if isinstance(e, netif.ProbeFailed) else f"{type(e).__name__}: {e}"
        self.store.set(self._key(what, self.rank), _dumps(record))

    def _recheck(self, facts: list[dict]) -> list[dict] | None:
        """Links that look slow are measured once more (chained again) and keep their best rate, so
        one transfer disturbed by another process does not name a link. Rank 0 returns the links."""
        links = None
        if self.rank == 0:
            links = [json.loads(v) for v in self._gather("bw")]
            suspects = sorted(lk["src"] for lk, _, _ in slow_links(facts, links)[0])
            self.store.set(f"{self.prefix}/recheck", _dumps(suspects))
        else:
            suspects = self._get(f"{self.prefix}/recheck", "rank 0 to gather the ring link measurements")
        if self.rank in suspects:
            i = suspects.index(self.rank)
            self._measure_link(facts, "bw2", after=suspects[i - 1] if i else None)
        if self.rank == 0 and suspects:
            for new in (json.loads(v) for v in self._gather("bw2", suspects)):
                old = links[new["src"]]
                if not new.get("error") and new["rate"] > old.get("rate", 0):
                    links[new["src"]] = {**old, **new, "error": None}
                links[new["src"]]["rechecked"] = True
        return links

    def _conclude(self, facts: list[dict], conn: list[dict], links: list[dict]) -> DoctorReport:
        report = DoctorReport(evaluate(facts, conn, links, self.bw_seconds), [f["host"] for f in facts],
                              self.topo.job_id, self.started, time.time(),
                              {"facts": facts, "pairs": conn, "links": links})
        try:
            if self.emit is not None:   # before publishing: the others may exit as soon as they have it
                self.emit(report)
        finally:   # the verdict only: the others need no copy of the data behind it
            self.store.set(f"{self.prefix}/report", _dumps(report.to_dict(with_data=False)))
        return report

    def _wait_report(self) -> DoctorReport:
        return DoctorReport.from_dict(self._get(f"{self.prefix}/report", "rank 0 to publish the report"))

    # -- store helpers ----------------------------------------------------------------------
    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}/{what}/{rank}"

    def _gather(self, what: str, ranks: Sequence[int] | None = None) -> list[bytes]:
        """Rank 0: the ``what`` key of ``ranks`` (default all); a rank that never publishes it is named
        to everyone (rank 0 publishes the error where the others wait, a little before the deadline)."""
        margin = min(GATHER_MARGIN_S, 0.1 * self.opts.timeout)
        ranks = range(self.size) if ranks is None else ranks
        try:
            return self.store.gather([self._key(what, r) for r in ranks], timeout=max(0.0, self._left() - margin))
        except StoreTimeoutError as e:
            missing = sorted(int(k.rsplit("/", 1)[1]) for k in e.missing)
            err = BootstrapError(
                f"hpcring doctor: {describe_ranks(missing, self.topo.hosts)} did not report "
                f"{'its' if len(missing) == 1 else 'their'} {_STEP_NAMES[what]} within {self.opts.timeout:g}s "
                f"({len(missing)} of {self.size} ranks missing)",
                hint="every rank of the job must run the doctor: check that those ranks run it and are not "
                     "stuck (their logs); raise --timeout on a busy machine")
            for key in (f"{self.prefix}/facts", f"{self.prefix}/recheck", f"{self.prefix}/report"):   # where the others wait
                self.store.set(key, _dumps({"error": err.message, "hint": err.hint}))
            raise err from None

    def _get(self, key: str, waiting_for: str):
        """The JSON value of ``key``; raises rank 0's error when it published one there."""
        try:
            value = json.loads(self.store.get(key, timeout=self._left()))
        except StoreTimeoutError as e:
            raise BootstrapError(f"hpcring doctor on rank {self.rank} ({self.topo.host}): timed out after "
                                 f"{self.opts.timeout:g}s waiting for {waiting_for} (key {key!r})",
                                 hint=e.hint) from None
        if isinstance(value, dict) and "error" in value:
            raise BootstrapError(value["error"], hint=value.get("hint"))
        return value

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def run_doctor(session=None, options: Options | None = None, environ: Mapping[str, str] | None = None,
               emit=None) -> DoctorReport:
    """Run the doctor on this rank; every rank of the job must call it (it is collective).

    ``session``: an ``hpcring.init()`` session (default: ``hpcring.init(timeout=options.timeout)``,
    which joins an existing one). Returns the same report on every rank within ``options.timeout``
    seconds, or raises BootstrapError naming the ranks (and hosts) that did not take part.
    ``emit(report)`` runs on rank 0 before any other rank receives the report: output written there
    is out before a rank exits with the verdict and its launcher (srun --kill-on-bad-exit, mpirun)
    kills the rest, rank 0 included.
    """
    opts = (options or Options()).check()
    if session is None:
        import hpcring
        session = hpcring.init(timeout=opts.timeout)
    env = os.environ if environ is None else environ
    return _DoctorRank(session.topology, session.store, load_secret(env), opts, env, emit).run()


def ensure_secret_when_alone(environ: dict | None = None) -> bool:
    """A process started by no launcher is a job of one rank with no job secret: give it a private
    one (in ``environ``, default os.environ) so ``hpcring doctor`` typed on a node checks that node.
    Returns whether it did; ranks of real jobs always get the job's secret from their launcher."""
    env = os.environ if environ is None else environ
    if env.get("HPCRING_SECRET_FILE") or env.get("HPCRING_SECRET") or env.get("HPCRING_SESSION"):
        return False
    from hpcring.bootstrap.launchers import detect
    if detect(env).launcher != "single":
        return False
    from hpcring.bootstrap.auth import new_secret
    env["HPCRING_SECRET"] = new_secret()
    return True


def write_json(report: DoctorReport, path: str) -> None:
    """The report with everything it is based on, as JSON (rank 0 writes it)."""
    try:
        with open(path, "w") as fh:
            json.dump(report.to_dict(), fh, indent=1)
    except OSError as e:
        raise UsageError(f"cannot write the doctor's JSON report to {path}: {e.strerror}",
                         hint="pass a --json path in a writable directory (on a shared file system in a job)") from e
