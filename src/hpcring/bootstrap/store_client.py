"""The rendezvous store's blocking client, used by every rank (see store_wire for the protocol).

The store's operations; the connection they travel on (connect, handshake, frames) is
:class:`~hpcring.bootstrap.store_connection.StoreConnection`."""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from hpcring.bootstrap.store_batches import as_items, item_batches, key_batches, label
from hpcring.bootstrap.store_connection import ClientBusy, StoreConnection
from hpcring.bootstrap.store_wire import (DEFAULT_MAX_FRAME, F64, I64, MAX_GET_TIMEOUT, MGET_RANGE, MGET_VALUES,
                                          OP_ADD, OP_CHECK, OP_DELETE, OP_GET, OP_MCHECK, OP_MGET, OP_MSET, OP_PING,
                                          OP_SET, ST_ERROR, ST_OK, ST_TIMEOUT, ST_TOOBIG, StoreTimeoutError,
                                          decode_indices, decode_values, encode_key_range, encode_keys,
                                          encode_request, key_range)
from hpcring.errors import BootstrapError
from hpcring.netio import time_left

if TYPE_CHECKING:
    import socket

    from hpcring.bootstrap.store_server import StoreServer
from hpcring.config.envvars import check_number

__all__ = ["StoreClient", "ClientBusy"]


def _seconds(what: str, value) -> float:
    """A wait in seconds from a caller: finite and in [0, MAX_GET_TIMEOUT], else UsageError."""
    return check_number(what, value, lo=0, hi=MAX_GET_TIMEOUT)


class _ReplyTooBig(BootstrapError):
    """The server would not fit a batched read's reply in one frame (ST_TOOBIG): ask in halves."""


class StoreClient:
    """Blocking client of a :class:`StoreServer`; safe to share between threads (one lock).

    Contract: the constructor connects and authenticates, retrying refused or timed-out connects
    with backoff until ``timeout`` seconds have passed (rank 0 may start late); a peer that fails
    authentication is not retried (:class:`StoreAuthError`). Every call has a deadline (its own
    ``timeout`` or the client's) and raises :class:`BootstrapError` naming the store address, the
    key and what to check.
    """

    @property
    def secret(self) -> bytes:
        """The job secret this client authenticated with: what the rank's later listeners and
        connections use, so that a rank reads the secret file once (it may be gone later)."""
        return self._secret

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 60.0, *,
                 max_frame: int = DEFAULT_MAX_FRAME, connect_retry: bool = True) -> None:
        if not secret:
            raise BootstrapError("StoreClient needs a non-empty per-job secret")
        self.host, self.port = host, int(port)
        self.timeout = _seconds("StoreClient timeout", timeout)
        self.max_frame = max_frame
        self._secret = bytes(secret)
        self._conn = StoreConnection(host, port, self._secret, max_frame)
        self.server: StoreServer | None = None   # set by init_bootstrap on rank 0 to keep it alive
        self._conn.connect(time.monotonic() + self.timeout, self.timeout, retry=connect_retry)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def _sock(self) -> socket.socket | None:
        """The connection's socket; None once closed (elastic's member reads its local address)."""
        return self._conn.sock

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one round trip ---------------------------------------------------------------------
    def _call(self, op: int, key: str, args: bytes, wait: float, limit: float | None = None) -> tuple[int, bytes]:
        return self._pipeline([(op, key, args)], wait, key, limit)[0]

    def _pipeline(self, requests: list[tuple[int, str, bytes]], wait: float, key: str,
                  limit: float | None = None) -> list[tuple[int, bytes]]:
        """Send every request, then read every reply: one round trip however many there are.
        ``key`` names the request in errors (a batch's keys are summarised by the caller).
        ``limit``: a bound on the whole call, the wait for another thread's call included
        (:class:`ClientBusy` when that wait alone passes it); None: ``wait`` + 5 s per read."""
        bodies = [encode_request(op, k, args) for op, k, args in requests]
        replies = self._conn.round_trip(bodies, wait, key, limit)
        for status, payload in replies:   # every reply is read first: the stream stays in step
            if status == ST_TOOBIG:
                raise _ReplyTooBig(payload.decode("utf-8", "replace"))
            if status == ST_ERROR:
                raise BootstrapError(f"store at {self.address} refused the request on key {key!r}: "
                                     f"{payload.decode('utf-8', 'replace')}")
        return replies

    # -- API --------------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites) and wake every rank blocked on it."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"store values are bytes, not {type(value).__name__} (key {key!r})")
        self._call(OP_SET, key, bytes(value), self.timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, blocking until it exists; BootstrapError after ``timeout`` seconds."""
        if timeout is None:
            wait = self.timeout
        else:   # a deadline already passed means "do not block" (gather/wait compute what is left)
            negative = isinstance(timeout, (int, float)) and timeout < 0
            wait = _seconds(f"store get({key!r}) timeout", 0.0 if negative else timeout)
        status, payload = self._call(OP_GET, key, F64.pack(wait), wait)
        if status == ST_TIMEOUT:
            raise StoreTimeoutError(
                f"timed out after {wait:.1f}s waiting for key {key!r} in the rendezvous store at {self.address}",
                hint="some rank did not reach this point: check that every rank started (scheduler log), "
                     "that all ranks use the same job id and world size, and the logs of the rank "
                     "that should have published this key", missing=[key])
        return payload

    def gather(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` in order, blocking until all exist; one deadline covers them all.
        One round trip (:meth:`multi_get`).

        On timeout raises :class:`StoreTimeoutError` whose ``missing`` lists every key still absent
        (not only the first), so callers can name all the ranks that did not arrive.
        """
        return self.multi_get(keys, timeout)

    # -- batched ----------------------------------------------------------------------------
    def multi_set(self, items: Mapping[str, bytes] | Iterable[tuple[str, bytes]]) -> None:
        """Store every ``(key, value)`` and wake the ranks blocked on them, in one round trip."""
        items = as_items(items)
        self._pipeline([(OP_MSET, "", args) for args in item_batches(items, self.max_frame)], self.timeout,
                       label([k for k, _ in items]))

    def multi_get(self, keys: Iterable[str], timeout: float | None = None, *, values: bool = True) -> list[bytes]:
        """The values of ``keys`` in order, blocking until all exist, in one round trip (the
        server parks the request); one deadline covers them all. Raises
        :class:`StoreTimeoutError` whose ``missing`` lists every key absent at the deadline.
        ``values=False``: only wait (the reply carries no values; returns ``[]``)."""
        keys = list(keys)
        wait = self.timeout if timeout is None else self._wait_arg(timeout, "store multi_get timeout")
        return self._mget(keys, wait, time.monotonic() + wait, values, [])

    def multi_check(self, keys: Iterable[str]) -> list[bytes | None]:
        """The value of each key, or None where it does not exist; never blocks on the keys."""
        keys = list(keys)
        out: list[bytes | None] = []
        for chunk in key_batches(keys, self.max_frame):
            out += self._mcheck(chunk)
        return out

    def _mcheck(self, keys: list[str]) -> list[bytes | None]:
        try:
            _, payload = self._call(OP_MCHECK, "", encode_keys(keys), self.timeout)
        except _ReplyTooBig:
            if len(keys) == 1:
                return [self.check(keys[0])]
            return self._mcheck(keys[:len(keys) // 2]) + self._mcheck(keys[len(keys) // 2:])
        return self._values(payload, len(keys))

    def exchange(self, publish: Mapping[str, bytes] | Iterable[tuple[str, bytes]], keys: Iterable[str],
                 timeout: float | None = None) -> list[bytes]:
        """Publish ``publish`` and read ``keys`` (waiting until all exist), in one round trip: the
        MSET and the MGET travel together and the server answers them in order. A rendezvous
        ("my address; everyone's addresses") in one call. Errors as :meth:`multi_get`."""
        items, keys = as_items(publish), list(keys)
        wait = self.timeout if timeout is None else self._wait_arg(timeout, "store exchange timeout")
        deadline = time.monotonic() + wait
        pre = [(OP_MSET, "", args) for args in item_batches(items, self.max_frame)] if items else []
        return self._mget(keys, wait, deadline, True, pre)

    def _wait_arg(self, timeout, what: str) -> float:
        negative = isinstance(timeout, (int, float)) and timeout < 0   # a deadline already passed
        return _seconds(what, 0.0 if negative else timeout)

    def _values(self, payload: bytes, n: int) -> list[bytes | None]:
        try:
            values = decode_values(payload)
        except ValueError as e:
            raise BootstrapError(f"store at {self.address} sent a malformed value list: {e}") from None
        if len(values) != n:
            raise BootstrapError(f"store at {self.address} answered {len(values)} values for {n} keys")
        return values

    def _mget(self, keys: list[str], wait: float, deadline: float, values: bool,
              pre: list[tuple[int, str, bytes]]) -> list[bytes]:
        """MGET ``keys`` (after the pipelined requests ``pre``); batches beyond the frame cap are
        asked one after the other, each with what is left of ``deadline``."""
        flag = MGET_VALUES if values else 0
        out: list[bytes] = []
        rng = key_range(keys)   # "every rank's key": sent as prefix + range, a few bytes
        batches = [keys] if rng else key_batches(keys, self.max_frame) if keys else []
        for i, chunk in enumerate(batches):
            left = time_left(deadline)
            if rng:
                args = bytes([flag | MGET_RANGE]) + encode_key_range(rng[0], rng[1], len(keys))
            else:
                args = bytes([flag]) + encode_keys(chunk)
            reqs = (pre if i == 0 else []) + [(OP_MGET, "", F64.pack(left) + args)]
            try:
                status, payload = self._pipeline(reqs, left, label(chunk))[-1]
            except _ReplyTooBig:   # the values pass one frame (``pre`` went through): ask in halves
                if len(chunk) == 1:
                    out.append(self.get(chunk[0], timeout=time_left(deadline)))
                else:
                    half = len(chunk) // 2
                    out += self._mget(chunk[:half], wait, deadline, values, [])
                    out += self._mget(chunk[half:], wait, deadline, values, [])
                continue
            if status == ST_TIMEOUT:
                try:
                    missing = [chunk[j] for j in decode_indices(payload)]
                except (ValueError, IndexError) as e:
                    raise BootstrapError(f"store at {self.address} sent a malformed timeout reply: {e}") from None
                later = [k for batch in batches[i + 1:] for k in batch]
                if later:   # name every absent key, as the one-key-at-a-time gather did
                    missing += [k for k, v in zip(later, self.multi_check(later)) if v is None]
                raise StoreTimeoutError(
                    f"timed out after {wait:.1f}s waiting for key {missing[0]!r} in the rendezvous "
                    f"store at {self.address}; {len(missing)} of {len(keys)} keys still missing",
                    hint="some rank did not reach this point: check that every rank started (scheduler "
                         "log), that all ranks use the same job id and world size, and the logs of the "
                         "rank that should have published this key", missing=missing)
            if values:
                out += self._values(payload, len(chunk))
        if not batches and pre:
            self._pipeline(pre, wait, "(publish)")
        return out

    def check(self, key: str) -> bytes | None:
        """The value of ``key`` if present, else None (never blocks on the key)."""
        status, payload = self._call(OP_CHECK, key, b"", self.timeout)
        return payload if status == ST_OK else None

    def delete(self, key: str) -> bool:
        status, _ = self._call(OP_DELETE, key, b"", self.timeout)
        return status == ST_OK

    def add(self, key: str, n: int, *, timeout: float | None = None) -> int:
        """Atomically add ``n`` to the integer at ``key`` (missing = 0) and return the new value.
        ``timeout``: a bound on the whole call (another thread's call on this client included:
        :class:`ClientBusy`, nothing sent); past it the connection is dropped. Default: the
        client's timeout for the reply."""
        limit = None if timeout is None else _seconds("add timeout", timeout)
        _, payload = self._call(OP_ADD, key, I64.pack(int(n)), self.timeout, limit)
        return I64.unpack(payload)[0]

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key exists; one deadline covers them all (one round trip)."""
        self.multi_get(keys, timeout, values=False)

    def barrier(self, name: str, size: int, timeout: float | None = None) -> None:
        """Return once ``size`` participants have entered barrier ``name`` (one use per name).

        Not a way to leave together: the store's host must not exit straight after one (see
        :meth:`leave`)."""
        wait = self.timeout if timeout is None else _seconds(f"barrier {name!r} timeout", timeout)
        deadline = time.monotonic() + wait
        count_key, done_key = f"__barrier/{name}/count", f"__barrier/{name}/done"
        n = self.add(count_key, 1)
        if n > size:
            raise BootstrapError(f"barrier {name!r} at store {self.address} entered {n} times for size {size}",
                                 hint="barrier names are single-use; use a fresh name each time")
        if n == size:
            # The last one in releases the others and leaves: a get() here could race rank 0
            # finishing the barrier and exiting (taking the store with it).
            self.set(done_key, b"1")
            return
        try:
            self.get(done_key, timeout=time_left(deadline))
        except BootstrapError as e:
            arrived = self.check(count_key) if self._conn.sock is not None else None
            got = arrived.decode() if arrived else "?"
            if "timed out" not in e.message:   # the store went away: that error says it better
                raise
            raise BootstrapError(f"barrier {name!r} timed out after {wait:.1f}s at store {self.address}: "
                                 f"{got} of {size} ranks arrived (waiting for key {done_key!r})",
                                 hint="the missing ranks never reached this barrier: check that every "
                                      "rank started and look at the logs of the slowest ones") from e

    def leave(self, rank: int, size: int, linger: float) -> None:
        """At exit: every rank but 0 says it is done with the store; rank 0, which serves it, waits
        up to ``linger`` seconds until the other ``size - 1`` have said so.

        A barrier is not enough before exit: the last rank in may be rank 0, and a slower rank's
        wait for the barrier's key may reach the store only after rank 0 has exited with it (seen
        under load: 'closed the connection while waiting for key __barrier/.../done'). Waits
        once, under one deadline; never raises for a rank that is already gone.
        """
        if rank != 0:
            self.add("__leave/count", 1)
            return
        deadline = time.monotonic() + linger
        while self.add("__leave/count", 0) < size - 1 and time.monotonic() < deadline:
            time.sleep(0.02)

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time in seconds."""
        t0 = time.monotonic()
        self._call(OP_PING, "", b"", timeout)
        return time.monotonic() - t0
