"""Straggler verdicts: who arrives last, from the time each rank spent inside each collective.

No clock is compared across hosts. A collective ends on every rank at about the same moment (no
rank can finish before the last one has arrived), so a rank that arrives ``d`` seconds after the
others spends ``d`` seconds less inside it. For each collective of a window the rank with the
shortest time inside arrived last, and the gap to the next shortest is how late it was (a lower
bound: its lateness behind the second-last rank). A rank's compute is its time in the window
spent outside any collective.

A window is ``W`` collectives of one communicator, the same sequence numbers on every rank (see
:mod:`hpcring.diagnostics.straggler_watch`, which gathers them). The rules, each a setting:

* **rank**: among the window's collectives someone was late for (some rank at least the
  lateness floor behind the median rank; at least 8 of them), a rank arrived after the median
  rank in at least ``share`` of them (default 75%), a count that fair coin tosses reach with
  probability under 1e-4, and its median lateness behind the median rank is at least ``min_ms``
  (default 2 ms) and at least ``min_frac`` (default 5%) of the window's median time from one
  collective to the next (the line also says in how many it arrived last);
* **node**: every rank of one host (of several, holding more than one rank) qualifies: a slow
  node, whose ranks take turns at being last;
* **link**: nobody is late, but one rank's sends to its ring peer were blocked (the link would not
  take more) for at least ``link_share`` (default 20%) of the time and at least 3x the median
  rank's share plus 2 points: a slow link slows every rank alike, so only the sender's blocked
  sends tell it (the ring backend counts them, native/ring_pass.c; other backends do not say).

Why these defaults: when nobody is slow the last rank is whoever the scheduler woke last, a
uniform draw; with 2 ranks, 75% of 50 is 3.5 standard deviations above the 50% of chance, and
with more ranks chance falls further away, so a uniformly loaded job gets no verdict (measured:
docs/diagnostics.md). A rank slowed to 1.3x arrives last in nearly every collective.

Pure functions over arrays: :func:`window_of` turns one rank's records into its row,
:func:`judge` turns every rank's rows into a :class:`Verdict` (or None).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace

import numpy as np

from hpcring.ranks import rank_ranges

MIN_TOLD = 8            # collectives someone was late for, below which a window says nothing
P_MAX = 1e-4            # a rank's count of "behind" must be that unlikely by chance to be named
MAGIC = b"HRS2"
_HEAD = struct.Struct("<4sqiidid")   # magic, first seq, W, rank, compute s, peer, send share


@dataclass(frozen=True)
class Rules:
    """The thresholds of the module doc (set by the HPCRING_STRAGGLER_SHARE, _MIN_MS and _MIN_FRAC variables)."""
    share: float = 0.75
    min_ms: float = 2.0
    min_frac: float = 0.05
    link_share: float = 0.2


@dataclass
class Row:
    """One rank's view of a window: its time inside each collective (NaN where not kept), its
    compute (time in the window outside every collective) and the ring peer its sends waited on
    most, with the share of the time they waited (-1 and 0 where the backend does not say)."""
    rank: int
    first: int
    inside: np.ndarray
    compute: float
    peer: int = -1
    send_share: float = 0.0

    def encode(self) -> bytes:
        return _HEAD.pack(MAGIC, self.first, len(self.inside), self.rank, self.compute, self.peer,
                          self.send_share) + self.inside.astype("<f4").tobytes()

    @classmethod
    def decode(cls, blob: bytes) -> "Row | None":
        """The row in ``blob``, or None when it is not one (a short or foreign value)."""
        if len(blob) < _HEAD.size or blob[:4] != MAGIC:
            return None
        _, first, w, rank, compute, peer, send_share = _HEAD.unpack_from(blob)
        if w < 0 or len(blob) != _HEAD.size + 4 * w:
            return None
        return cls(rank, first, np.frombuffer(blob, "<f4", w, _HEAD.size).astype(np.float64), compute,
                   peer, send_share)


@dataclass
class Verdict:
    """One straggler finding: ``kind`` is ``rank`` or ``node``; ``ranks`` the ranks named."""
    kind: str
    ranks: list[int]
    host: str
    share: float
    median_ms: float
    compute_ratio: float | None
    ops: int
    op_names: str
    figures: dict = field(default_factory=dict)
    group: str | None = None      # a group's verdict: its name (``ranks`` are then global ranks)

    @property
    def key(self) -> tuple:
        """What makes two verdicts the same (a verdict is printed again only when this changes)."""
        return (self.kind, tuple(self.ranks), self.group)

    def line(self) -> str:
        of = f" of {self.group}" if self.group else ""
        if self.kind == "link":
            return (f"straggler: the link {self.host} (rank {self.ranks[0]} to rank {self.ranks[1]}) is the slow "
                    f"part: rank {self.ranks[0]}'s sends on it waited {self.share:.0%} of the time, the other "
                    f"ranks' {self.figures.get('others_share', 0.0):.0%} (median) over the last {self.ops} "
                    f"{self.op_names}{of}")
        who = (f"rank {self.ranks[0]} ({self.host})" if self.kind == "rank"
               else f"node {self.host} (ranks {rank_ranges(self.ranks)})")
        told = self.figures.get("told", self.ops)
        among = (f"the last {self.ops} {self.op_names}{of}" if told >= self.ops else
                 f"the {told} of the last {self.ops} {self.op_names}{of} someone was late for")
        text = (f"straggler: {who} arrived last in {self.share:.0%} of {among}, "
                f"median +{self.median_ms:.1f} ms behind the median rank")
        if self.compute_ratio is not None:
            text += f"; its compute between collectives is {self.compute_ratio:.2f}x the others'"
        return text

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": self.ranks, "host": self.host, "share": round(self.share, 4),
                "median_ms": round(self.median_ms, 3),
                "compute_ratio": None if self.compute_ratio is None else round(self.compute_ratio, 3),
                "ops": self.ops, "op_names": self.op_names, "line": self.line(),
                **({"group": self.group} if self.group else {})}

    def in_group(self, members, group: str) -> "Verdict":
        """This verdict of a group's watcher (group ranks) with the members' global ranks and the
        group named: what a reader of the job's output can act on."""
        return replace(self, ranks=[int(members[r]) for r in self.ranks], group=group)


def window_of(records, first: int, w: int, rank: int) -> Row | None:
    """Rank ``rank``'s row for collectives ``first .. first+w-1`` from its flight records (any
    order), or None unless every one of them is kept and ended done."""
    by_seq = {r.seq: r for r in records if first <= r.seq < first + w}
    if len(by_seq) != w:
        return None
    recs = [by_seq[s] for s in range(first, first + w)]
    if any(r.state != "done" or r.t_started is None or r.t_ended is None for r in recs):
        return None
    starts = np.array([r.t_started for r in recs])
    ends = np.array([r.t_ended for r in recs])
    inside = np.maximum(ends - starts, 0.0)
    return Row(rank, first, inside, _outside(starts, ends))


def _outside(starts: np.ndarray, ends: np.ndarray) -> float:
    """Time from the first start to the last end not covered by any [start, end] (async
    collectives overlap: their union is what is inside)."""
    order = np.argsort(starts, kind="stable")
    covered, cur_s, cur_e = 0.0, None, None
    for i in order:
        s, e = starts[i], ends[i]
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        covered += cur_e - cur_s
    return max(0.0, float(ends.max() - starts.min()) - covered)


def judge(rows: list[Row], hosts, rules: Rules = Rules(), op_names: str = "collectives") -> Verdict | None:
    """The verdict for one window from every rank's row (``rows[i].rank`` indexes ``hosts``), or
    None: nobody is late by the rules, fewer than 2 ranks, or too few collectives kept by all."""
    if len(rows) < 2:
        return None
    x = np.vstack([r.inside for r in rows])                   # ranks x collectives
    keep = ~np.isnan(x).any(axis=0)
    x = x[:, keep]
    ops = x.shape[1]
    if ops < 8:
        return None
    ranks = np.array([r.rank for r in rows])
    compute = np.array([r.compute for r in rows])
    gap = float(np.median(compute)) / ops + float(np.median(x))   # one collective to the next
    need = max(rules.min_ms / 1e3, rules.min_frac * gap)
    med = np.median(x, axis=0)
    behind = med[None, :] - x                                 # > 0: arrived after the median rank
    # Only the collectives someone was late for say who is slow: in a step of several collectives
    # back to back (Horovod's negotiation, an optimizer's), only the first after the compute
    # carries the lateness, and the others (everyone already there) would dilute any share.
    told = behind.max(axis=0) >= need
    m = int(told.sum())
    if m < MIN_TOLD:
        return _link(rows, hosts, rules, ops, op_names)
    x, behind = x[:, told], behind[:, told]
    last = np.argmin(x, axis=0)                               # row index of the last to arrive
    late = np.median(behind, axis=1)                          # each rank's median lateness
    count = (behind > 0).sum(axis=1)                          # collectives it was behind in
    after = count / m
    figures = {"need_ms": need * 1e3, "gap_ms": gap * 1e3, "told": m}
    # ... and a share that chance does not give: behind the median is a coin toss for a rank that
    # is not slow, so its count must be beyond what P_MAX of coin tosses reach
    slow = (after >= rules.share) & (late >= need) & (binomial_tail(m)[count] <= P_MAX)
    if not slow.any():
        return _link(rows, hosts, rules, ops, op_names)
    host_of = np.array([hosts[int(r)] for r in ranks])
    for h in sorted(set(host_of[slow])):
        on = host_of == h
        if on.sum() >= 2 and slow[on].all() and (~on).any():        # the whole node, not one rank
            share = float(np.isin(last, np.flatnonzero(on)).mean())
            ratio = _ratio(compute[on], compute[~on])
            return Verdict("node", sorted(int(r) for r in ranks[on]), str(h), share,
                           float(np.median(late[on])) * 1e3, ratio, ops, op_names, figures)
    top = int(np.argmax(np.where(slow, late, -np.inf)))
    r = int(ranks[top])
    return Verdict("rank", [r], hosts[r], float((last == top).mean()), float(late[top]) * 1e3,
                   _ratio(compute[[top]], np.delete(compute, top)), ops, op_names,
                   {**figures, "behind_share": float(after[top])})


def binomial_tail(m: int) -> np.ndarray:
    """``t[k]`` = P(at least k heads in m fair coin tosses), k = 0 .. m (from log-gamma: no big
    integers however large m)."""
    lg = np.array([math.lgamma(i + 1) for i in range(m + 1)])
    pmf = np.exp(lg[m] - lg - lg[::-1] - m * math.log(2.0))
    return np.minimum(1.0, np.cumsum(pmf[::-1])[::-1])


def _link(rows: list[Row], hosts, rules: Rules, ops: int, op_names: str) -> Verdict | None:
    """Nobody arrives late but one rank's sends wait on its ring peer far longer than anyone
    else's: the link between them is slow (every rank then waits alike, so no rank is late)."""
    share = np.array([r.send_share for r in rows])
    top = int(np.argmax(share))
    others = float(np.median(np.delete(share, top)))
    row = rows[top]
    if row.peer < 0 or share[top] < rules.link_share or share[top] < 3 * others + 0.02:
        return None
    a, b = row.rank, row.peer
    return Verdict("link", [a, b], f"{hosts[a]} -> {hosts[b]}", float(share[top]), 0.0, None, ops, op_names,
                   {"others_share": others})


def _ratio(mine: np.ndarray, others: np.ndarray) -> float | None:
    if not len(others):
        return None
    base = float(np.median(others))
    return float(np.median(mine)) / base if base > 0 else None


def lateness(rows: list[Row]) -> dict[int, float]:
    """Each rank's median lateness in ms behind the median rank (negative: early), for the live view."""
    if not rows:
        return {}
    x = np.vstack([r.inside for r in rows])
    x = x[:, ~np.isnan(x).any(axis=0)]
    if x.shape[1] == 0:
        return {}
    med = np.median(x, axis=0)
    return {r.rank: float(np.median(med - x[i])) * 1e3 for i, r in enumerate(rows)}


def cleared_line(previous: Verdict, ops: int) -> str:
    who = (f"rank {previous.ranks[0]} ({previous.host})" if previous.kind == "rank"
           else f"node {previous.host}")
    return f"straggler: none in the last {ops} collectives ({who} no longer arrives last)"


__all__ = ["Rules", "Row", "Verdict", "window_of", "judge", "lateness", "cleared_line"]
