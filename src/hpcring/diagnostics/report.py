"""The hang report: from every rank's snapshot to one named diagnosis (pure functions).

Input is what the watchdog collected over the side channel (see
:mod:`hpcring.diagnostics.watchdog`): a *snapshot* per rank that answered (its newest flight
records, the records in flight, its backend's sticky error, where its main thread is) and an
*exit record* per rank that had already exited normally. Ranks with neither are dead or cut off.

The stuck collective is the oldest one still in flight (or failed) on any answering rank. Every
other rank is then put in exactly one category, checked in this order:

=================  ===========================================================================
dead               no answer, and a peer saw its connection reset/closed (process gone)
unreachable        no answer, and peers only time out on it (host down or link cut)
exited             exited before joining (its exit record says after which collective, and what
                   it raised when it ended on an exception)
mismatch           joined the same op with another count, dtype or root
different          called another collective at that sequence number
missing            alive but never reached it (its main thread's location says where it is)
joined             in the collective, like the majority
=================  ===========================================================================

Links: a ring/transport error "recv from rank b ... timed out, x/y bytes done" on rank a whose
peer b also joined means the link b -> a *stalled*. A joined rank that entered the collective
much later than the first (more than max(1 s, deadline/4)) is a *slow rank*.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcring.ranks import expand_ranges, rank_ranges, ranks_label, who
from hpcring.errors import HpcringError

CATEGORIES = ("dead", "unreachable", "exited", "mismatch", "different", "missing", "joined")
_LINK = re.compile(r"(send to|recv from) rank (\d+) \(([^)]*)\) (.*?), (\d+)/(\d+) bytes done")
# a local peer that died while its node's ranks met in shared memory (native/transport_shm.c)
_SHM_DIED = re.compile(r"rank (\d+) \(([^)]*)\) died during the shared-memory")
_GONE = ("closed by peer", "reset", "EOF", "Broken pipe", "broken pipe", "connection closed", "Connection refused")


MAX_LINES = 8     # findings listed one by one per category; more share lines (one screen at 4096 ranks)
MAX_RANGES = 8    # rank ranges written out in one list before it is cut


def _label(ranks) -> str:
    """:func:`ranks_label`, cut to its first ranges when ranks are scattered (one line at any size)."""
    parts = rank_ranges(ranks).split(",")
    if len(parts) <= MAX_RANGES:
        return ranks_label(ranks)
    return f"{len(set(ranks))} ranks ({','.join(parts[:MAX_RANGES])},...)"


def _who(ranks, hosts) -> str:
    """:func:`who`; once there are many hosts or ranges: hostlist syntax in rank order
    (``node[1-512]``), both cut to fit a line (``hang-report.json`` has every rank)."""
    seen = list(dict.fromkeys(hosts[r] for r in sorted(ranks) if r < len(hosts)))
    if len(seen) <= 4 and len(rank_ranges(ranks).split(",")) <= MAX_RANGES:
        return who(ranks, hosts)
    from hpcring.hostlist import compress  # deferred: hostlist (~2.5 ms) off the CMD's start (rank_site)
    try:
        names = compress(seen) if len(seen) > 4 else ", ".join(seen)
    except HpcringError:
        names = ", ".join(seen)
    return f"{_label(ranks)} ({names if len(names) <= 60 else f'{len(seen)} hosts'})"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} B"


@dataclass
class Report:
    """The diagnosis; ``to_dict`` is the JSON saved as ``diag/hang-report.json``."""

    op: dict | None
    headline: str
    categories: dict[str, list[int]]
    details: dict[int, str]
    links: list[dict] = field(default_factory=list)
    slow: list[dict] = field(default_factory=list)
    where: dict[int, str] = field(default_factory=dict)
    trigger: dict = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    files: str | None = None
    side_channel: bool = True
    # the reporter's text as every other rank receives it (diag/report): rendering is O(ranks), and
    # at 4096 ranks each rank redoing it is 4096x the work for the same screen
    rendered: str | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"op": self.op, "headline": self.headline,
                "categories": {k: v for k, v in self.categories.items() if v},
                "details": {str(k): v for k, v in sorted(self.details.items())}, "links": self.links,
                "slow": self.slow, "where": {str(k): v for k, v in sorted(self.where.items())},
                "trigger": self.trigger, "hosts": self.hosts, "files": self.files,
                "side_channel": self.side_channel}

    def text(self) -> str:
        """The human report: a headline, then one line per finding, ranks compressed."""
        if self.rendered is not None:
            return self.rendered
        lines = [f"hpcring: COLLECTIVE FAILURE: {self.headline}"]
        if self.op:
            lines.append(f"  operation : {describe_op(self.op)}")
        if self.trigger:
            t = self.trigger
            head, err = f"rank {t.get('rank')} ({t.get('host', '?')})", str(t.get("error", "?"))
            lines.append(f"  first seen: {err}" if err.startswith(head + " ") else f"  first seen: {head}: {err}")
        for cat in CATEGORIES:
            ranks = self.categories.get(cat) or []
            if not ranks or cat == "joined":
                continue
            if len(ranks) <= MAX_LINES:
                for r in ranks:
                    lines.append(f"  {cat:<10}: {who([r], self.hosts)}: {self.details.get(r, '')}".rstrip(": "))
                continue
            # Many ranks: one line per distinct finding (one screen at 4096 ranks; all in the JSON).
            same: dict[str, list[int]] = {}
            for r in ranks:
                same.setdefault(self.details.get(r, ""), []).append(r)
            shown = list(same.items())[:MAX_LINES]
            for detail, rs in shown:
                lines.append(f"  {cat:<10}: {_who(rs, self.hosts)}: {detail}".rstrip(": "))
            rest = [r for _, rs in list(same.items())[MAX_LINES:] for r in rs]
            if rest:
                lines.append(f"  {cat:<10}: {_who(rest, self.hosts)}: {len(same) - MAX_LINES} more findings "
                             "(hang-report.json)")
        for link in self.links[:MAX_LINES]:
            lines.append(f"  stalled   : link rank {link['from']} ({link['from_host']}) -> rank {link['to']} "
                         f"({link['to_host']}){' on ' + link['interface'] if link.get('interface') else ''}: "
                         f"{_mib(link['bytes_done'])} of {_mib(link['bytes_total'])} moved before the deadline")
        if len(self.links) > MAX_LINES:
            lines.append(f"  stalled   : {len(self.links) - MAX_LINES} more links (hang-report.json)")
        for s in self.slow[:MAX_LINES]:
            lines.append(f"  slow rank : {who([s['rank']], self.hosts)} entered {s['late']:.1f} s after the first rank")
        if len(self.slow) > MAX_LINES:
            lines.append(f"  slow rank : {_who([s['rank'] for s in self.slow[MAX_LINES:]], self.hosts)} "
                         "joined late too (hang-report.json)")
        joined = self.categories.get("joined") or []
        if joined:
            lines.append(f"  joined    : {_who(joined, self.hosts)}")
        groups: dict[str, list[int]] = {}
        for r, w in self.where.items():
            groups.setdefault(w, []).append(r)
        ordered = sorted(groups.items(), key=lambda kv: min(kv[1]))
        for w, ranks in ordered[:2 * MAX_LINES]:
            lines.append(f"  where     : {_label(ranks)}: {w}")
        if len(ordered) > 2 * MAX_LINES:
            rest = [r for _, rs in ordered[2 * MAX_LINES:] for r in rs]
            lines.append(f"  where     : {_label(rest)}: {len(ordered) - 2 * MAX_LINES} more places "
                         "(hang-report.json)")
        if not self.side_channel:
            lines.append("  note      : the side channel (rank 0's store) was unreachable: this is one rank's view")
        if self.files:
            lines.append(f"  files     : {self.files} (hang-report.json, flight-rank*.json, stacks-rank*.txt)")
        return "\n".join(lines)


def describe_op(op: dict) -> str:
    parts = [f"count={op.get('count')}"]
    if op.get("dtype"):
        parts.append(f"dtype={op['dtype']}")
    if op.get("root") is not None:
        parts.append(f"root={op['root']}")
    parts.append(f"backend={op.get('backend')}")
    parts.append(f"deadline={op.get('timeout', 0):g} s")
    group = f" in {op['group']}" if op.get("group") else ""
    return f"{op.get('op')}#{op.get('seq')}({', '.join(parts)}){group} called at {op.get('site', '?')}"


def _sig(rec: dict) -> tuple:
    return (rec.get("op"), rec.get("dtype"), rec.get("count"), rec.get("root"))


def _at(snap: dict, seq: int) -> dict | None:
    for rec in snap.get("records", []):
        if rec.get("seq") == seq:
            return rec
    return None


def stuck_seq(snaps: dict[int, dict], trigger: dict) -> int | None:
    """Sequence number of the oldest collective that failed on any answering rank, else of the
    oldest one in flight. A failed one wins: a rank can still be finishing collective #3 (its
    last chunks in flight) while the others, done with #3, fail #4 (seen on the dev cluster: a
    count mismatch at #4 reported as "allreduce#3: failed")."""
    recs = [rec for s in snaps.values() for rec in s.get("records", [])]
    for states in (("failed",), ("queued", "started")):
        seqs = [rec["seq"] for rec in recs if rec.get("state") in states]
        if seqs:
            return min(seqs)
    return (trigger.get("op") or {}).get("seq")


def parse_link(error: str | None, rank: int) -> dict | None:
    """A transport error seen on ``rank`` naming a peer -> {from, to, peer, seen_by, why, bytes_done,
    bytes_total, timed_out, gone} (``from -> to`` is the direction of the data), else None."""
    if not error:
        return None
    m = _LINK.search(error)
    if not m:
        d = _SHM_DIED.search(error)
        if d is None:
            return None
        peer = int(d.group(1))
        return {"from": peer, "to": rank, "peer": peer, "seen_by": rank, "why": "died (shared memory)",
                "bytes_done": 0, "bytes_total": 0, "timed_out": False, "gone": True}
    direction, peer, _host, why, done, total = m.groups()
    peer = int(peer)
    src, dst = (peer, rank) if direction == "recv from" else (rank, peer)
    return {"from": src, "to": dst, "peer": peer, "seen_by": rank, "why": why, "bytes_done": int(done), "bytes_total": int(total),
            "timed_out": "timed out" in why, "gone": any(g in why for g in _GONE)}


def diagnose(size: int, hosts: list[str], snaps: dict[int, dict], exits: dict[int, dict] | None = None,
             trigger: dict | None = None, *, interface: str | None = None, side_channel: bool = True) -> Report:
    """One diagnosis from the ranks' snapshots (see the module doc for the rules)."""
    exits, trigger = exits or {}, trigger or {}
    hosts = list(hosts) if len(hosts) == size else [f"rank{r}" for r in range(size)]
    # A group's collective (hpcring.collectives.groups) is diagnosed among its members, on its own
    # records (its sequence numbers are its own); the job's on the records of no group.
    group = (trigger.get("op") or {}).get("group")
    ranks = list(range(size))
    if group is not None:
        ranks = [r for r in (trigger["op"].get("members") or ranks) if 0 <= r < size]
    snaps = {r: {**s, "records": [rec for rec in s.get("records", []) if rec.get("group") == group],
                 "last_done": (s.get("last_done_groups") or {}).get(group, 0) if group is not None
                 else s.get("last_done", 0)}
             for r, s in snaps.items() if r in ranks}
    seq = stuck_seq(snaps, trigger)
    at = {r: _at(s, seq) for r, s in snaps.items()} if seq is not None else {}
    present = [rec for rec in at.values() if rec is not None]
    majority = Counter(_sig(rec) for rec in present).most_common(1)
    ref_sig = majority[0][0] if majority else None
    ref = next((rec for rec in present if _sig(rec) == ref_sig), None) or trigger.get("op")

    links = [ln for r, s in snaps.items() if (ln := parse_link(s.get("error"), r))]
    seen_gone = {ln["peer"] for ln in links if ln["gone"]}
    cats: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    details: dict[int, str] = {}
    for r in ranks:
        snap = snaps.get(r)
        if snap is None and not side_channel:
            continue                     # one rank's own view: say nothing about the others
        if snap is None:
            if r in exits:
                e = exits[r]
                cats["exited"].append(r)
                raised = f"raised {e['error']}{' ' + e['where'] if e.get('where') else ''}; " if e.get("error") else ""
                details[r] = (f"{raised}exited (pid {e.get('pid', '?')}) after collective #{e.get('last_done', 0)}; "
                              f"never joined #{seq}")
            elif r in seen_gone:
                cats["dead"].append(r)
                by = sorted({ln["seen_by"] for ln in links if ln["peer"] == r})
                details[r] = f"no answer; its connection was closed or reset (seen by {_who(by, hosts)})"
            else:
                cats["unreachable"].append(r)
                details[r] = "no answer on the side channel and no reset: host down, process stopped, or link cut"
            continue
        rec = at.get(r)
        if rec is None:
            cats["missing"].append(r)
            behind = [x for x in snap.get("records", []) if x.get("state") in ("queued", "started")
                      and seq is not None and (x.get("seq") or 0) < seq]
            details[r] = (f"never joined: still in {behind[0].get('op')}#{behind[0].get('seq')}" if behind
                          else f"never joined: last completed #{snap.get('last_done', 0)}")
            if snap.get("where"):
                details[r] += f", now {snap['where']}"
        elif ref_sig is not None and _sig(rec) != ref_sig:
            if rec.get("op") != ref_sig[0]:
                cats["different"].append(r)
                details[r] = f"called {rec.get('op')}#{seq} at {rec.get('site', '?')} instead of {ref_sig[0]}"
            else:
                diffs = [f"{k}={rec.get(k)} (others {v})" for k, v in zip(("dtype", "count", "root"), ref_sig[1:])
                         if rec.get(k) != v]
                cats["mismatch"].append(r)
                details[r] = f"{rec.get('op')}#{seq} with " + ", ".join(diffs) + f" at {rec.get('site', '?')}"
        else:
            cats["joined"].append(r)

    stalled = []
    everyone_joined = len(cats["joined"]) == len(ranks)    # else stalls are the consequence, not the cause
    for ln in links:
        if everyone_joined and ln["timed_out"]:
            stalled.append({**ln, "from_host": hosts[ln["from"]], "to_host": hosts[ln["to"]], "interface": interface})
    slow = _slow(snaps, at, cats["joined"], ref)
    where = {r: s["where"] for r, s in snaps.items() if s.get("where")}
    for r in cats["exited"]:          # a rank that ended on an exception: where it raised it
        e = exits[r]
        if e.get("error"):
            where[r] = f"raised {str(e['error']).split(':')[0]}" + (f" {e['where']}" if e.get("where") else "")
    headline = _headline(cats, stalled, slow, ref, seq, hosts,
                         raised={r: exits[r]["error"] for r in cats["exited"] if exits[r].get("error")})
    if not side_channel:
        headline = f"{ref.get('op') if ref else 'collective'}#{seq} failed on rank {trigger.get('rank')}: {trigger.get('error')}"
    op = dict(ref) if ref else None
    if op is not None:
        op["seq"] = seq
        op.pop("members", None)       # the group's name says it (and the categories list the members)
    return Report(op, headline, cats, details, stalled, slow, where, trigger, hosts, side_channel=side_channel)


def _slow(snaps, at, joined, ref) -> list[dict]:
    starts = {r: at[r].get("t_started") for r in joined if at.get(r) and at[r].get("t_started")}
    if len(starts) < 2 or not ref:
        return []
    first = min(starts.values())
    limit = max(1.0, float(ref.get("timeout") or 0) / 4)
    return [{"rank": r, "late": t - first} for r, t in sorted(starts.items()) if t - first > limit]


def _headline(cats, stalled, slow, ref, seq, hosts, raised: dict | None = None) -> str:
    """``raised``: exited ranks that ended on an exception -> its text (``ValueError: x``)."""
    name = f"{ref.get('op')}#{seq}" if ref else f"collective #{seq}"
    if ref and ref.get("group"):
        name += f" ({ref['group']})"
    for cat, text in (("dead", "died"), ("unreachable", "unreachable"), ("exited", "exited without joining it"),
                      ("mismatch", "called it with different arguments"),
                      ("different", "called a different collective"), ("missing", "never joined")):
        if cats.get(cat):
            if cat == "missing" and ref and ref.get("op") == "p2p":
                text = _p2p_missing(ref.get("group") or "", cats[cat])
            if cat == "exited" and raised:
                kinds = sorted({str(v).split(":")[0] for v in raised.values()})
                text = f"raised {'/'.join(kinds)} and exited without joining it" if len(raised) == len(cats[cat]) \
                    else f"exited without joining it ({_who(sorted(raised), hosts)} raised {'/'.join(kinds)})"
            return f"{name}: {_who(cats[cat], hosts)} {text}"
    if stalled:
        ln = stalled[0]
        return (f"{name}: link rank {ln['from']} ({ln['from_host']}) -> rank {ln['to']} ({ln['to_host']}) "
                f"stalled")
    if slow:
        return f"{name}: {_who([s['rank'] for s in slow], hosts)} joined late (slow rank)"
    return f"{name}: failed (no rank is missing or mismatched: see the first error)"


_CHANNEL = re.compile(r"rank (\d+|any) -> rank (\d+)")


def _p2p_missing(channel: str, missing: list[int]) -> str:
    """A point-to-point message's missing side (hpcring.collectives.p2p names the channel
    ``rank S -> rank D, tag T``): the sender never sent it, or the receiver never posted it."""
    m = _CHANNEL.search(channel)
    if m is None:
        return "never joined"
    return "never sent it" if m.group(1) != "any" and int(m.group(1)) in missing else "never received it"


# ------------------------------------------------------------------------------------ wire form

def to_wire(report: Report) -> dict:
    """The report as every rank reads it (``diag/report``, the tree's ``report`` message): the
    report's dict with rank lists as ranges and without the hosts, which every rank has in its
    topology (~1 KiB at 4096 ranks instead of ~250 KiB), and its text (one screen), rendered once."""
    d = report.to_dict()
    d["categories"] = {k: rank_ranges(v) for k, v in d["categories"].items()}
    groups: dict[str, list[int]] = {}
    for r, w in report.where.items():
        groups.setdefault(w, []).append(r)
    d["where"] = [[rank_ranges(rs), w] for w, rs in groups.items()]
    del d["hosts"]
    d["text"] = report.text()
    return d


class _Ranges(Mapping):
    """``categories`` of a report read from its wire form: rank lists kept as range text until
    asked for (every rank decodes the report; most print its text and never look: expanding
    each list is O(ranks) per rank, O(ranks²) in all)."""

    def __init__(self, ranges: dict) -> None:
        self._ranges, self._lists = {str(k): str(v) for k, v in ranges.items()}, {}

    def __getitem__(self, key: str) -> list[int]:
        if key not in self._lists:
            self._lists[key] = expand_ranges(self._ranges[key])
        return self._lists[key]

    def __iter__(self):
        return iter(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)


class _Where(Mapping):
    """``where`` of a report read from its wire form (rank -> place), built on first use."""

    def __init__(self, groups: list) -> None:
        self._groups, self._map = [(str(rs), str(w)) for rs, w in groups], None

    def _full(self) -> dict[int, str]:
        if self._map is None:
            self._map = {}
            for rs, w in self._groups:
                self._map.update(dict.fromkeys(expand_ranges(rs), w))
        return self._map

    def __getitem__(self, rank: int) -> str:
        return self._full()[rank]

    def __iter__(self):
        return iter(self._full())

    def __len__(self) -> int:
        return len(self._full())


def from_wire(d: dict, hosts: list[str]) -> Report:
    """The report in :func:`to_wire`'s form, with ``hosts`` (the receiver's topology); its rank
    lists are expanded only when read."""
    return Report(d.get("op"), d.get("headline", "?"), _Ranges(d.get("categories", {})),
                  {int(k): v for k, v in d.get("details", {}).items()}, d.get("links", []), d.get("slow", []),
                  _Where(d.get("where", [])), d.get("trigger", {}), hosts, d.get("files"),
                  d.get("side_channel", True), rendered=d.get("text"))
