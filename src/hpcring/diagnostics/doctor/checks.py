"""Step 4 of the doctor, on rank 0: the checks as pure functions of every rank's facts, the pair
probes and the ring-link rates (unit-tested on synthetic facts)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import median

from hpcring.ranks import rank_ranges, who
from hpcring.errors import HpcringError
from hpcring.diagnostics.doctor.model import (CHOSEN, Check, DEFAULT_BW_SECONDS, ENV_VARS, FAIL, OK,
                                              SLOW_FACTOR, WARN, _ORDER, _distinct)
from hpcring.diagnostics.doctor.facts import Selection, _targets, iface_sources, select
from hpcring.hostlist import compress


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
                f"{'unset' if v is None else repr(v)} on {who(rs, hosts, compress=True)}" for v, rs in values.items())))
    return out


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


def _host_order(facts: Sequence[Mapping]):
    order = {h: i for i, h in enumerate(_distinct(f["host"] for f in sorted(facts, key=lambda f: f["rank"])))}
    return lambda h: order.get(h, len(order))


def _hosts(hosts) -> str:
    """node[1-3] for node1, node2, node3 (hostlist syntax), else a comma list."""
    hosts = _distinct(hosts)
    try:
        return compress(hosts)
    except HpcringError:
        return ", ".join(hosts)

