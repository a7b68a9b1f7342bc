"""Authenticated TCP rendezvous store: rank 0 serves, every rank is a client.

Wire protocol (version 1, all integers big-endian):

* hello (server -> client): ``b"HRS1" + Ns`` (32 random bytes).
* client proof: ``Nc (32 bytes) + HMAC(secret, "hpcring-store-v1 client" + Ns + Nc)``.
* server proof: ``HMAC(secret, "hpcring-store-v1 server" + Ns + Nc)``; both sides then use the
  session key ``K = HMAC(secret, "hpcring-store-v1 session" + Ns + Nc)``.
* frame: ``u32 body length | 32-byte MAC | body`` with
  ``MAC = HMAC(K, direction byte + u64 sequence number + body)``; the server checks the length cap
  and the MAC before it looks at a single byte of the body.
* request body: ``u8 op | u16 key length | key (UTF-8) | op arguments``;
  reply body: ``u8 status | payload``.

Because every connection has fresh nonces and numbered frames, a frame captured on one
connection is worthless on another (and cannot be replayed or reordered within one). No pickle:
values are opaque bytes, counters are ASCII decimals.
"""
from __future__ import annotations

import atexit
import hashlib
import heapq
import hmac
import itertools
import logging
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact

log = logging.getLogger("hpcring.bootstrap.store")

MAGIC = b"HRS1"
NONCE_LEN = 32
MAC_LEN = 32
HEADER = struct.Struct(">I")
SEQ = struct.Struct(">Q")
KEYLEN = struct.Struct(">H")
F64 = struct.Struct(">d")
I64 = struct.Struct(">q")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024   # store values are addresses and small blobs, not tensors
HANDSHAKE_TIMEOUT = 10.0               # an unauthenticated peer may not hold a slot longer
FRAME_TIMEOUT = 10.0                   # a started frame must be complete within this (slowloris)
MAX_GET_TIMEOUT = 7 * 24 * 3600.0      # a blocked GET's deadline: finite, at most a week
ACCEPT_BACKOFF = (0.05, 1.0)           # pause accepting after EMFILE & co.: first, longest (s)
FD_RESERVE = 32                        # descriptors left for the rest of rank 0 (logs, ring, ...)

OP_SET, OP_GET, OP_ADD, OP_CHECK, OP_DELETE, OP_PING = 1, 2, 3, 4, 5, 6
ST_OK, ST_TIMEOUT, ST_ERROR, ST_MISSING = 0, 1, 2, 3

_LABEL_CLIENT = b"hpcring-store-v1 client"
_LABEL_SERVER = b"hpcring-store-v1 server"
_LABEL_SESSION = b"hpcring-store-v1 session"
_DIR_TO_SERVER = b"C"
_DIR_TO_CLIENT = b"S"

SECRET_HINT = ("every rank must read the same per-job secret (HPCRING_SECRET_FILE or HPCRING_SECRET); "
               "check that all ranks belong to the same job and that nothing else uses this port")


class StoreAuthError(BootstrapError):
    """The peer at the store address did not prove knowledge of this job's secret."""


class StoreTimeoutError(BootstrapError):
    """A blocking store call reached its deadline. ``missing``: the keys still absent then (for
    :meth:`StoreClient.gather`: every missing key, in the order asked; for ``get``: that key)."""

    def __init__(self, message: str, *, hint: str | None = None, missing: Iterable[str] = ()) -> None:
        super().__init__(message, hint=hint)
        self.missing = list(missing)


class _RateLog:
    """At most ``burst`` lines per ``period`` seconds; the rest are counted and summarised once.

    A flood of bad peers must not turn into megabytes of job log (seen: 414,548 lines in 10 s).
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, period: float = 10.0) -> None:
        self._log, self._burst, self._period = logger, burst, period
        self._window, self._count, self._suppressed = 0.0, 0, 0

    def __call__(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._window >= self._period:
            if self._suppressed:
                self._log.warning("store: %d similar messages suppressed in the last %.0fs",
                                  self._suppressed, self._period)
            self._window, self._count, self._suppressed = now, 0, 0
        if self._count < self._burst or not self._log.isEnabledFor(level) or level < logging.INFO:
            self._count += level >= logging.INFO
            self._log.log(level, msg, *args)
        else:
            self._suppressed += 1


def _fd_limit() -> int:
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, OSError, ValueError):
        return 1024


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def frame_mac(session_key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    """MAC of one frame; exposed so tests can forge frames byte by byte."""
    return _mac(session_key, direction, SEQ.pack(seq), body)


def encode_frame(session_key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    return HEADER.pack(len(body)) + frame_mac(session_key, direction, seq, body) + body


def encode_request(op: int, key: str, args: bytes = b"") -> bytes:
    kb = key.encode("utf-8")
    if len(kb) > 0xFFFF:
        raise BootstrapError(f"store key too long ({len(kb)} bytes): {key[:60]!r}...")
    return bytes([op]) + KEYLEN.pack(len(kb)) + kb + args


def session_key(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return _mac(secret, _LABEL_SESSION, ns, nc)


def client_proof(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return _mac(secret, _LABEL_CLIENT, ns, nc)


def server_proof(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return _mac(secret, _LABEL_SERVER, ns, nc)


# --------------------------------------------------------------------------------------- secret

def load_secret(environ: Mapping[str, str] | None = None) -> bytes:
    """The per-job secret from HPCRING_SECRET_FILE (preferred) or HPCRING_SECRET.

    The secret is the stripped text (a hex string) as bytes, so both sources give the same key.
    A secret file that group or others may read is refused: anyone who can read it can join the
    job's rendezvous.
    """
    env = os.environ if environ is None else environ
    path = env.get("HPCRING_SECRET_FILE")
    if path:
        return _read_secret_file(Path(path))
    text = env.get("HPCRING_SECRET", "").strip()
    if text:
        return text.encode("ascii", "strict")
    raise BootstrapError(
        "no per-job secret: neither HPCRING_SECRET_FILE nor HPCRING_SECRET is set",
        hint="jobs submitted by hpcring get HPCRING_SECRET_FILE=<job folder>/.secret; "
             "when launching by hand, create one with hpcring.bootstrap.store.new_secret_file(folder)")


def _read_secret_file(path: Path) -> bytes:
    try:
        st = path.stat()
    except OSError as e:
        raise BootstrapError(f"cannot read secret file {path} (HPCRING_SECRET_FILE): {e.strerror}",
                             hint="the job folder must be on a file system every node can read") from e
    if st.st_mode & 0o077:
        raise BootstrapError(
            f"secret file {path} is readable by group or others (mode {stat.filemode(st.st_mode)}); "
            "refusing to use it",
            hint=f"chmod 600 {path}  (anyone who can read it can join this job's rendezvous)")
    text = path.read_text(encoding="ascii").strip()
    if not text:
        raise BootstrapError(f"secret file {path} is empty", hint="recreate it with new_secret_file()")
    return text.encode("ascii")


def new_secret_file(folder: str | os.PathLike) -> Path:
    """Write a fresh 32-byte hex secret to ``<folder>/.secret`` with mode 0600 and return its path."""
    path = Path(folder) / ".secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)   # the umask or a pre-existing file may have left wider bits
        os.write(fd, (secrets.token_hex(32) + "\n").encode("ascii"))
    finally:
        os.close(fd)
    return path


# --------------------------------------------------------------------------------------- server

class _Conn:
    __slots__ = ("sock", "peer", "ready", "inbuf", "outbuf", "ns", "key", "recv_seq", "send_seq",
                 "hello_deadline", "pending", "closed", "want_write", "frame_deadline")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.ready = False
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.ns = secrets.token_bytes(NONCE_LEN)
        self.key = b""
        self.recv_seq = 0
        self.send_seq = 0
        self.hello_deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self.pending: tuple[str, float] | None = None   # (key, deadline) of a blocked GET
        self.closed = False
        self.want_write = False
        self.frame_deadline: float | None = None   # set while a frame is partly received


class StoreServer:
    """Key-value store served from a background thread (one selector loop, non-blocking sockets).

    Contract: binds at construction (raises ``OSError`` if ``port`` is taken so the caller can try
    another), serves until :meth:`close`. Every peer must pass the challenge-response handshake
    before any of its bytes are interpreted; a bad handshake or a frame with a bad MAC or an
    oversized length closes the connection with a log line naming the peer, before parsing.
    ``stats`` counts what happened (for tests and diagnostics).

    Flood resistance: at most ``max_connections`` open connections (default: what the descriptor
    limit allows, less a reserve); when full, or when accept() fails with EMFILE/ENFILE/ENOBUFS,
    the oldest connection still in its handshake is dropped to make room and accepting pauses with
    exponential back-off (no busy loop). A started frame must be complete within
    ``frame_timeout`` seconds (slowloris). Numeric request fields are checked (a GET timeout must
    be finite and >= 0). Log lines about dropped peers are rate-limited.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, secret: bytes,
                 max_frame: int = DEFAULT_MAX_FRAME, backlog: int = 1024,
                 max_connections: int | None = None, frame_timeout: float = FRAME_TIMEOUT) -> None:
        if not secret:
            raise BootstrapError("StoreServer needs a non-empty per-job secret")
        self._secret = bytes(secret)
        self.max_frame = max_frame
        self.max_connections = max(8, max_connections or _fd_limit() - FD_RESERVE)
        self.frame_timeout = frame_timeout
        self._conns: dict[_Conn, None] = {}       # open connections, oldest first
        self._accept_paused_until: float | None = None
        self._accept_backoff = ACCEPT_BACKOFF[0]
        self._rlog = _RateLog(log)
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR only skips TIME_WAIT leftovers; Linux still refuses a port someone listens on.
            self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._lsock.bind((host, port))
            self._lsock.listen(backlog)
        except OSError:
            self._lsock.close()
            raise
        self._lsock.setblocking(False)
        self.host = host
        self.port = self._lsock.getsockname()[1]
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, list[_Conn]] = {}
        self._timers: list[tuple[float, int, _Conn]] = []   # (deadline, tie, conn) for hellos and GETs
        self._tie = itertools.count()
        self.stats = {"connections": 0, "authenticated": 0, "rejected_handshake": 0,
                      "rejected_frame": 0, "frames": 0, "evicted": 0, "accept_errors": 0,
                      "slow_frame": 0, "bad_request": 0}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"hpcring-store:{self.port}", daemon=True)
        self._thread.start()
        # The server is a daemon thread inside rank 0: at interpreter exit it would be frozen
        # mid-batch (e.g. after answering rank 0 but before the other barrier waiters). Stopping it
        # from atexit lets the loop finish the batch it is in and flush its replies first.
        atexit.register(self.close)

    # -- public -----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def keys(self) -> list[str]:
        """Snapshot of the stored keys (diagnostics and tests; not a wire operation)."""
        return list(self._data)

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection; waits at most ``timeout`` for the thread."""
        atexit.unregister(self.close)
        if self._stopping:
            return
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                for sel_key, events in self._sel.select(self._next_timeout()):
                    self._dispatch(sel_key, events)
                now = time.monotonic()
                self._expire(now)
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._resume_accept()
        except Exception:   # a bug here would silently hang every rank; make it loud
            log.exception("store server %s crashed", self.address)
        finally:
            self._shutdown()

    def _dispatch(self, sel_key: selectors.SelectorKey, events: int) -> None:
        if sel_key.data == "accept":
            self._accept()
        elif sel_key.data == "wake":
            try:
                self._wake_r.recv(64)
            except OSError:
                pass
        else:
            conn: _Conn = sel_key.data
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and not conn.closed:
                self._on_readable(conn)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        t = 1.0
        if self._timers:
            t = min(t, self._timers[0][0] - now)
        if self._accept_paused_until is not None:
            t = min(t, self._accept_paused_until - now)
        return max(0.0, t)

    def _expire(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            deadline, _, conn = heapq.heappop(self._timers)
            if conn.closed:
                continue
            if not conn.ready and conn.hello_deadline == deadline:
                self._drop(conn, "no handshake within %.0fs" % HANDSHAKE_TIMEOUT, counter="rejected_handshake")
            elif conn.frame_deadline == deadline:
                self._drop(conn, f"a frame was not completed within {self.frame_timeout:g}s "
                                 f"({len(conn.inbuf)} bytes of it received; slow or stalled peer)",
                           counter="slow_frame")
            elif conn.pending is not None and conn.pending[1] == deadline:
                key = conn.pending[0]
                conn.pending = None
                self._remove_waiter(key, conn)
                self._reply(conn, ST_TIMEOUT)
                self._process(conn)   # the client may have queued nothing else, but be uniform

    def _shutdown(self) -> None:
        for sel_key in list(self._sel.get_map().values()):
            if isinstance(sel_key.data, _Conn):
                sel_key.data.closed = True
            try:
                sel_key.fileobj.close()
            except OSError:
                pass
        self._sel.close()
        self._lsock.close()   # unregistered while accepting is paused, so not closed above
        self._wake_w.close()

    # -- connections ------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):   # drain the backlog in batches so 256 simultaneous connects are quick
            if len(self._conns) >= self.max_connections and not self._evict_unauthenticated():
                self._pause_accept("connection limit %d reached" % self.max_connections)
                return
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE & co.: the connection stays in the kernel's backlog and the listener stays
                # readable, so retrying at once would spin. Free descriptors held by peers still
                # in their handshake and go on; with none to free, pause with back-off.
                self.stats["accept_errors"] += 1
                if self._evict_unauthenticated(count=32):
                    self._rlog(logging.WARNING, "store %s: accept() failed: %s; dropped peers without "
                               "a handshake to make room", self.address, e)
                    continue
                self._pause_accept(f"accept() failed: {e}")
                return
            self._accept_backoff = ACCEPT_BACKOFF[0]
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
            self.stats["connections"] += 1
            self._conns[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)
            heapq.heappush(self._timers, (conn.hello_deadline, next(self._tie), conn))
            self._send_raw(conn, MAGIC + conn.ns)

    def _pause_accept(self, why: str) -> None:
        if self._accept_paused_until is not None:
            return
        self._rlog(logging.WARNING, "store %s: %s; not accepting for %.2fs (%d connections open)",
                   self.address, why, self._accept_backoff, len(self._conns))
        try:
            self._sel.unregister(self._lsock)
        except (KeyError, ValueError):
            pass
        self._accept_paused_until = time.monotonic() + self._accept_backoff
        self._accept_backoff = min(self._accept_backoff * 2, ACCEPT_BACKOFF[1])

    def _resume_accept(self) -> None:
        self._accept_paused_until = None
        self._sel.register(self._lsock, selectors.EVENT_READ, "accept")

    def _evict_unauthenticated(self, count: int = 1) -> bool:
        """Drop the ``count`` oldest connections still in their handshake; False if there is none.

        Legitimate ranks finish their handshake within one round trip, so under a flood of idle
        or garbage connections the oldest unauthenticated one is the attacker's.
        """
        victims = [c for c in itertools.islice((c for c in self._conns if not c.ready), count)]
        for conn in victims:
            self._drop(conn, "evicted to make room (too many connections without a handshake)",
                       counter="evicted")
        return bool(victims)

    def _drop(self, conn: _Conn, why: str, *, counter: str | None = None, level=logging.WARNING) -> None:
        if conn.closed:
            return
        if counter:
            self.stats[counter] += 1
        self._rlog(level, "store %s: dropped peer %s: %s", self.address, conn.peer, why)
        self._conns.pop(conn, None)
        conn.closed = True
        if conn.pending is not None:
            self._remove_waiter(conn.pending[0], conn)
            conn.pending = None
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _on_readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(262144)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"receive failed: {e}", level=logging.INFO)
            return
        if not chunk:
            self._drop(conn, "closed by peer", level=logging.DEBUG)
            return
        conn.inbuf += chunk
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        if not conn.ready and not self._handshake(conn):
            return
        while not conn.closed and conn.pending is None:
            body = self._next_body(conn)
            if body is None:
                break
            self.stats["frames"] += 1
            self._handle(conn, body)
        if conn.closed or not conn.ready:
            return
        if len(conn.inbuf) > 2 * (self.max_frame + HEADER.size + MAC_LEN):
            self._drop(conn, f"{len(conn.inbuf)} bytes queued while a request is pending",
                       counter="rejected_frame")
        elif conn.inbuf and conn.pending is None:
            if conn.frame_deadline is None:   # a frame has started: it gets frame_timeout to finish
                conn.frame_deadline = time.monotonic() + self.frame_timeout
                heapq.heappush(self._timers, (conn.frame_deadline, next(self._tie), conn))
        else:
            conn.frame_deadline = None

    def _handshake(self, conn: _Conn) -> bool:
        need = NONCE_LEN + MAC_LEN
        if len(conn.inbuf) < need:
            return False
        nc, proof = bytes(conn.inbuf[:NONCE_LEN]), bytes(conn.inbuf[NONCE_LEN:need])
        del conn.inbuf[:need]
        if not hmac.compare_digest(proof, client_proof(self._secret, conn.ns, nc)):
            self._drop(conn, "handshake MAC does not match this job's secret (unauthenticated peer)",
                       counter="rejected_handshake")
            return False
        conn.key = session_key(self._secret, conn.ns, nc)
        conn.ready = True
        self.stats["authenticated"] += 1
        self._send_raw(conn, server_proof(self._secret, conn.ns, nc))
        return True

    def _next_body(self, conn: _Conn) -> bytes | None:
        """The next authenticated frame body, or None (incomplete, or the peer was dropped)."""
        buf = conn.inbuf
        if len(buf) < HEADER.size + MAC_LEN:
            return None
        (length,) = HEADER.unpack_from(buf, 0)
        if length > self.max_frame:
            self._drop(conn, f"frame of {length} bytes exceeds the cap of {self.max_frame}",
                       counter="rejected_frame")
            return None
        end = HEADER.size + MAC_LEN + length
        if len(buf) < end:
            return None
        mac = bytes(buf[HEADER.size:HEADER.size + MAC_LEN])
        body = bytes(buf[HEADER.size + MAC_LEN:end])
        if not hmac.compare_digest(mac, frame_mac(conn.key, _DIR_TO_SERVER, conn.recv_seq, body)):
            self._drop(conn, f"frame #{conn.recv_seq} has a bad MAC (forged, replayed or corrupted)",
                       counter="rejected_frame")
            return None
        del buf[:end]
        conn.recv_seq += 1
        conn.frame_deadline = None
        return body

    # -- requests ---------------------------------------------------------------------------
    def _handle(self, conn: _Conn, body: bytes) -> None:
        try:
            op = body[0]
            (klen,) = KEYLEN.unpack_from(body, 1)
            if 3 + klen > len(body):
                raise ValueError("key length runs past the frame")
            key = body[3:3 + klen].decode("utf-8")
            args = body[3 + klen:]
        except (IndexError, struct.error, ValueError) as e:
            self._reply(conn, ST_ERROR, f"malformed request: {e}".encode())
            return
        handler = self._HANDLERS.get(op)
        if handler is None:
            self.stats["bad_request"] += 1
            self._reply(conn, ST_ERROR, f"unknown op {op}".encode())
            return
        try:
            handler(self, conn, key, args)
        except (struct.error, ValueError, OverflowError) as e:
            self.stats["bad_request"] += 1
            self._reply(conn, ST_ERROR, f"bad arguments for op {op} on key {key!r}: {e}".encode())
        except Exception as e:   # a bug must cost this peer its connection, not every rank the store
            log.exception("store %s: op %d from %s failed", self.address, op, conn.peer)
            self._drop(conn, f"internal error on op {op}: {type(e).__name__}")

    def _op_set(self, conn: _Conn, key: str, value: bytes) -> None:
        self._data[key] = value
        # Waiters first: once the setter has its answer it may exit, and on rank 0 that ends the
        # server thread too; the waiters' replies must already be in their socket buffers by then.
        self._wake_waiters(key)
        self._reply(conn, ST_OK)

    def _op_get(self, conn: _Conn, key: str, args: bytes) -> None:
        (timeout,) = F64.unpack(args)
        if not (0.0 <= timeout <= MAX_GET_TIMEOUT):   # also false for NaN
            raise ValueError(f"GET timeout {timeout!r} must be finite, >= 0 and <= {MAX_GET_TIMEOUT:g}s")
        if key in self._data:
            self._reply(conn, ST_OK, self._data[key])
            return
        if timeout <= 0:
            self._reply(conn, ST_TIMEOUT)
            return
        deadline = time.monotonic() + timeout
        conn.pending = (key, deadline)
        self._waiters.setdefault(key, []).append(conn)
        heapq.heappush(self._timers, (deadline, next(self._tie), conn))

    def _op_add(self, conn: _Conn, key: str, args: bytes) -> None:
        (n,) = I64.unpack(args)
        old = self._data.get(key, b"0")
        try:
            value = int(old) + n
        except ValueError:
            self._reply(conn, ST_ERROR, f"key {key!r} does not hold an integer".encode())
            return
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"counter {key!r} would overflow 64 bits")
        self._data[key] = str(value).encode("ascii")
        self._wake_waiters(key)   # before replying, as in _op_set
        self._reply(conn, ST_OK, I64.pack(value))

    def _op_check(self, conn: _Conn, key: str, args: bytes) -> None:
        if key in self._data:
            self._reply(conn, ST_OK, self._data[key])
        else:
            self._reply(conn, ST_MISSING)

    def _op_delete(self, conn: _Conn, key: str, args: bytes) -> None:
        existed = self._data.pop(key, None) is not None
        self._reply(conn, ST_OK if existed else ST_MISSING)

    def _op_ping(self, conn: _Conn, key: str, args: bytes) -> None:
        self._reply(conn, ST_OK, args)

    _HANDLERS = {OP_SET: _op_set, OP_GET: _op_get, OP_ADD: _op_add, OP_CHECK: _op_check,
                 OP_DELETE: _op_delete, OP_PING: _op_ping}

    def _wake_waiters(self, key: str) -> None:
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        value = self._data[key]
        for conn in waiters:
            if conn.closed or conn.pending is None or conn.pending[0] != key:
                continue
            conn.pending = None
            self._reply(conn, ST_OK, value)
            self._process(conn)

    def _remove_waiter(self, key: str, conn: _Conn) -> None:
        lst = self._waiters.get(key)
        if lst and conn in lst:
            lst.remove(conn)
            if not lst:
                del self._waiters[key]

    # -- output -----------------------------------------------------------------------------
    def _reply(self, conn: _Conn, status: int, payload: bytes = b"") -> None:
        body = bytes([status]) + payload
        self._send_raw(conn, encode_frame(conn.key, _DIR_TO_CLIENT, conn.send_seq, body))
        conn.send_seq += 1

    def _send_raw(self, conn: _Conn, data: bytes) -> None:
        if conn.closed:
            return
        conn.outbuf += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if len(conn.outbuf) > 4 * (self.max_frame + HEADER.size + MAC_LEN):
            self._drop(conn, f"{len(conn.outbuf)} reply bytes unread (peer does not read)", counter="rejected_frame")
            return
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self._drop(conn, f"send failed: {e}", level=logging.INFO)
            return
        want = bool(conn.outbuf)
        if want != conn.want_write:
            conn.want_write = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._sel.modify(conn.sock, events, conn)


# --------------------------------------------------------------------------------------- client

def _seconds(what: str, value) -> float:
    """A wait in seconds from a caller: finite and in [0, MAX_GET_TIMEOUT], else UsageError."""
    from hpcring.config.envvars import check_number
    return check_number(what, value, lo=0, hi=MAX_GET_TIMEOUT)


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

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 60.0, *,
                 max_frame: int = DEFAULT_MAX_FRAME, connect_retry: bool = True) -> None:
        if not secret:
            raise BootstrapError("StoreClient needs a non-empty per-job secret")
        self.host, self.port = host, int(port)
        self.timeout = _seconds("StoreClient(timeout=)", timeout)
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
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
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
            hello = recv_exact(sock, len(MAGIC) + NONCE_LEN)
        except (EOFError, ConnectionResetError, TimeoutError, socket.timeout) as e:
            # An hpcring store under a flood drops (or is slow to greet) new connections: retry.
            raise _StoreBusy(f"the store closed the connection before its hello (busy, or not an "
                             f"hpcring store): {e or type(e).__name__}") from e
        except OSError as e:
            raise StoreAuthError(f"peer at {self.address} is not an hpcring store (no hello: {e})",
                                 hint=SECRET_HINT) from e
        if hello[:len(MAGIC)] != MAGIC:
            raise StoreAuthError(f"peer at {self.address} is not an hpcring store (bad hello)",
                                 hint=SECRET_HINT)
        ns = hello[len(MAGIC):]
        nc = secrets.token_bytes(NONCE_LEN)
        sock.sendall(nc + client_proof(self._secret, ns, nc))
        try:
            proof = recv_exact(sock, MAC_LEN)
        except (EOFError, OSError) as e:
            raise StoreAuthError(f"the store at {self.address} rejected this rank's handshake",
                                 hint=SECRET_HINT) from e
        if not hmac.compare_digest(proof, server_proof(self._secret, ns, nc)):
            raise StoreAuthError(f"the server at {self.address} could not prove it knows this job's secret",
                                 hint=SECRET_HINT)
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
    def _call(self, op: int, key: str, args: bytes, wait: float) -> tuple[int, bytes]:
        body = encode_request(op, key, args)
        if len(body) > self.max_frame:
            raise BootstrapError(f"value for key {key!r} is {len(body)} bytes, over the store's "
                                 f"frame cap of {self.max_frame}", hint="the store is for small metadata")
        with self._lock:
            sock = self._sock
            if sock is None:
                raise BootstrapError(f"store client for {self.address} is closed (key {key!r})")
            frame = encode_frame(self._key, _DIR_TO_SERVER, self._send_seq, body)
            self._send_seq += 1
            # The server answers a blocked GET at its own deadline; the slack covers the round trip.
            sock.settimeout(wait + 5.0)
            try:
                sock.sendall(frame)
                return self._read_reply(sock, key)
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
                    f"within {wait + 5.0:.1f}s", hint="rank 0 may be hung or the network path dropped") from e
            except OSError as e:
                self._sock = None
                sock.close()
                raise BootstrapError(f"talking to the rendezvous store at {self.address} failed for "
                                     f"key {key!r}: {e}", hint="check rank 0 and the network path") from e

    def _read_reply(self, sock: socket.socket, key: str) -> tuple[int, bytes]:
        head = recv_exact(sock, HEADER.size + MAC_LEN)
        (length,) = HEADER.unpack_from(head, 0)
        if length > self.max_frame or length < 1:
            raise ConnectionAbortedError(f"reply frame length {length} out of range")
        body = recv_exact(sock, length)
        if not hmac.compare_digest(head[HEADER.size:], frame_mac(self._key, _DIR_TO_CLIENT, self._recv_seq, body)):
            raise ConnectionAbortedError("reply frame has a bad MAC")
        self._recv_seq += 1
        status = body[0]
        if status == ST_ERROR:
            raise BootstrapError(f"store at {self.address} refused the request on key {key!r}: "
                                 f"{body[1:].decode('utf-8', 'replace')}")
        return status, body[1:]

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

        On timeout raises :class:`StoreTimeoutError` whose ``missing`` lists every key still absent
        (not only the first), so callers can name all the ranks that did not arrive.
        """
        keys = list(keys)
        deadline = time.monotonic() + (self.timeout if timeout is None else _seconds("store wait timeout", timeout))
        values: list[bytes] = []
        for i, key in enumerate(keys):
            try:
                values.append(self.get(key, timeout=max(0.0, deadline - time.monotonic())))
            except StoreTimeoutError as e:
                missing = [key] + [k for k in keys[i + 1:] if self.check(k) is None]
                raise StoreTimeoutError(f"{e.message}; {len(missing)} of {len(keys)} keys still missing",
                                        hint=e.hint, missing=missing) from None
        return values

    def check(self, key: str) -> bytes | None:
        """The value of ``key`` if present, else None (never blocks on the key)."""
        status, payload = self._call(OP_CHECK, key, b"", self.timeout)
        return payload if status == ST_OK else None

    def delete(self, key: str) -> bool:
        status, _ = self._call(OP_DELETE, key, b"", self.timeout)
        return status == ST_OK

    def add(self, key: str, n: int) -> int:
        """Atomically add ``n`` to the integer at ``key`` (missing = 0) and return the new value."""
        _, payload = self._call(OP_ADD, key, I64.pack(int(n)), self.timeout)
        return I64.unpack(payload)[0]

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key exists; one deadline covers them all."""
        deadline = time.monotonic() + (self.timeout if timeout is None else _seconds("store wait timeout", timeout))
        for key in keys:
            self.get(key, timeout=max(0.0, deadline - time.monotonic()))

    def barrier(self, name: str, size: int, timeout: float | None = None) -> None:
        """Return once ``size`` participants have entered barrier ``name`` (one use per name)."""
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
            self.get(done_key, timeout=max(0.0, deadline - time.monotonic()))
        except BootstrapError as e:
            arrived = self.check(count_key) if self._sock is not None else None
            got = arrived.decode() if arrived else "?"
            if "timed out" not in e.message:   # the store went away: that error says it better
                raise
            raise BootstrapError(f"barrier {name!r} timed out after {wait:.1f}s at store {self.address}: "
                                 f"{got} of {size} ranks arrived (waiting for key {done_key!r})",
                                 hint="the missing ranks never reached this barrier: check that every "
                                      "rank started and look at the logs of the slowest ones") from e

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time in seconds."""
        t0 = time.monotonic()
        self._call(OP_PING, "", b"", timeout)
        return time.monotonic() - t0


