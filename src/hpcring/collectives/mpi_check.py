"""The MPI backend's signature check (see :mod:`hpcring.collectives.mpi`): every rank's call agreed
on before MPI sees its buffers; small calls folded into it."""
from __future__ import annotations

import struct

import numpy as np

from hpcring.collectives.backends import DTYPES, OPS
from hpcring.errors import CollectiveError
from hpcring.config.envvars import get

CHECK_ENV = "HPCRING_MPI_CHECK_SIGNATURES"

# signature: (kind, count, dtype, reduction, root, seq) as int64; -1 = none
KINDS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall", "barrier")
SIG_LEN = 6
# The check's allreduce is polled without sleeping for its first 1 ms: ranks in step finish it in
# that time, and a sleeping poll would add its latency to every call (measured, docs/collectives.md).
CHECK_SPIN_S = 1e-3
# The same holds for the collective itself when it is small (its buffers, all together, at most
# SPIN_BYTES): a 4 KiB allreduce takes ~30 us in MPI, while one sleeping poll cost 0.2-2 ms on the
# loaded 2-core dev machine (benchmarks/per_call.py). Larger ones sleep between polls at once.
SPIN_BYTES = 256 << 10
# The check folded into the data (communicators of at most FOLD_RANKS ranks): the check is one
# Iallgather of a fixed-size slot per rank, the signature (SLOT_HEADER bytes) then up to FOLD_BYTES
# of the call's data. The slot's size never depends on the call, so ranks that disagree still make
# matching MPI calls (no truncation, no heap corruption) and each one sees every rank's signature
# (the named mismatch needs no second call). A call whose data fits (a 4 KiB allreduce, allgather,
# ...) is then done locally from the gathered slots: one MPI call in all. Above FOLD_RANKS ranks
# the gathered slots would grow with the ranks: the check is the (signature, -signature) MAX
# Iallreduce (constant size), and the data goes in its own call.
FOLD_BYTES = 4096
FOLD_RANKS = 8
SLOT_HEADER = 8 * 6             # SIG_LEN int64
_pack_sig = struct.Struct("=6q").pack_into      # the signature into a slot's header


def check_default() -> bool:
    """HPCRING_MPI_CHECK_SIGNATURES (0/false/no/off disable), default on."""
    return get(CHECK_ENV)


def signature(kind: str, seq: int, count: int = 0, dtype: str | None = None, op: str | None = None,
              root: int | None = None) -> np.ndarray:
    """The call's signature as int64 (see :data:`KINDS`)."""
    return np.array([KINDS.index(kind), count, DTYPES.index(dtype) if dtype in DTYPES else -1,
                     OPS.index(op) if op in OPS else -1, -1 if root is None else root, seq], np.int64)


def describe_signature(sig) -> str:
    """``allreduce#5(count=.., dtype=.., op=.., root=..)`` as the ring's mismatch message has it."""
    kind, count, dtype, op, root, seq = (int(v) for v in sig)
    name = KINDS[kind] if 0 <= kind < len(KINDS) else f"op{kind}"
    return (f"{name}#{seq}(count={count}, dtype={DTYPES[dtype] if 0 <= dtype < len(DTYPES) else 'none'}, "
            f"op={OPS[op] if 0 <= op < len(OPS) else 'none'}, root={root})")


def mismatch_message(table, rank: int, hosts=None) -> str | None:
    """The ring's wording for the first rank whose signature (a row of ``table``) differs from
    ``rank``'s; None when all agree."""
    mine = tuple(int(v) for v in table[rank])
    for r, row in enumerate(table):
        if tuple(int(v) for v in row) != mine:
            host = f" ({hosts[r]})" if hosts and r < len(hosts) else ""
            return (f"{KINDS[mine[0]]}#{mine[5]} mismatched collective: rank {r}{host} called "
                    f"{describe_signature(row)} but this rank ({rank}) called {describe_signature(mine)}")
    return None


class SignatureCheck:
    """Mixed into :class:`~hpcring.collectives.mpi.MpiBackend`: the check's calls."""

    def _folds(self, nbytes: int) -> bool:
        """Does a call with ``nbytes`` of data per rank ride in the check's slot (done locally)?"""
        return self.check and self.fold and nbytes <= FOLD_BYTES

    def _gather(self, sig, name: str, seq: int, desc, timeout: float, t0: float, payload=None) -> np.ndarray:
        """The folded check: one Iallgather of every rank's slot (signature, then ``payload``'s
        bytes, at most FOLD_BYTES); raises the named mismatch on every rank; returns the gathered
        slots (ranks x slot bytes, uint8) for the call to take its data from."""
        slot, table, heads, spec = self._slots or self._make_slots()
        _pack_sig(slot, 0, *sig)
        if payload is not None and payload.nbytes:
            slot[SLOT_HEADER:SLOT_HEADER + payload.nbytes] = payload
        try:
            req = self._comm.Iallgather(spec[0], spec[1])
        except self._MPI.Exception as e:
            self._start_failed(name, seq, desc, e)
        if not req.Test():
            self._wait(req, name, seq, desc, timeout, t0, (slot, table), CHECK_SPIN_S)
        got = heads.tobytes()              # every rank's signature; this rank's own is row rank
        at = self._rank * SLOT_HEADER
        if got != got[at:at + SLOT_HEADER] * self._size:
            self._mismatch(name, seq, np.frombuffer(got, np.int64).reshape(self._size, SIG_LEN))
        return table

    def _make_slots(self) -> tuple:
        """The folded check's buffers (made once): this rank's slot, the gathered slots, views of
        this slot's signature and of every rank's, and the Iallgather's buffer arguments."""
        width = SLOT_HEADER + FOLD_BYTES
        table = np.zeros((self._size, width), np.uint8)
        slot = table[self._rank]            # in place: this rank's slot is its row of the gathered ones
        self._slots = (slot, table, table[:, :SLOT_HEADER], (self._MPI.IN_PLACE, [table, self._MPI.BYTE]))
        return self._slots

    def _views_of(self, dtype: str, dt: np.dtype, nb: int) -> tuple:
        """(this rank's slot data, every rank's gathered data) for ``nb`` bytes of ``dtype`` (``dt``:
        its storage), then the slot, the Iallgather's arguments and the gathered signatures
        (cached per (dtype, nb))."""
        key = (dtype, nb)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            slot, table, heads, spec = self._slots or self._make_slots()
            end = SLOT_HEADER + nb
            views = self._views[key] = (slot[SLOT_HEADER:end].view(dt),
                                        [table[r, SLOT_HEADER:end].view(dt) for r in range(self._size)],
                                        slot, spec, heads)
        return views

    def _mismatch(self, name: str, seq: int, sigs) -> None:
        """Every rank has every rank's signature (``sigs``, ranks x SIG_LEN): the sticky, named error."""
        msg = mismatch_message(sigs, self._rank, self._hosts) or f"{name}#{seq} mismatched collective"
        self._error = msg
        raise CollectiveError(msg, hint="every rank must call the same collectives in the same order with "
                                        f"the same sizes, dtypes and roots (checked before MPI: {CHECK_ENV})")

    def _agree(self, sig, name: str, seq: int, desc, timeout: float, t0: float) -> None:
        """The signature check (:mod:`hpcring.collectives.mpi`'s docstring): raises the named
        mismatch on every rank. ``sig``: :func:`signature`'s array, or the same values as a tuple
        of ints (hot path)."""
        if self.fold:
            self._gather(sig, name, seq, desc, timeout, t0)
            return
        buf = self._sig
        if type(sig) is not tuple:
            sig = tuple(int(v) for v in sig)
        k, n, d, o, root, q = sig
        full = [k, n, d, o, root, q, -k, -n, -d, -o, -root, -q]    # (signature, -signature)
        buf[:] = full                   # one assignment: cheaper than numpy ops
        MPI = self._MPI
        try:
            req = self._comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.INT64_T], MPI.MAX)
        except MPI.Exception as e:
            self._start_failed(name, seq, desc, e)
        self._wait(req, name, seq, desc, timeout, t0, (buf,), CHECK_SPIN_S)
        # MAX of the signatures and of their negations (= -MIN): equal to this rank's own
        # (signature, -signature) exactly when every rank's signature is this one
        if buf.tolist() == full:
            return
        # every rank saw the difference (same allreduce result): all gather the signatures
        table = np.empty((self._size, SIG_LEN), np.int64)
        mine = np.array(sig, np.int64)
        self._start_wait(name, seq, desc, timeout, t0, (mine, table),
                         lambda: self._comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]))
        self._mismatch(name, seq, table)
