"""Horovod's response cache: once an operation (name + signature) has been negotiated, every rank
gives it the same slot, and later cycles announce it by one bit instead of a full entry.

Each cycle first exchanges a small fixed-size message (header + one bit per slot, 63 slots per
int64 word). When no rank has an uncached operation queued, no rank stalls and none has joined,
the bitwise AND of the bit vectors is what is ready everywhere, in slot order: one small
collective per cycle (a steady training step). Otherwise the full negotiation follows in the
same cycle.

Slots are assigned and evicted only from the negotiated ready lists, which are identical on
every rank of the set (in order), so the caches stay identical without any exchange: a new
(name, signature) takes the lowest free slot or, when the cache is full, the least recently
ready one's. The same name with a new signature keeps its slot with the new signature (a rank
still announcing the old one cannot match it: it negotiates in full, and the mismatch is named).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

BITS = 63                     # per int64 word (the sign bit stays clear)


def words(capacity: int) -> int:
    return (capacity + BITS - 1) // BITS


class ResponseCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.words = words(capacity)
        self._slot: dict[int, int] = {}                      # name hash -> slot
        self._sig: list[int] = [0] * capacity                # slot -> signature hash
        self._name: list[int | None] = [None] * capacity     # slot -> name hash
        self._lru: OrderedDict[int, None] = OrderedDict()    # name hashes, least recent first
        self._free = list(range(capacity - 1, -1, -1))       # pop() gives the lowest
        self.hits = self.misses = 0

    def slot(self, name_hash: int, sig_hash: int) -> int:
        """The slot of this exact operation, or -1."""
        s = self._slot.get(name_hash, -1)
        return s if s >= 0 and self._sig[s] == sig_hash else -1

    def bits(self, entries) -> tuple[np.ndarray, int, dict[int, object]]:
        """(bit words, number of entries without a slot, slot -> entry) for this rank's batch."""
        vec = np.zeros(self.words, dtype=np.int64)
        by_slot: dict[int, object] = {}
        uncached = 0
        for e in entries:
            s = self.slot(e.name_hash, e.sig_hash)
            if s < 0:
                uncached += 1
                continue
            by_slot[s] = e
            vec[s // BITS] |= np.int64(1 << (s % BITS))
        return vec, uncached, by_slot

    @staticmethod
    def common(table: np.ndarray) -> list[int]:
        """The slots set in every row of ``table`` (rows: ranks' bit words), ascending."""
        both = np.bitwise_and.reduce(table, axis=0)
        out = []
        for w, v in enumerate(both.tolist()):
            while v:
                low = v & -v
                out.append(w * BITS + low.bit_length() - 1)
                v ^= low
        return out

    def touch(self, slots: list[int]) -> None:
        """These slots' operations were ready (in this order): most recent now."""
        for s in slots:
            h = self._name[s]
            if h is not None:
                self._lru.move_to_end(h)

    def put(self, name_hash: int, sig_hash: int) -> None:
        """A fully negotiated ready operation (called in the negotiated order on every rank)."""
        if self.capacity <= 0:
            return
        s = self._slot.get(name_hash)
        if s is None:
            if self._free:
                s = self._free.pop()
            else:
                old, _ = self._lru.popitem(last=False)
                s = self._slot.pop(old)
            self._slot[name_hash] = s
            self._name[s] = name_hash
        self._sig[s] = sig_hash
        self._lru[name_hash] = None
        self._lru.move_to_end(name_hash)

    def __len__(self) -> int:
        return len(self._slot)
