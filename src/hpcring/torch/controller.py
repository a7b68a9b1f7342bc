"""Negotiation: which queued operations are ready on every rank of a process set, in one order.

Each cycle, with the response cache on (:mod:`hpcring.torch.response_cache`), every rank first
sends a small message: header + cache bits. If no rank has an uncached operation queued, none
flags a stall and none has joined, the AND of the bits is the ready list (one small collective).
Otherwise the full negotiation follows: one fixed-size int64 allgather of (header, up to ``CAP``
entries of name hash, signature hash, element count, code, fusion key hash). Entries present on
every (not joined) rank are ready, in the first active rank's submission order. Per-op failures
(every rank decides them from the same table, so they agree):

* the same name with a different signature: that operation fails on every rank
  (:class:`TensorMismatchError` naming the ranks and what each submitted);
* while a rank has joined, an operation other than a Sum/Average allreduce fails on the other
  ranks (:class:`JoinedRankError`, as Horovod: "not supported with Join"); the joined rank
  contributes zeros to Sum/Average allreduces;
* a stall flag from any rank: :mod:`hpcring.torch.stall` names the unmatched operations, and
  every rank fails those of them it has had queued for more than half the deadline (so that the
  ranks of a rank-dependent branch, whose clocks started a moment apart, fail in the same cycle).

Header: flags (1: stalled), entry count, join cycle (+1; 0 = not joined), fusion threshold, cycle
time (us) and the number of uncached entries; rank 0's threshold and cycle time hold everywhere
(the autotuner runs on rank 0, and fusion must be cut the same way on every rank).
"""
from __future__ import annotations

import time

import numpy as np

from hpcring.errors import CollectiveError
from hpcring.ranks import rank_ranges
from hpcring.torch import stall
from hpcring.torch.entry import KINDS, StandIn, dtype_name
from hpcring.torch.exceptions import HorovodInternalError, JoinedRankError, TensorMismatchError
from hpcring.torch.response_cache import ResponseCache

CAP = 128          # entries per full negotiation message; more wait for the next cycle
HDR = 6
FIELDS = 5
OPS = ("sum", "min", "max", "prod")


def code_of(e) -> int:
    """(root + 1) << 16 | kind << 12 | op << 8 | dtype (the entry's own code carries kind and dtype)."""
    kind, dt = divmod(e.code, 256)
    return ((e.root + 1) << 16) | (kind << 12) | ((OPS.index(e.op) if e.op in OPS else 0) << 8) | dt


def decode(code: int) -> tuple[str, str, int, int]:
    """(kind, op, root, dtype code) of a negotiated code."""
    return KINDS[(code >> 12) & 15], OPS[(code >> 8) & 15], (code >> 16) - 1, code & 255


class Negotiation:
    """What one negotiation cycle decided: the entries ready on every rank, in order, and those failed."""

    __slots__ = ("ready", "failed", "all_joined", "last_joined", "full", "collectives")

    def __init__(self) -> None:
        self.ready: list = []
        self.failed: list = []           # (entry, error)
        self.all_joined = False
        self.last_joined = -1
        self.full = False
        self.collectives = 0


class Controller:
    def __init__(self, comm, *, cache_capacity: int, timeout: float, members=None) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.timeout = timeout
        self.members = members                      # global ranks of this set (names in messages)
        self.cache = ResponseCache(cache_capacity) if cache_capacity > 0 else None
        self.threshold = 0
        self.cycle_us = 0

    def _g(self, rs) -> str:
        g = [self.members[r] for r in rs] if self.members else list(rs)
        return f"{'rank' if len(g) == 1 else 'ranks'} {rank_ranges(g)}"

    def _allgather(self, msg: np.ndarray, batch: list) -> np.ndarray:
        try:
            return self.comm.allgather(msg, timeout=self.timeout).reshape(self.size, -1)
        except CollectiveError as err:
            waiting = ", ".join(e.describe() for e in batch[:5]) + (" ..." if len(batch) > 5 else "")
            raise HorovodInternalError(f"hpcring.torch: rank {self.rank} was matching operations by name "
                                       f"({waiting or 'join'}) when the negotiation failed: {err.message}",
                                       hint=err.hint) from None

    def negotiate(self, pending: list, joined_cycle: int, stalled: bool, threshold: int, cycle_us: int) -> Negotiation:
        out = Negotiation()
        if self.cache is not None:
            vec, uncached, by_slot = self.cache.bits(pending)
            small = np.zeros(HDR + self.cache.words, dtype=np.int64)
            small[:HDR] = (int(stalled), len(pending), joined_cycle, threshold, cycle_us, uncached)
            small[HDR:] = vec
            t = self._allgather(small, pending)
            out.collectives += 1
            self.threshold, self.cycle_us = int(t[0, 3]), int(t[0, 4])
            if not t[:, 0].any() and not t[:, 2].any() and not t[:, 5].any():
                slots = ResponseCache.common(t[:, HDR:])
                self.cache.touch(slots)
                self.cache.hits += len(slots)
                out.ready = [by_slot[s] for s in slots]
                return out
        self._full(pending[:CAP], joined_cycle, stalled, threshold, cycle_us, out)
        return out

    def _full(self, batch, joined_cycle, stalled, threshold, cycle_us, out: Negotiation) -> None:
        out.full = True
        msg = np.zeros(HDR + FIELDS * CAP, dtype=np.int64)
        msg[:HDR] = (int(stalled), len(batch), joined_cycle, threshold, cycle_us, 0)
        for i, e in enumerate(batch):
            msg[HDR + FIELDS * i: HDR + FIELDS * (i + 1)] = (e.name_hash, e.sig_hash, e.numel, code_of(e), e.fuse_hash)
        table = self._allgather(msg, batch)
        out.collectives += 1
        self.threshold, self.cycle_us = int(table[0, 3]), int(table[0, 4])
        joined = [int(table[r, 2]) for r in range(self.size)]
        active = [r for r in range(self.size) if not joined[r]]
        entries = []
        for r in range(self.size):
            row = table[r, HDR: HDR + FIELDS * int(table[r, 1])].reshape(-1, FIELDS).tolist()
            entries.append({v[0]: v for v in row})
        mine = {e.name_hash: e for e in batch}
        decided: set[int] = set()
        if active:
            first = active[0]
            order = table[first, HDR: HDR + FIELDS * int(table[first, 1])].reshape(-1, FIELDS)[:, 0].tolist()
            for h in order:
                if not all(h in entries[r] for r in active):
                    continue
                e = mine.get(h)
                decided.add(h)
                if len({entries[r][h][1] for r in active}) > 1:
                    if e is not None:
                        out.failed.append((e, self._mismatch(e, h, entries, active)))
                    continue
                _, sig, numel, code, fuse = entries[first][h]
                kind, op, _, dt = decode(code)
                if len(active) < self.size and (kind != "allreduce" or op != "sum"):
                    if e is not None and not joined[self.rank]:
                        what = kind if kind != "allreduce" else f"allreduce with op {op}"
                        out.failed.append((e, JoinedRankError(
                            f"hpcring.torch: {what} '{e.name}' is not supported while {self._g([r for r in range(self.size) if joined[r]])} "
                            f"has joined (hvd.join()); only Sum/Average allreduces proceed with joined ranks (as in Horovod)",
                            hint="make every rank run this operation before any rank calls hvd.join()")))
                    continue
                if e is None:
                    e = StandIn(h, numel, dt, fuse)
                out.ready.append(e)
                if self.cache is not None:
                    self.cache.put(h, sig)
            if self.cache is not None:
                self.cache.misses += len(out.ready)
        else:
            out.all_joined = True
            out.last_joined = max(range(self.size), key=lambda r: (joined[r], r))
        if table[:, 0].any():
            err, partial = stall.inspect(self.comm, batch, self.timeout, self.members)
            out.collectives += 2
            now = time.time()
            for e in batch:
                # half the deadline: another rank's stalled operation (flagged a moment earlier)
                # fails here in the same cycle, an operation queued just now is left to match
                if e.name_hash not in decided and e.name in partial and now - e.t_queued > self.timeout / 2:
                    out.failed.append((e, err))

    def _mismatch(self, e, h: int, entries, active) -> TensorMismatchError:
        groups: dict[int, list[int]] = {}
        for r in active:
            groups.setdefault(entries[r][h][1], []).append(r)
        parts, seen = [], set()
        for sig, rs in groups.items():
            _, _, numel, code, _ = entries[rs[0]][h]
            kind, op, root, dt = decode(code)
            how = f" ({op})" if kind in ("allreduce", "reducescatter") else ""
            if kind == "broadcast":
                how = f" from root {self.members[root] if self.members else root}"
            text = f"{kind}{how} of {numel} x {dtype_name(dt)}"
            if text in seen:
                text += " (other shape or scale factors)"
            seen.add(text)
            parts.append(f"{self._g(rs)}: {text}")
        return TensorMismatchError(
            f"hpcring.torch: operation '{e.name}' differs across ranks (kind, shape, dtype, op, "
            f"scale factors or root): " + "; ".join(parts),
            hint="every rank must submit the same operation under one name")
