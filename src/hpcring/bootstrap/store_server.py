"""The rendezvous store's server: one selector thread in rank 0 (see store_wire for the protocol)."""
from __future__ import annotations

import atexit
import heapq
import hmac
import itertools
import logging
import selectors
import socket
import struct
import threading
import time

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_wire import (ACCEPT_BACKOFF, DEFAULT_MAX_FRAME, F64, FD_RESERVE, FRAME_TIMEOUT,
                                          HANDSHAKE_TIMEOUT, HEADER, I64, KEYLEN, MAC_LEN,
                                          MAX_GET_TIMEOUT, OP_ADD, OP_CHECK, OP_DELETE, OP_GET,
                                          OP_PING, OP_SET, ST_ERROR, ST_MISSING, ST_OK, ST_TIMEOUT,
                                          _DIR_TO_CLIENT, _DIR_TO_SERVER, encode_frame, frame_mac,
                                          session_key)
from hpcring.errors import BootstrapError

log = logging.getLogger("hpcring.bootstrap.store")


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


class _Conn:
    __slots__ = ("sock", "peer", "ready", "inbuf", "outbuf", "ns", "key", "recv_seq", "send_seq",
                 "hello_deadline", "pending", "closed", "want_write", "frame_deadline", "hello")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.ready = False
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.ns, self.hello = auth.STORE.hello()
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
            self._send_raw(conn, conn.hello)

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
        need = auth.STORE.proof_len
        if len(conn.inbuf) < need:
            return False
        frame = bytes(conn.inbuf[:need])
        del conn.inbuf[:need]
        try:
            nc, _ = auth.STORE.check(self._secret, conn.ns, frame)
        except auth.BadProof:
            self._drop(conn, "handshake MAC does not match this job's secret (unauthenticated peer)",
                       counter="rejected_handshake")
            return False
        conn.key = session_key(self._secret, conn.ns, nc)
        conn.ready = True
        self.stats["authenticated"] += 1
        self._send_raw(conn, auth.STORE.server_proof(self._secret, conn.ns, nc))
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
