"""The rendezvous store's server: one selector thread in rank 0 (see store_wire for the protocol).

Scale (issue 21): one thread and one epoll loop serve every connection (no thread per client);
a blocking GET/MGET on keys not yet set is parked in a *wait group* (all requests for the same
key list share one, so 8192 ranks reading the same N keys cost O(N) bookkeeping, not O(N^2)),
and answered when the last key arrives or at its deadline by the timer heap. The process's soft
RLIMIT_NOFILE is raised to what the job needs (:func:`ensure_fd_limit`).
"""
from __future__ import annotations

import atexit
import collections
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
                                          MAX_GET_TIMEOUT, MGET_RANGE, MGET_VALUES, OP_ADD, OP_CHECK, OP_DELETE,
                                          OP_GET, OP_MCHECK, OP_MGET, OP_MSET, OP_PING, OP_SET,
                                          ST_ERROR, ST_MISSING, ST_OK, ST_TIMEOUT, ST_TOOBIG, _DIR_TO_CLIENT,
                                          _DIR_TO_SERVER, decode_items, decode_key_range, decode_keys, encode_indices,
                                          encode_frame, encode_values, frame_mac, session_key)
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


CONNECTIONS_PER_RANK = 3   # init's client, the watchdog's listener and its action client


def fd_need(clients: int) -> int:
    """Descriptors a store serving ``clients`` connections needs in its process (one per
    connection, plus the reserve for the rest of rank 0)."""
    return clients + FD_RESERVE + 16


def ensure_fd_limit(clients: int, *, ranks: int | None = None, required: int | None = None) -> int:
    """Raise this process's soft RLIMIT_NOFILE so that ``clients`` store connections fit; returns
    the soft limit now in force. The soft limit is only raised (never lowered), and only as far
    as needed, capped by the hard limit. When even ``required`` connections (default: all of
    them; the job's rendezvous needs one per rank) cannot fit, raises BootstrapError naming the
    limit, the job size and what to do; when only the later ones (watchdog) cannot, warns so.
    """
    need, need_min = fd_need(clients), fd_need(clients if required is None else required)
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1024
    inf = resource.RLIM_INFINITY
    if soft == inf or soft >= need:
        return soft if soft != inf else 1 << 20
    target = need if hard == inf else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.info("store: raised the soft descriptor limit (RLIMIT_NOFILE) from %d to %d for %d "
                     "connections", soft, target, clients)
            soft = target
        except (OSError, ValueError) as e:
            log.warning("store: could not raise RLIMIT_NOFILE from %d to %d: %s", soft, target, e)
    if soft >= need:
        return soft
    who = (f"a job of {ranks} ranks ({CONNECTIONS_PER_RANK} store connections each with the watchdog, "
           f"{clients} in all)") if ranks is not None else f"{clients} store connections"
    msg = (f"rank 0's descriptor limit is too low for the rendezvous store: RLIMIT_NOFILE is "
           f"{soft} (soft) / {'unlimited' if hard == inf else hard} (hard); {who} needs about {need}")
    hint = (f"raise the limit before starting the ranks: `ulimit -n {need}` in the job script (up "
            f"to the hard limit, `ulimit -Hn`), or ask the site to raise the hard limit "
            f"(/etc/security/limits.conf nofile, or the limits the scheduler propagates, e.g. "
            f"Slurm's PropagateResourceLimits)")
    if soft < need_min:
        raise BootstrapError(msg, hint=hint)
    log.warning("store: %s; the rendezvous fits (%d needed), connections beyond the limit will wait "
                "and may time out. Hint: %s", msg, need_min, hint)
    return soft


class _TooBig(ValueError):
    """A batched read's reply would pass the frame cap (answered ST_TOOBIG: ask for fewer keys)."""


class _Group:
    """Parked requests for one key list (a GET's key, or an MGET's flags and key list): they
    share the bookkeeping of which keys are still missing and the reply built once they exist."""

    __slots__ = ("gid", "keys", "missing", "members", "single", "values", "timeout_reply")

    def __init__(self, gid: bytes, keys: list[str], missing: set[str], single: bool, values: bool) -> None:
        self.gid, self.keys, self.missing = gid, keys, missing
        self.members: dict[_Conn, None] = {}
        self.single, self.values = single, values
        self.timeout_reply: tuple[int, bytes] | None = None   # (data version, payload) cache


class _Conn:
    __slots__ = ("sock", "peer", "ready", "inbuf", "outbuf", "ns", "key", "recv_seq", "send_seq",
                 "hello_deadline", "pending", "wait_deadline", "closed", "want_write", "frame_deadline",
                 "hello")

    def __init__(self, sock: socket.socket, peer: str, handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self.sock = sock
        self.peer = peer
        self.ready = False
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.ns, self.hello = auth.STORE.hello()
        self.key = b""
        self.recv_seq = 0
        self.send_seq = 0
        self.hello_deadline = time.monotonic() + handshake_timeout
        self.pending: _Group | None = None   # the wait group of a parked GET/MGET
        self.wait_deadline = 0.0
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

    ``clients``: connections the job will open (ranks x :data:`CONNECTIONS_PER_RANK`); the soft
    descriptor limit is raised for them (:func:`ensure_fd_limit`: an error when not even one per
    rank of ``ranks`` fits, a warning when only some of the rest do) and the listen backlog is
    sized for them.

    Flood resistance: at most ``max_connections`` open connections (default: what the descriptor
    limit allows, less a reserve); when full, or when accept() fails with EMFILE/ENFILE/ENOBUFS,
    the oldest connection still in its handshake is dropped to make room and accepting pauses with
    exponential back-off (no busy loop). A started frame must be complete within
    ``frame_timeout`` seconds (slowloris). Numeric request fields are checked (a GET timeout must
    be finite and >= 0). Log lines about dropped peers are rate-limited.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, secret: bytes,
                 max_frame: int = DEFAULT_MAX_FRAME, backlog: int = 1024,
                 max_connections: int | None = None, frame_timeout: float = FRAME_TIMEOUT,
                 clients: int | None = None, ranks: int | None = None,
                 handshake_timeout: float | None = None) -> None:
        if not secret:
            raise BootstrapError("StoreServer needs a non-empty per-job secret")
        if clients:
            ensure_fd_limit(clients, ranks=ranks, required=ranks)
            backlog = max(backlog, min(clients, 65535))   # the kernel caps it at somaxconn
        self._secret = bytes(secret)
        self.max_frame = max_frame
        self.max_connections = max(8, max_connections or _fd_limit() - FD_RESERVE)
        self.frame_timeout = frame_timeout
        if handshake_timeout is None:          # HPCRING_HANDSHAKE_TIMEOUT, else store_wire's 10 s
            from hpcring.config import envvars
            handshake_timeout = envvars.get("HPCRING_HANDSHAKE_TIMEOUT", default=HANDSHAKE_TIMEOUT)
        self.handshake_timeout = float(handshake_timeout)
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
        self._version = 0                               # bumped by every change of _data
        self._groups: dict[bytes, _Group] = {}          # parked requests by key list
        self._waiters: dict[str, dict[_Group, None]] = {}   # missing key -> groups waiting for it
        self._reply_cache: dict[bytes, tuple[int, bytes]] = {}   # MGET key list -> (version, payload)
        self._runnable: collections.deque[_Conn] = collections.deque()   # answered, frames may be queued
        self._timers: list[tuple[float, int, _Conn]] = []   # (deadline, tie, conn) for hellos and GETs
        self._tie = itertools.count()
        self.stats = {"connections": 0, "authenticated": 0, "rejected_handshake": 0,
                      "rejected_frame": 0, "frames": 0, "evicted": 0, "accept_errors": 0,
                      "slow_frame": 0, "bad_request": 0, "peak_connections": 0, "parked": 0}
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
                    self._run_queued()
                now = time.monotonic()
                self._expire(now)
                self._run_queued()
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

    def _run_queued(self) -> None:
        """Serve the frames queued behind requests that were just answered (iteratively: a woken
        client's next SET may wake others; recursion could run arbitrarily deep)."""
        while self._runnable:
            conn = self._runnable.popleft()
            if not conn.closed and conn.pending is None:
                self._process(conn)

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
                self._drop(conn, "no handshake within %gs" % self.handshake_timeout, counter="rejected_handshake")
            elif conn.frame_deadline == deadline:
                self._drop(conn, f"a frame was not completed within {self.frame_timeout:g}s "
                                 f"({len(conn.inbuf)} bytes of it received; slow or stalled peer)",
                           counter="slow_frame")
            elif conn.pending is not None and conn.wait_deadline == deadline:
                group = conn.pending
                self._leave(conn)
                if group.single:
                    self._reply(conn, ST_TIMEOUT)
                else:
                    self._reply(conn, ST_TIMEOUT, self._missing_reply(group))
                self._runnable.append(conn)   # the client may have queued nothing else, but be uniform

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
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", self.handshake_timeout)
            self.stats["connections"] += 1
            self._conns[conn] = None
            if len(self._conns) > self.stats["peak_connections"]:
                self.stats["peak_connections"] = len(self._conns)
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
            self._leave(conn)
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
        except _TooBig as e:   # a batched read of more than one frame: the client splits it
            self._reply(conn, ST_TOOBIG, str(e).encode())
        except (struct.error, ValueError, OverflowError) as e:
            self.stats["bad_request"] += 1
            self._reply(conn, ST_ERROR, f"bad arguments for op {op} on key {key!r}: {e}".encode())
        except Exception as e:   # a bug must cost this peer its connection, not every rank the store
            log.exception("store %s: op %d from %s failed", self.address, op, conn.peer)
            self._drop(conn, f"internal error on op {op}: {type(e).__name__}")

    def _store(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._version += 1

    def _op_set(self, conn: _Conn, key: str, value: bytes) -> None:
        self._store(key, value)
        # Waiters first: once the setter has its answer it may exit, and on rank 0 that ends the
        # server thread too; the waiters' replies must already be in their socket buffers by then.
        self._wake(key)
        self._reply(conn, ST_OK)

    def _op_mset(self, conn: _Conn, key: str, args: bytes) -> None:
        items = decode_items(args)
        for k, v in items:
            self._store(k, v)
        for k, _ in items:
            self._wake(k)   # before replying, as in _op_set
        self._reply(conn, ST_OK)

    @staticmethod
    def _timeout_arg(args: bytes, what: str) -> float:
        (timeout,) = F64.unpack_from(args, 0)
        if not (0.0 <= timeout <= MAX_GET_TIMEOUT):   # also false for NaN
            raise ValueError(f"{what} timeout {timeout!r} must be finite, >= 0 and <= {MAX_GET_TIMEOUT:g}s")
        return timeout

    def _op_get(self, conn: _Conn, key: str, args: bytes) -> None:
        if len(args) != F64.size:
            raise ValueError(f"GET takes an 8-byte timeout, not {len(args)} bytes")
        timeout = self._timeout_arg(args, "GET")
        if key in self._data:
            self._reply(conn, ST_OK, self._data[key])
            return
        if timeout <= 0:
            self._reply(conn, ST_TIMEOUT)
            return
        gid = b"G" + key.encode("utf-8")
        group = self._groups.get(gid) or self._new_group(gid, [key], {key}, single=True, values=True)
        self._park(conn, group, timeout)

    def _op_mget(self, conn: _Conn, key: str, args: bytes) -> None:
        if len(args) < F64.size + 1:
            raise ValueError("MGET takes a timeout, flags and a key list")
        timeout = self._timeout_arg(args, "MGET")
        gid = b"M" + args[F64.size:]   # flags + key list: requests for the same keys share a group
        group = self._groups.get(gid)
        if group is None:
            cached = self._reply_cache.get(gid)
            if cached is not None and cached[0] == self._version:
                self._reply(conn, ST_OK, cached[1])
                return
            keys = (decode_key_range if args[F64.size] & MGET_RANGE else decode_keys)(args, F64.size + 1)
            data = self._data
            missing = [i for i, k in enumerate(keys) if k not in data]
            if not missing:
                self._reply(conn, ST_OK, self._values_reply(gid, keys, bool(args[F64.size] & MGET_VALUES)))
            elif timeout <= 0:
                self._reply(conn, ST_TIMEOUT, encode_indices(missing))
            else:
                group = self._new_group(gid, keys, {keys[i] for i in missing}, single=False,
                                        values=bool(args[F64.size] & MGET_VALUES))
                self._park(conn, group, timeout)
        elif timeout <= 0:
            self._reply(conn, ST_TIMEOUT, self._missing_reply(group))
        else:
            self._park(conn, group, timeout)

    def _op_mcheck(self, conn: _Conn, key: str, args: bytes) -> None:
        data = self._data
        self._reply(conn, ST_OK, self._check_size(encode_values([data.get(k) for k in decode_keys(args)])))

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
        self._store(key, str(value).encode("ascii"))
        self._wake(key)   # before replying, as in _op_set
        self._reply(conn, ST_OK, I64.pack(value))

    def _op_check(self, conn: _Conn, key: str, args: bytes) -> None:
        if key in self._data:
            self._reply(conn, ST_OK, self._data[key])
        else:
            self._reply(conn, ST_MISSING)

    def _op_delete(self, conn: _Conn, key: str, args: bytes) -> None:
        existed = self._data.pop(key, None) is not None
        self._version += 1
        self._reply(conn, ST_OK if existed else ST_MISSING)

    def _op_ping(self, conn: _Conn, key: str, args: bytes) -> None:
        self._reply(conn, ST_OK, args)

    _HANDLERS = {OP_SET: _op_set, OP_GET: _op_get, OP_ADD: _op_add, OP_CHECK: _op_check,
                 OP_DELETE: _op_delete, OP_PING: _op_ping, OP_MSET: _op_mset, OP_MGET: _op_mget,
                 OP_MCHECK: _op_mcheck}

    # -- parked requests --------------------------------------------------------------------
    def _check_size(self, payload: bytes) -> bytes:
        if len(payload) + 1 > self.max_frame:
            raise _TooBig(f"the reply would be {len(payload)} bytes, over the frame cap of "
                             f"{self.max_frame}: read these keys in smaller batches")
        return payload

    def _values_reply(self, gid: bytes, keys: list[str], values: bool) -> bytes:
        """An MGET's OK payload (every key exists), cached until the data changes."""
        if not values:
            return b""
        data = self._data
        payload = self._check_size(encode_values([data[k] for k in keys]))
        cache = self._reply_cache
        if len(cache) >= 64 or sum(len(p) for _, p in cache.values()) + len(payload) > 64 << 20:
            cache.clear()   # a few recent key lists (the job's all-gathers), at most 64 MiB
        cache[gid] = (self._version, payload)
        return payload

    def _missing_reply(self, group: _Group) -> bytes:
        """An MGET's TIMEOUT payload: the indices of the keys still missing (cached per version)."""
        if group.timeout_reply is None or group.timeout_reply[0] != self._version:
            data = self._data
            group.timeout_reply = (self._version,
                                   encode_indices([i for i, k in enumerate(group.keys) if k not in data]))
        return group.timeout_reply[1]

    def _new_group(self, gid: bytes, keys: list[str], missing: set[str], *, single: bool, values: bool) -> _Group:
        group = _Group(gid, keys, missing, single, values)
        self._groups[gid] = group
        for k in missing:
            self._waiters.setdefault(k, {})[group] = None
        return group

    def _park(self, conn: _Conn, group: _Group, timeout: float) -> None:
        conn.pending = group
        conn.wait_deadline = time.monotonic() + timeout
        group.members[conn] = None
        self.stats["parked"] += 1
        heapq.heappush(self._timers, (conn.wait_deadline, next(self._tie), conn))

    def _leave(self, conn: _Conn) -> None:
        """Take ``conn`` out of its wait group (deadline reached, or dropped)."""
        group, conn.pending = conn.pending, None
        group.members.pop(conn, None)
        if not group.members:
            self._forget(group)

    def _forget(self, group: _Group) -> None:
        """A group nobody waits for any more: unhook it from its missing keys."""
        if self._groups.get(group.gid) is group:
            del self._groups[group.gid]
        for k in group.missing:
            waiting = self._waiters.get(k)
            if waiting is not None:
                waiting.pop(group, None)
                if not waiting:
                    del self._waiters[k]

    def _wake(self, key: str) -> None:
        groups = self._waiters.pop(key, None)
        if not groups:
            return
        for group in groups:
            group.missing.discard(key)
            if not group.missing:
                self._complete(group)

    def _complete(self, group: _Group) -> None:
        """Every key of ``group`` arrived: answer all its members with one payload."""
        data = self._data
        again = {k for k in group.keys if k not in data}   # deleted after it arrived
        if again:
            group.missing = again
            for k in again:
                self._waiters.setdefault(k, {})[group] = None
            return
        if self._groups.get(group.gid) is group:
            del self._groups[group.gid]
        try:
            if group.single:
                status, payload = ST_OK, data[group.keys[0]]
            else:
                status, payload = ST_OK, self._values_reply(group.gid, group.keys, group.values)
        except _TooBig as e:
            status, payload = ST_TOOBIG, str(e).encode()
        members, group.members = group.members, {}
        for conn in members:
            if conn.closed or conn.pending is not group:
                continue
            conn.pending = None
            self._reply(conn, status, payload)
            self._runnable.append(conn)

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


# ------------------------------------------------------------------------------------- own process

class StoreServerProcess:
    """A :class:`StoreServer` in a child process of its own, so that rank 0's threads (the
    training loop holding the GIL) do not slow the store that every rank waits on: with one busy
    Python thread beside it, an in-process store took 4x as long to serve 4096 ranks
    (docs/scale.md). The same surface as StoreServer for its users (``port``, ``host``,
    ``address``, ``close()``, a context manager); ``stats`` and ``keys()`` stay with the child.

    Contract: raises ``OSError`` when the port is taken (as StoreServer does, so callers try the
    next) and BootstrapError when the descriptor limit is too low or the child does not start;
    the child serves until this object is closed or this process ends (its stdin reaches EOF, or
    it sees itself re-parented), so the store lives exactly as long as rank 0, as before. The
    secret travels over the child's stdin, never on a command line.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, secret: bytes, clients: int | None = None,
                 ranks: int | None = None, start_timeout: float = 30.0) -> None:
        import json
        import os
        import subprocess
        import sys
        from pathlib import Path

        if not secret:
            raise BootstrapError("StoreServer needs a non-empty per-job secret")
        root = str(Path(__file__).resolve().parents[2])   # the hpcring this process runs
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self._proc = subprocess.Popen([sys.executable, "-m", "hpcring.bootstrap.store_server"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        request = {"host": host, "port": port, "secret": bytes(secret).hex(), "clients": clients, "ranks": ranks}
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            answer = self._read_answer(start_timeout)
        except BaseException:
            self._stop(0.0)
            raise
        if "port" not in answer:
            self._stop(2.0)
            if "errno" in answer:
                raise OSError(answer["errno"], answer["strerror"])
            raise BootstrapError(answer.get("error", f"the store process said {answer!r}"), hint=answer.get("hint"))
        self.host, self.port = host, int(answer["port"])
        self.stats: dict[str, int] = {}
        self._closed = False
        atexit.register(self.close)

    def _read_answer(self, timeout: float) -> dict:
        import json
        import select

        out = self._proc.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else b""
        if not line:
            raise BootstrapError(f"rank 0's store process did not start within {timeout:.0f}s "
                                 f"(exit code {self._proc.poll()})",
                                 hint="its stderr (in rank 0's log) says why; the store can also run in "
                                      "rank 0's own process: StoreServer")
        return json.loads(line)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (it closes every connection) and wait at most ``timeout`` for it."""
        atexit.unregister(self.close)
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        import subprocess
        try:
            self._proc.stdin.close()   # EOF: the child closes its server and exits
        except OSError:
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()

    def __enter__(self) -> "StoreServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve_child() -> None:
    """``python -m hpcring.bootstrap.store_server``: the child of :class:`StoreServerProcess`."""
    import json
    import os
    import sys

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="hpcring store (rank 0's store process): %(message)s")
    parent = os.getppid()
    request = json.loads(sys.stdin.readline())

    def answer(obj) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    try:
        srv = StoreServer(request["host"], request["port"], secret=bytes.fromhex(request["secret"]),
                          clients=request["clients"], ranks=request["ranks"])
    except OSError as e:
        answer({"errno": e.errno, "strerror": e.strerror})
        return
    except BootstrapError as e:
        answer({"error": e.message, "hint": e.hint})
        return
    answer({"port": srv.port})
    eof = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), eof.set()), daemon=True).start()
    while not eof.wait(1.0) and os.getppid() == parent:
        pass
    srv.close()


if __name__ == "__main__":
    _serve_child()
