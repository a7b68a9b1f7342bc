"""The preflight's verdict: read every node's file, apply the blame rules, name the bad nodes.

Pure over the records (:func:`judge`, unit-tested on generated bad input); :func:`read_verdict`
reads ``DIR/<host>.json`` for each expected host and calls it. Never raises for what is in the
folder: a file that is missing, corrupt, signed with another secret, or whose fields have the
wrong types makes its node bad with a one-line reason.

Blame rules (each bad node gets one line; ``unsure`` holds the nodes blamed without a clear culprit):

1. No file by the deadline: "no answer in D s". A file that never reached ``done``: "started but
   did not finish". An unusable file, no interface to listen on, local checks that failed.
2. Versions (python, hpcring, torch, Open MPI, NCCL): per key the majority's value wins; a node
   that differs is bad, naming both. No majority (a tie): every node of the tie is blamed, unsure.
3. GPUs (``--gpus N``): a count other than N, a GEMM that differs from the CPU's.
4. Connections, over the probes done nodes made to each other: a node nobody could connect to is
   bad when a tester that failed it connects elsewhere (or two testers failed); a node that connected
   to none of its targets is bad when someone else reached one of them. A failing pair left over
   (both ends connect elsewhere, or two nodes only) blames both ends, unsure.
5. Ring links (node i -> i+1) under the threshold (``min_gbps`` > 0) or failing mid-transfer: a node
   whose in- and out-link both fail is bad; a single such link blames both ends, unsure.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpcring.preflight.checks import VERSION_KEYS
from hpcring.preflight.record import BadRecord, check_host, read_record
from hpcring.bootstrap.auth import load_secret

LIST_LIMIT = 16   # lines naming single links/nodes beyond this many are summarised


@dataclass
class Verdict:
    """``ok``: no node is bad. ``bad``: host -> one-line reason. ``seconds``: from the first node's
    start to the last node's end (their clocks). ``lines``: the human summary. ``unsure``: the bad
    hosts blamed without a clear culprit (a single failing pair, a version tie): leave them out of
    this run, but a node history may prefer not to record them."""
    ok: bool
    bad: dict[str, str]
    seconds: float
    lines: list[str]
    unsure: set[str] = field(default_factory=set)
    good: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "bad": self.bad, "unsure": sorted(self.unsure), "good": self.good,
                "seconds": self.seconds, "lines": self.lines}


class _Malformed(Exception):
    pass


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field(body: Mapping, key: str, kind, *, required: bool = True, default=None):
    if key not in body or body[key] is None:
        if required:
            raise _Malformed(f"field {key!r} is missing")
        return default
    v = body[key]
    ok = _num(v) if kind == "number" else isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if not ok:
        raise _Malformed(f"field {key!r} is {type(v).__name__}, not {getattr(kind, '__name__', kind)}")
    return v


@dataclass
class _Node:
    host: str
    state: str
    started: float
    ended: float | None
    deadline: float
    listen: list[dict]
    iface_error: str | None
    versions: dict[str, str] | None
    gpu: dict | None
    local_error: str | None
    pairs: dict[str, dict]
    bw: dict | None
    min_gbps: float


def _short(text, limit: int = 200) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _parse(host: str, body: Mapping) -> _Node:
    state = _field(body, "state", str)
    if state not in ("listening", "done"):
        raise _Malformed(f"state {_short(state, 40)!r} is neither listening nor done")
    listen = _field(body, "listen", list, required=False, default=[])
    for c in listen:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("address"), str):
            raise _Malformed("field 'listen' holds an entry without a name and address")
    done = state == "done"
    versions = _field(body, "versions", dict, required=False)
    if versions is not None:
        for k, v in versions.items():
            if not isinstance(k, str) or not (v is None or isinstance(v, str)):
                raise _Malformed(f"versions[{_short(k, 40)!r}] is {type(v).__name__}, not text")
    pairs = _field(body, "pairs", dict, required=False, default={})
    for peer, p in pairs.items():
        if not isinstance(p, dict) or not isinstance(p.get("ok"), bool):
            raise _Malformed(f"pairs[{_short(peer, 40)!r}] has no boolean 'ok'")
    bw = _field(body, "bw", dict, required=False)
    if bw is not None:
        if not isinstance(bw.get("to"), str):
            raise _Malformed("bw has no target host 'to'")
        if bw.get("error") is None and not _num(bw.get("gbps")):
            raise _Malformed("bw has neither a number 'gbps' nor an 'error'")
    gpu = _field(body, "gpu", dict, required=False)
    if gpu is not None and gpu.get("error") is not None and not isinstance(gpu["error"], str):
        raise _Malformed("gpu.error is not text")
    return _Node(host, state, float(_field(body, "started", "number")),
                 float(_field(body, "ended", "number")) if done else None,
                 float(_field(body, "deadline", "number", required=False, default=30.0)),
                 listen, _field(body, "iface_error", str, required=False),
                 versions, gpu, _field(body, "local_error", str, required=False), pairs, bw,
                 float(_field(body, "min_gbps", "number", required=False, default=0.0)))


class _Blame:
    def __init__(self) -> None:
        self.bad: dict[str, list[str]] = {}
        self.unsure: set[str] = set()
        self.clear: set[str] = set()

    def add(self, host: str, reason: str, *, sure: bool = True) -> None:
        self.bad.setdefault(host, []).append(reason)
        (self.clear if sure else self.unsure).add(host)

    def __contains__(self, host: str) -> bool:
        return host in self.bad


def judge(records: Mapping[str, object], expected: Sequence[str], *, min_gbps: float | None = None,
          deadline: float | None = None) -> Verdict:
    """The verdict over ``records`` (host -> verified body dict, a BadRecord/str reason, or None
    for no file) for the ``expected`` hosts. ``min_gbps`` overrides what the nodes recorded;
    ``deadline`` is only used in the message for a node that wrote nothing."""
    blame = _Blame()
    nodes: dict[str, _Node] = {}
    for h in expected:
        rec = records.get(h)
        if rec is None:
            blame.add(h, f"no answer in {_deadline_of(records, deadline):g} s (wrote no preflight file)")
        elif isinstance(rec, (str, BadRecord)):
            blame.add(h, f"its preflight file is unusable: {_short(rec)}")
        elif not isinstance(rec, Mapping):
            blame.add(h, f"its preflight record is {type(rec).__name__}, not an object")
        else:
            try:
                nodes[h] = _parse(h, rec)
            except _Malformed as e:
                blame.add(h, f"its preflight file is malformed: {e}")
    done = {h: n for h, n in nodes.items() if n.state == "done"}
    for h, n in nodes.items():
        if n.iface_error:
            blame.add(h, f"no interface to listen on: {_short(n.iface_error)}")
        if n.state != "done":
            where = ", ".join(f"{c['name']} {c['address']}" for c in n.listen) or "nothing"
            blame.add(h, f"started (listening on {where}) but did not finish within {n.deadline:g} s")
        elif n.local_error:
            blame.add(h, f"its local checks failed: {_short(n.local_error)}")
        elif n.versions is None:
            blame.add(h, "reported no versions")
    version_lines = _versions(done, blame)
    for h, n in done.items():
        if n.gpu and n.gpu.get("error"):
            blame.add(h, f"GPU check: {_short(n.gpu['error'])}")
    conn_lines = _connections(done, blame)
    link_lines = _links(done, blame, min_gbps)

    bad = {h: "; ".join(rs) for h, rs in blame.bad.items()}
    unsure = {h for h in blame.unsure if h not in blame.clear}
    good = [h for h in expected if h not in bad]
    starts = [n.started for n in nodes.values()]
    ends = [n.ended for n in done.values() if n.ended is not None]
    seconds = round(max(ends) - min(starts), 2) if starts and ends else 0.0
    lines = [f"preflight: {len(expected)} node{'s' if len(expected) != 1 else ''}, "
             f"{len(good)} ok, {len(bad)} bad, {seconds:g} s"
             + (f" ({_mode(done)})" if done else "")]
    shown = [h for h in expected if h in bad][:LIST_LIMIT]
    for h in shown:
        lines.append(f"  BAD {h}: {bad[h]}" + (" [no clear culprit]" if h in unsure else ""))
    if len(bad) > len(shown):
        lines.append(f"  ... and {len(bad) - len(shown)} more bad nodes")
    if len(expected) > 1 and 2 * len(bad) > len(expected):
        lines.append("  more than half the nodes failed: suspect the environment (a setting, the shared file "
                     "system, a deadline too short for the Python and torch imports) before the nodes")
    lines += version_lines + conn_lines + link_lines
    gpus = [n.gpu for n in done.values() if n.gpu]
    if gpus:
        skipped = sorted({g["skipped"] for g in gpus if isinstance(g.get("skipped"), str)})
        checked = sum(1 for g in gpus if not g.get("skipped") and not g.get("error"))
        lines.append(f"  gpus: {checked} node{'s' if checked != 1 else ''} passed (count and GEMM)"
                     + (f"; skipped: {'; '.join(skipped)}" if skipped else ""))
    return Verdict(not bad, bad, seconds, lines, unsure, good)


def _deadline_of(records: Mapping[str, object], deadline: float | None) -> float:
    if deadline is not None:
        return deadline
    for r in records.values():
        if isinstance(r, Mapping) and _num(r.get("deadline")):
            return float(r["deadline"])
    return 30.0


def _mode(done: Mapping[str, _Node]) -> str:
    return "all pairs probed" if len(done) <= 16 else "ring neighbours + 3 random peers probed"


def _versions(done: Mapping[str, _Node], blame: _Blame) -> list[str]:
    have = {h: n.versions for h, n in done.items() if n.versions is not None}
    if not have:
        return []
    same = []
    lines = []
    for key in VERSION_KEYS:
        vals = {h: (v.get(key) or "absent") for h, v in have.items()}
        count = Counter(vals.values()).most_common()
        if len(count) == 1:
            same.append(f"{key} {count[0][0]}")
            continue
        top, n_top = count[0]
        if n_top > count[1][1]:
            for h, v in vals.items():
                if v != top:
                    blame.add(h, f"{key} {_short(v, 60)} where {n_top} of {len(vals)} nodes have {_short(top, 60)}")
        else:
            groups = "; ".join(f"{_short(v, 60)} on {n}" for v, n in count)
            for h, v in vals.items():
                if Counter(vals.values())[v] == n_top:
                    blame.add(h, f"{key} {_short(v, 60)}: versions differ with no majority ({groups})", sure=False)
            lines.append(f"  {key}: no majority ({groups})")
    lines.insert(0, f"  versions: {', '.join(same)} on every node" if same else "  versions: none agree")
    return lines


def _connections(done: Mapping[str, _Node], blame: _Blame) -> list[str]:
    """Rule 4 over the directed probes ``a -> b`` between done nodes."""
    edges: dict[tuple[str, str], dict] = {}
    for a, n in done.items():
        for b, p in n.pairs.items():
            if b in done and b != a:
                edges[(a, b)] = p
    if not edges:
        return []
    works = {h: any(p["ok"] for (a, b), p in edges.items() if h in (a, b)) for h in done}
    reached = {h: [a for (a, b), p in edges.items() if b == h and p["ok"]] for h in done}
    failed_in = {h: [a for (a, b), p in edges.items() if b == h and not p["ok"]] for h in done}
    ok_out = {h: [b for (a, b), p in edges.items() if a == h and p["ok"]] for h in done}
    failed_out = {h: [b for (a, b), p in edges.items() if a == h and not p["ok"]] for h in done}
    culprits = set()
    for h in done:
        fi = failed_in[h]
        if fi and not reached[h] and (len(fi) >= 2 or any(works[t] and _works_without(t, h, edges) for t in fi)
                                      or any(edges.get((h, t), {}).get("ok") for t in fi)):
            where = ", ".join(f"{c['name']} {c['address']}" for c in done[h].listen) or "no address"
            why = _short(edges[(fi[0], h)].get("err") or "failed", 120)
            blame.add(h, f"nobody could connect to it on {where} ({len(fi)} of {len(fi)} peers failed; "
                         f"{fi[0]}: {why})")
            culprits.add(h)
        fo = failed_out[h]
        if fo and not ok_out[h] and any(reached[t] for t in fo) and h not in culprits:
            why = _short(edges[(h, fo[0])].get("err") or "failed", 120)
            blame.add(h, f"connected to none of its {len(fo)} peers ({fo[0]}: {why})")
            culprits.add(h)
    lines = []
    left = [(a, b) for (a, b), p in edges.items() if not p["ok"] and a not in culprits and b not in culprits]
    for a, b in left:
        why = _short(edges[(a, b)].get("err") or "failed", 120)
        for h in (a, b):
            blame.add(h, f"link {a} -> {b} failed ({why}); no clear culprit: both ends blamed (conservative)",
                      sure=False)
    n_ok = sum(1 for p in edges.values() if p["ok"])
    ms = sorted(p["ms"] for p in edges.values() if p["ok"] and _num(p.get("ms")))
    lines.append(f"  connections: {n_ok} of {len(edges)} probes authenticated"
                 + (f", connect+handshake median {ms[len(ms) // 2]:g} ms" if ms else ""))
    return lines


def _works_without(tester: str, target: str, edges: Mapping[tuple[str, str], dict]) -> bool:
    """``tester`` has a working connection with a node other than ``target``."""
    return any(p["ok"] for (a, b), p in edges.items() if tester in (a, b) and target not in (a, b))


def _links(done: Mapping[str, _Node], blame: _Blame, min_gbps: float | None) -> list[str]:
    """Rule 5 over the ring links each done node measured to its successor."""
    links = [(h, n.bw, n.min_gbps if min_gbps is None else min_gbps) for h, n in done.items() if n.bw]
    if not links:
        return []
    bad_links = []
    shown = []
    for src, bw, floor in links:
        dst = bw["to"]
        if bw.get("error") is not None:
            text = f"{src}->{dst} failed ({_short(bw['error'], 100)})"
            if src not in blame and dst not in blame:
                bad_links.append((src, dst, text))
        else:
            text = f"{src}->{dst} {bw['gbps']:.3g} Gbit/s"
            if floor > 0 and bw["gbps"] < floor:
                text += f" < {floor:g}"
                bad_links.append((src, dst, text))
        shown.append(text)
    srcs = Counter(s for s, _, _ in bad_links)
    dsts = Counter(d for _, d, _ in bad_links)
    both = {h for h in srcs if dsts[h]}
    for src, dst, text in bad_links:
        if src in both or dst in both:
            for h in {src, dst} & both:
                if not any("both its ring links" in r for r in blame.bad.get(h, [])):
                    mine = "; ".join(t for s, d, t in bad_links if h in (s, d))
                    blame.add(h, f"both its ring links fail or are slow: {mine}")
        else:
            for h in (src, dst):
                blame.add(h, f"ring link {text}; no clear culprit: both ends blamed (conservative)", sure=False)
    floors = sorted({f for _, _, f in links})
    head = f"  ring links ({'threshold ' + ', '.join(f'{f:g}' for f in floors) + ' Gbit/s' if any(floors) else 'no threshold: report only'}): "
    if len(shown) > LIST_LIMIT:
        rates = sorted(bw["gbps"] for _, bw, _ in links if bw.get("error") is None)
        med = f"median {rates[len(rates) // 2]:.3g} Gbit/s, " if rates else ""
        worst = ": " + ", ".join(t for _, _, t in bad_links[:LIST_LIMIT]) if bad_links else ""
        return [head + med + f"{len(bad_links)} of {len(links)} bad" + worst]
    return [head + ", ".join(shown)]


def read_verdict(folder: str | os.PathLike, expected_hosts: Sequence[str], *, secret: bytes | None = None,
                 min_gbps: float | None = None, environ: Mapping[str, str] | None = None) -> Verdict:
    """Read ``DIR/<host>.json`` of every expected host and judge them (see the module docstring).

    ``secret``: the job secret the files are signed with (default: HPCRING_SECRET_FILE /
    HPCRING_SECRET, as the batch script has them; BootstrapError when there is none). ``min_gbps``:
    the ring links' threshold, overriding what the nodes recorded (their ``--min-gbps``).
    A host name that cannot name a file is a ValueError (the caller's list is wrong); anything in
    the folder only makes nodes bad."""
    if secret is None:
        secret = load_secret(os.environ if environ is None else environ)
    hosts = [check_host(h) for h in expected_hosts]
    records: dict[str, object] = {}
    for h in hosts:
        try:
            records[h] = read_record(folder, h, secret)
        except BadRecord as e:
            records[h] = str(e)
    return judge(records, hosts, min_gbps=min_gbps)
