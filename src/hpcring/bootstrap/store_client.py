"""The rendezvous store's blocking client, used by every rank (see store_wire for the protocol)."""
from __future__ import annotations

import hmac
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_wire import (COUNT, DEFAULT_MAX_FRAME, F64, HEADER, I64, KEYLEN, MAC_LEN,
                                          MAX_GET_TIMEOUT, MGET_RANGE, MGET_VALUES, OP_ADD, OP_CHECK, OP_DELETE,
                                          OP_GET, OP_MCHECK, OP_MGET, OP_MSET, OP_PING, OP_SET,
                                          SECRET_HINT, ST_ERROR, ST_OK, ST_TIMEOUT, ST_TOOBIG, _DIR_TO_CLIENT,
                                          _DIR_TO_SERVER, StoreAuthError, StoreTimeoutError,
                                          decode_indices, decode_values, encode_frame, encode_items,
                                          encode_key_range, encode_keys, encode_request, frame_mac,
                                          key_range, session_key)
from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact, time_left

if TYPE_CHECKING:
    from hpcring.bootstrap.store_server import StoreServer

def _seconds(what: str, value) -> float:
    """A wait in seconds from a caller: finite and in [0, MAX_GET_TIMEOUT], else UsageError."""
    from hpcring.config.envvars import check_number
    return check_number(what, value, lo=0, hi=MAX_GET_TIMEOUT)


class _ReplyTooBig(BootstrapError):
    """The server would not fit a batched read's reply in one frame (ST_TOOBIG): ask in halves."""


class ClientBusy(BootstrapError):
    """Another thread held this client for longer than the call's ``timeout``: nothing was sent
    (the caller may use a connection of its own)."""


class _StoreBusy(ConnectionResetError):
    """The server closed a new connection before its hello: full, or pausing accepts (retryable)."""


_RETRYABLE_CONNECT = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
                      TimeoutError, socket.timeout)


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
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._key = b""
        self._send_seq = 0
        self._recv_seq = 0
        self.server: StoreServer | None = None   # set by init_bootstrap on rank 0 to keep it alive
        self._connect(time.monotonic() + self.timeout, retry=connect_retry)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- connection -------------------------------------------------------------------------
    def _connect(self, deadline: float, retry: bool = True) -> None:
        delay, last_error = 0.02, None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BootstrapError(
                    f"could not connect to the rendezvous store at {self.address} "
                    f"within {self.timeout:.0f}s (last error: {last_error})",
                    hint="check that rank 0 is running and reached init_bootstrap, that the master "
                         "address is reachable from this host (interface, firewall) and that "
                         "HPCRING_MASTER_ADDR/MASTER_ADDR point at rank 0's node")
            try:
                self._sock = self._open(min(remaining, 5.0))
                return
            except StoreAuthError:
                raise
            except (OSError, *_RETRYABLE_CONNECT) as e:
                last_error = f"{type(e).__name__}: {e}"
                if not retry:   # the caller runs its own loop over several ports
                    raise BootstrapError(f"could not connect to the rendezvous store at {self.address}: "
                                         f"{last_error}") from e
            time.sleep(min(delay, time_left(deadline)))
            delay = min(delay * 2, 1.0)

    def _open(self, budget: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=budget)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(budget, 1.0))
            self._handshake(sock)
            return sock
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket) -> None:
        try:
            ns = auth.STORE.read_hello(sock)
        except auth.NotAPeer as e:
            raise StoreAuthError(f"peer at {self.address} is not an hpcring store (bad hello)",
                                 hint=SECRET_HINT) from e
        except (EOFError, ConnectionResetError, TimeoutError, socket.timeout) as e:
            # An hpcring store under a flood drops (or is slow to greet) new connections: retry.
            raise _StoreBusy(f"the store closed the connection before its hello (busy, or not an "
                             f"hpcring store): {e or type(e).__name__}") from e
        except OSError as e:
            raise StoreAuthError(f"peer at {self.address} is not an hpcring store (no hello: {e})",
                                 hint=SECRET_HINT) from e
        try:
            nc = auth.STORE.prove(sock, self._secret, ns)
        except auth.BadProof as e:
            raise StoreAuthError(f"the server at {self.address} could not prove it knows this job's secret",
                                 hint=SECRET_HINT) from e
        except (EOFError, OSError) as e:
            raise StoreAuthError(f"the store at {self.address} rejected this rank's handshake",
                                 hint=SECRET_HINT) from e
        self._key = session_key(self._secret, ns, nc)
        self._send_seq = self._recv_seq = 0

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

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
        for body in bodies:
            if len(body) > self.max_frame:
                raise BootstrapError(f"request for key {key!r} is {len(body)} bytes, over the store's "
                                     f"frame cap of {self.max_frame}", hint="the store is for small metadata")
        end = None if limit is None else time.monotonic() + limit
        if not self._lock.acquire(timeout=-1 if limit is None else limit):
            raise ClientBusy(f"store client for {self.address} busy in another thread for {limit:g} s (key {key!r})")
        try:
            sock = self._sock
            if sock is None:
                raise BootstrapError(f"store client for {self.address} is closed (key {key!r})")
            frames = []
            for body in bodies:
                frames.append(encode_frame(self._key, _DIR_TO_SERVER, self._send_seq, body))
                self._send_seq += 1
            # The server answers a blocked GET at its own deadline; the slack covers the round trip.
            reply_wait = wait + 5.0 if end is None else max(0.05, end - time.monotonic())
            sock.settimeout(reply_wait)
            try:
                sock.sendall(b"".join(frames))
                replies = [self._read_reply(sock) for _ in bodies]
            except (EOFError, ConnectionError) as e:
                self._sock = None
                sock.close()
                raise BootstrapError(
                    f"the rendezvous store at {self.address} closed the connection while this rank "
                    f"was waiting for key {key!r} ({type(e).__name__})",
                    hint="rank 0 runs the store: check whether rank 0 exited or crashed (its log and exit "
                         "code), or was killed by the scheduler") from e
            except (TimeoutError, socket.timeout) as e:
                self._sock = None
                sock.close()
                raise BootstrapError(
                    f"no answer from the rendezvous store at {self.address} for key {key!r} "
                    f"within {reply_wait:.1f}s", hint="rank 0 may be hung or the network path dropped") from e
            except OSError as e:
                self._sock = None
                sock.close()
                raise BootstrapError(f"talking to the rendezvous store at {self.address} failed for "
                                     f"key {key!r}: {e}", hint="check rank 0 and the network path") from e
        finally:
            self._lock.release()
        for status, payload in replies:   # every reply is read first: the stream stays in step
            if status == ST_TOOBIG:
                raise _ReplyTooBig(payload.decode("utf-8", "replace"))
            if status == ST_ERROR:
                raise BootstrapError(f"store at {self.address} refused the request on key {key!r}: "
                                     f"{payload.decode('utf-8', 'replace')}")
        return replies

    def _read_reply(self, sock: socket.socket) -> tuple[int, bytes]:
        head = recv_exact(sock, HEADER.size + MAC_LEN)
        (length,) = HEADER.unpack_from(head, 0)
        if length > self.max_frame or length < 1:
            raise ConnectionAbortedError(f"reply frame length {length} out of range")
        body = recv_exact(sock, length)
        if not hmac.compare_digest(head[HEADER.size:], frame_mac(self._key, _DIR_TO_CLIENT, self._recv_seq, body)):
            raise ConnectionAbortedError("reply frame has a bad MAC")
        self._recv_seq += 1
        return body[0], body[1:]

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
        items = self._items(items)
        self._pipeline([(OP_MSET, "", args) for args in self._item_batches(items)], self.timeout,
                       self._label([k for k, _ in items]))

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
        for chunk in self._key_batches(keys):
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
        items, keys = self._items(publish), list(keys)
        wait = self.timeout if timeout is None else self._wait_arg(timeout, "store exchange timeout")
        deadline = time.monotonic() + wait
        pre = [(OP_MSET, "", args) for args in self._item_batches(items)] if items else []
        return self._mget(keys, wait, deadline, True, pre)

    def _wait_arg(self, timeout, what: str) -> float:
        negative = isinstance(timeout, (int, float)) and timeout < 0   # a deadline already passed
        return _seconds(what, 0.0 if negative else timeout)

    @staticmethod
    def _items(items) -> list[tuple[str, bytes]]:
        items = list(items.items() if isinstance(items, Mapping) else items)
        for key, value in items:
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError(f"store values are bytes, not {type(value).__name__} (key {key!r})")
        return [(k, bytes(v)) for k, v in items]

    @staticmethod
    def _label(keys: list[str]) -> str:
        return keys[0] if len(keys) == 1 else f"{keys[0]} (and {len(keys) - 1} more)" if keys else "(none)"

    def _budget(self) -> int:
        return self.max_frame - 64   # room for the request header and the MGET's fixed fields

    def _key_batches(self, keys: list[str]) -> list[list[str]]:
        """``keys`` split so that each request fits the frame cap (almost always one batch)."""
        out, cur, size = [], [], COUNT.size
        for k in keys:
            n = KEYLEN.size + len(k.encode("utf-8"))
            if cur and size + n > self._budget():
                out.append(cur)
                cur, size = [], COUNT.size
            cur.append(k)
            size += n
        return out + [cur] if cur or not out else out

    def _item_batches(self, items: list[tuple[str, bytes]]) -> list[bytes]:
        out, cur, size = [], [], COUNT.size
        for k, v in items:
            n = KEYLEN.size + len(k.encode("utf-8")) + COUNT.size + len(v)
            if cur and size + n > self._budget():
                out.append(encode_items(cur))
                cur, size = [], COUNT.size
            cur.append((k, v))
            size += n
        return out + [encode_items(cur)] if cur or not out else out

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
        batches = [keys] if rng else self._key_batches(keys) if keys else []
        for i, chunk in enumerate(batches):
            left = time_left(deadline)
            if rng:
                args = bytes([flag | MGET_RANGE]) + encode_key_range(rng[0], rng[1], len(keys))
            else:
                args = bytes([flag]) + encode_keys(chunk)
            reqs = (pre if i == 0 else []) + [(OP_MGET, "", F64.pack(left) + args)]
            try:
                status, payload = self._pipeline(reqs, left, self._label(chunk))[-1]
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
            arrived = self.check(count_key) if self._sock is not None else None
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
