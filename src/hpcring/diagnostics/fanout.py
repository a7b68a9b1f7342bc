"""The watchdog's trigger fan-out: a k-nomial tree (radix :data:`RADIX`) over the ranks, rooted at
the rank that saw the failure first, so a trigger reaches n ranks in about log8 n hops (4 at 4096
ranks, 6 at 64k) without any rank keeping a connection open for the whole job.

Tree (indices relative to the root: ``v = (rank - root) % n``, written in base k = RADIX): the
children of ``v`` are ``v + j * k**i`` for j = 1..k-1 and every ``k**i`` below ``span(v)``, the
place of ``v``'s lowest non-zero digit (all powers below n for the root), largest first; the
subtree of ``c`` is the contiguous block ``[c, c + span(c))``. A rank sends to its (k-1) log_k n
children at most all at once, from one thread over non-blocking sockets (:func:`send_many`), so a
level costs one round trip, not k: radix 2 (binomial) would be the optimum for one send at a time
and takes 3x the levels. Each hop is a
fresh authenticated connection, and on a loaded node a hop is what costs (the harness,
docs/scale.md). A message to
``c`` carries the addresses of that block, so a forwarder needs nothing from the store, and a
parent that cannot deliver to a child within :data:`STEP_TIMEOUT` (dead: refused; frozen: no
greeting) delivers to the child's children itself: one stopped rank never cuts off its subtree.

The same tree carries the rest of a failure back and forth (:mod:`hpcring.diagnostics.watchdog`):
each message names its ``kind``. ``trigger`` goes down (with ``up``, the sender's own address, so
the receiver knows where to answer), ``gather`` comes up (a subtree's snapshots, merged at every
hop), ``report`` goes down, and in abort mode ``ack`` comes up and ``exit`` goes down: the store on
rank 0 then sees one connection per failure, not one per rank.

Every rank listens on a TCP port of its own (published once as ``diag/addr/<rank>``), from one
thread and one ``poll()`` loop (:class:`Listener`). A connection is authenticated before anything
it sends is parsed (:data:`hpcring.bootstrap.auth.DIAG`: the connector's MAC covers the body's
length and SHA-256, the body is read only after the MAC and the length cap are checked and is
then compared with that digest); the listener's proof is the acknowledgement, and it may carry a
reply (its proof covers the reply's length and digest too): a leaf of the tree answers the
trigger with its snapshot, so 7 ranks in 8 open no connection of their own in a failure. Bodies are JSON, never pickled; a large one (a subtree's snapshots) travels
zlib-compressed (:func:`pack`), inflated only after its MAC and digest are checked and only up to
:data:`MAX_INFLATED`.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable

from hpcring.bootstrap import auth
from hpcring.netio import recv_exact

log = logging.getLogger("hpcring.diagnostics.fanout")

STEP_TIMEOUT = 2.0            # connect + greeting + acknowledgement of one child (see step())
MAX_BODY = 8 << 20            # a 4096-rank root's message is ~100 KiB of addresses
MAX_INFLATED = 256 << 20      # a compressed body may not inflate past this (64k ranks' snapshots: ~64 MiB)
COMPRESS_OVER = 16 << 10      # bodies above this travel compressed (snapshots differ little: ~10x)
RETRY_STEPS = 3               # a later round's second try at a rank the first could not reach: 3 steps
MAX_PENDING = 1024            # connections a listener reads at once (a root has up to 7 log8 n children)
_EXTRA = struct.Struct(">I32s")  # body length, SHA-256 of the body (covered by the handshake MAC)


# ------------------------------------------------------------------------------------- the tree

RADIX = 8


def span(v: int, n: int) -> int:
    """Size bound of ``v``'s subtree: RADIX to the number of ``v``'s trailing zero digits (n for
    the root)."""
    if v == 0:
        return n
    s = 1
    while v % (s * RADIX) == 0:
        s *= RADIX
    return s


def children(v: int, n: int) -> list[int]:
    """Children of relative index ``v`` in an ``n``-rank tree, the largest subtree first."""
    out, step, top = [], 1, span(v, n)
    while step < top:
        out += [v + j * step for j in range(1, RADIX) if v + j * step < n]
        step *= RADIX
    return out[::-1]


def subtree(v: int, n: int) -> range:
    """The relative indices under ``v`` (``v`` included)."""
    return range(v, min(n, v + span(v, n)))


def levels(size: int) -> int:
    """Levels below the top of a subtree of ``size`` ranks, at most: the base-RADIX digits of
    ``size - 1`` (a child's is always less than its parent's)."""
    m, out = size - 1, 0
    while m > 0:
        m, out = m // RADIX, out + 1
    return out


def depth(n: int) -> int:
    """Hops from the root to the farthest rank: the most non-zero base-RADIX digits of an index
    below n: L = digits of n - 1, or L - 1 when 11...1 (L ones) is not below n."""
    top = levels(n)
    return top if top and (RADIX ** top - 1) // (RADIX - 1) <= n - 1 else max(0, top - 1)


# ------------------------------------------------------------------------------------ the wire

def step() -> float:
    """The step timeout in force: :data:`STEP_TIMEOUT`, or a fifth of HPCRING_HANDSHAKE_TIMEOUT
    where that was raised for ranks starved of CPU (2 s at its 10 s default): a starved child is
    then not taken for a stopped one."""
    from hpcring.collectives.handshake import handshake_timeout
    return max(STEP_TIMEOUT, handshake_timeout() / 5)


def pack(msg: dict) -> bytes:
    """A message's body: JSON, zlib-compressed above :data:`COMPRESS_OVER` (a JSON body starts
    with ``{``, a zlib stream with ``x``)."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    return zlib.compress(body, 1) if len(body) > COMPRESS_OVER else body


def unpack(body: bytes) -> dict:
    """The message in an authenticated body (see :func:`pack`); ValueError when it is not a
    JSON object or inflates past :data:`MAX_INFLATED`."""
    if body[:1] == b"x":
        z = zlib.decompressobj()
        try:
            body = z.decompress(body, MAX_INFLATED)
        except zlib.error as e:
            raise ValueError(f"bad compressed body: {e}") from None
        if z.unconsumed_tail:
            raise ValueError(f"compressed body inflates past {MAX_INFLATED} bytes")
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError("not a JSON object")
    return msg


ANSWER_LEN = auth.MAC_LEN + _EXTRA.size   # the acknowledgement: proof, then the reply's length and digest


def _answer(secret: bytes, ns: bytes, nc: bytes, extra: bytes, reply: bytes) -> bytes:
    """The listener's acknowledgement of a message (``extra``: its length and digest) with a
    reply (may be empty): the proof covers both messages' lengths and digests."""
    rx = _EXTRA.pack(len(reply), hashlib.sha256(reply).digest())
    return auth.DIAG.server_proof(secret, ns, nc, b"", extra + rx) + rx + reply


def _check_answer(secret: bytes, ns: bytes, nc: bytes, extra: bytes, head: bytes) -> tuple[int, bytes]:
    """The reply's (length, digest) from an acknowledgement's first :data:`ANSWER_LEN` bytes,
    once its proof is checked (ConnectionError: bad proof, or a reply over the cap)."""
    rx = head[auth.MAC_LEN:]
    if not hmac.compare_digest(head[:auth.MAC_LEN], auth.DIAG.server_proof(secret, ns, nc, b"", extra + rx)):
        raise ConnectionError("the trigger listener could not prove it knows the job secret")
    length, digest = _EXTRA.unpack(rx)
    if length > MAX_BODY:
        raise ConnectionError(f"reply of {length} bytes is over the {MAX_BODY}-byte cap")
    return length, digest


def _digested(data: bytes, digest: bytes, what: str) -> bytes:
    """``data`` once it matches the SHA-256 its sender's MAC covered (ConnectionError if not)."""
    if not hmac.compare_digest(hashlib.sha256(data).digest(), digest):
        raise ConnectionError(f"{what} does not match its authenticated digest")
    return data


def send(address: str, body: bytes, secret: bytes, timeout: float | None = None) -> bytes:
    """Deliver ``body`` to the listener at ``host:port``; returns the listener's reply (usually
    empty) once the listener proved it knows the secret (which it does only after checking our
    MAC and the body: the acknowledgement). Raises OSError/ConnectionError (refused, no greeting
    in time, bad proof, a reply that does not match its digest). ``timeout``: :func:`step` when
    None."""
    timeout = step() if timeout is None else timeout
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        ns = auth.DIAG.read_hello(s)
        nc = secrets.token_bytes(auth.NONCE_LEN)
        extra = _EXTRA.pack(len(body), hashlib.sha256(body).digest())
        s.sendall(nc + auth.DIAG.client_proof(secret, ns, nc, b"", extra) + extra + body)   # proof, then body
        length, digest = _check_answer(secret, ns, nc, extra, recv_exact(s, ANSWER_LEN))
        return _digested(recv_exact(s, length) if length else b"", digest, "reply")


class _Out:
    """One :func:`send_many` delivery: a non-blocking socket stepping through :func:`send`'s
    exchange (connect, greeting, proof and body, acknowledgement)."""

    __slots__ = ("sock", "body", "state", "buf", "out", "ns", "nc", "extra", "error", "want", "digest", "reply")

    def __init__(self, body: bytes) -> None:
        self.sock, self.body, self.state, self.buf, self.out = None, body, "connect", b"", b""
        self.ns = self.nc = self.extra = self.digest = self.reply = b""
        self.want = 0
        self.error: BaseException | None = None

    def step(self, secret: bytes) -> int | None:
        """Move on after the socket became ready; the events to wait for next, or None when done
        (``error`` then says how it ended)."""
        s, D = self.sock, auth.DIAG
        if self.state == "connect":
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise ConnectionRefusedError(err, os.strerror(err))
            self.state = "hello"
            return selectors.EVENT_READ
        if self.state in ("hello", "answer", "reply"):
            want = {"hello": D.hello_len, "answer": ANSWER_LEN}.get(self.state, self.want)
            chunk = s.recv(want - len(self.buf))
            if not chunk:
                raise ConnectionError("connection closed by the listener")
            self.buf += chunk
            if len(self.buf) < want:
                return selectors.EVENT_READ
            if self.state == "answer":
                self.want, self.digest = _check_answer(secret, self.ns, self.nc, self.extra, self.buf)
                self.state, self.buf = "reply", b""
                if self.want:
                    return selectors.EVENT_READ
            if self.state == "reply":
                self.reply = _digested(self.buf, self.digest, "reply")
                return None
            if self.buf[:len(D.magic)] != D.magic:
                raise auth.NotAPeer("bad magic in the greeting")
            self.ns, self.buf = self.buf[len(D.magic):], b""
            self.nc = secrets.token_bytes(auth.NONCE_LEN)
            self.extra = _EXTRA.pack(len(self.body), hashlib.sha256(self.body).digest())
            self.out = self.nc + D.client_proof(secret, self.ns, self.nc, b"", self.extra) + self.extra + self.body
            self.state = "send"                # at once: the listener is waiting for it
        try:
            sent = s.send(self.out)            # state "send"
        except BlockingIOError:
            return selectors.EVENT_WRITE
        self.out = self.out[sent:]
        if self.out:
            return selectors.EVENT_WRITE
        self.state = "answer"
        return selectors.EVENT_READ


def send_many(jobs: list[tuple[str, bytes]], secret: bytes, timeout: float | None = None,
              replies: list | None = None) -> list[BaseException | None]:
    """:func:`send` of each ``(address, body)`` in ``jobs``, all at once from this thread
    (non-blocking sockets and one selector: a parent reaches its children without a thread per
    child, which on a host running thousands of ranks costs a thread start and GIL hand-overs
    each). Returns, in order, None for a delivery the listener acknowledged, else its error
    (OSError, ConnectionError or ValueError, as :func:`send` raises them); ``replies``, when
    given, gets each listener's reply (b"" for none or a failed delivery), in order.
    ``timeout`` (default :func:`step`) bounds every delivery from the start."""
    timeout = step() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    outs = [_Out(body) for _, body in jobs]
    sel = selectors.DefaultSelector()
    try:
        for o, (address, _) in zip(outs, jobs):
            try:
                host, _, port = address.rpartition(":")
                family, kind, proto, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
                o.sock = socket.socket(family, kind, proto)
                o.sock.setblocking(False)
                err = o.sock.connect_ex(sockaddr)
                if err not in (0, errno.EINPROGRESS):
                    raise ConnectionRefusedError(err, os.strerror(err))
                sel.register(o.sock, selectors.EVENT_WRITE, o)
            except (OSError, ValueError, IndexError) as e:
                o.error = e if isinstance(e, (OSError, ValueError)) else ValueError(str(e))
                o.state = "done"
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                o = key.data
                try:
                    events = o.step(secret)
                except (OSError, ConnectionError, ValueError) as e:
                    o.error, events = e, None
                if events is None:
                    sel.unregister(o.sock)
                    o.state = "done"
                else:
                    sel.modify(o.sock, events, o)
        for o in outs:
            if o.state != "done":
                o.error = TimeoutError(f"no acknowledgement within {timeout:g} s ({o.state})")
        if replies is not None:
            replies.extend(o.reply if o.error is None else b"" for o in outs)
    finally:
        sel.close()
        for o in outs:
            if o.sock is not None:
                o.sock.close()
    return [o.error for o in outs]


PARSED = -1                  # _In.step: the message is in, the reply is the caller's to give


class _In:
    """One connection a :class:`Listener` reads: a non-blocking socket stepping through the
    listener's side of :func:`send`'s exchange (greeting, proof, body, acknowledgement)."""

    __slots__ = ("sock", "state", "out", "buf", "want", "ns", "nc", "extra", "digest", "msg", "deadline", "reply")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.msg, self.reply = sock, deadline, None, b""
        self.ns, greeting = auth.DIAG.hello()
        self.state, self.out, self.buf, self.want = "hello", greeting, bytearray(), auth.DIAG.proof_len
        self.nc = self.extra = self.digest = b""

    def step(self, secret: bytes) -> int | None:
        """Move on after the socket became ready; the events to wait for next, :data:`PARSED`
        when ``msg`` holds the message (answer it: :meth:`answer`), or None when the exchange
        is over. Raises on anything unauthenticated,
        over the cap or malformed: nothing is parsed before its MAC and digest are checked.
        Each step does what it can without waiting (the sender sends its proof and body
        together, so they are usually read in one call): on a loaded node every system call
        and wake-up of this thread costs a hand-over of the interpreter."""
        s = self.sock
        if self.out:                           # states "hello" and "answer": writing
            self.out = self.out[s.send(self.out):]
            if self.out:
                return selectors.EVENT_WRITE
            if self.state == "answer":
                return None
            self.state = "proof"
            return selectors.EVENT_READ        # the sender needs a round trip to answer
        chunk = s.recv(max(self.want - len(self.buf), 1 << 16) if self.state == "proof" else
                       min(self.want - len(self.buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed by the sender ({self.state})")
        self.buf += chunk
        if self.state == "proof":              # the MAC first: nothing else is looked at before it
            if len(self.buf) < self.want:
                return selectors.EVENT_READ
            proof_len = auth.DIAG.proof_len
            self.nc, self.extra = auth.DIAG.check(secret, self.ns, bytes(self.buf[:proof_len]))
            length, self.digest = _EXTRA.unpack(self.extra)
            if length > MAX_BODY:
                raise ConnectionError(f"message of {length} bytes is over the {MAX_BODY}-byte cap")
            self.state, self.buf, self.want = "body", self.buf[proof_len:], length
        if len(self.buf) < self.want:
            return selectors.EVENT_READ
        if len(self.buf) > self.want:
            raise ConnectionError(f"{len(self.buf) - self.want} bytes past the message's authenticated length")
        self.msg = unpack(_digested(bytes(self.buf), self.digest, "message body"))
        self.state = "parsed"
        return PARSED

    def answer(self, secret: bytes, reply: bytes) -> int | None:
        """Acknowledge the message with ``reply`` (may be empty); the events to wait for, or
        None when it went out whole (a few bytes into an empty send buffer: at once)."""
        self.state, self.reply = "answer", reply
        self.out = _answer(secret, self.ns, self.nc, self.extra, reply)
        try:
            self.out = self.out[self.sock.send(self.out):]
        except BlockingIOError:
            pass
        return selectors.EVENT_WRITE if self.out else None


class Listener:
    """A rank's trigger listener: one thread and one selector over the listening socket and every
    connection being read (non-blocking, each stepping through the handshake on its own:
    :class:`_In`). A parent hears its children's subtrees in parallel and a slow or silent peer
    delays only its own message (each connection has :func:`step` to finish), with no thread per
    connection or message: on a node running many ranks every thread start and GIL hand-over
    counts (docs/scale.md). ``on_message(dict)`` is called in that thread for every authenticated
    message, before it is acknowledged; it must not block, and what it returns (bytes) goes back
    to the sender with the acknowledgement (:func:`send`'s value). ``on_unsent(msg)`` is called
    when a non-empty reply could not be sent whole (the sender left or timed out)."""

    def __init__(self, bind: str, secret: bytes, on_message: Callable[[dict], bytes | None],
                 on_unsent: Callable[[dict], None] | None = None) -> None:
        self._secret, self._on_message, self._on_unsent = secret, on_message, on_unsent
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind, 0))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._closing = False
        self._conns: dict[socket.socket, _In] = {}
        self._paused = False                                   # not accepting: MAX_PENDING being read
        self._thread = threading.Thread(target=self._serve, name="hpcring-watchdog-listen", daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)    # wakes the loop's poll() (Linux)
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        if not self._thread.is_alive():
            self._release()

    def _release(self) -> None:
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass
        self._conns.clear()

    def _serve(self) -> None:
        # Blocked in poll() until a connection, a byte, a connection's deadline or close(): no
        # periodic wake-up, which thousands of idle ranks per node would pay for. poll(2), not
        # epoll: no descriptor of its own, and a rank's listener watches a handful at most.
        sel = selectors.PollSelector()
        try:
            sel.register(self._sock, selectors.EVENT_READ, None)
            while not self._closing:
                first = min((c.deadline for c in self._conns.values()), default=None)
                timeout = None if first is None else max(0.0, first - time.monotonic())
                for key, _ in sel.select(timeout):
                    if self._closing:
                        return
                    if key.data is None:
                        self._accept(sel)
                    else:
                        self._step(sel, key.data)
                now = time.monotonic()
                for c in [c for c in self._conns.values() if c.deadline <= now]:
                    self._drop(sel, c, TimeoutError(f"no message within {step():g} s ({c.state})"))
        except (OSError, ValueError) as e:
            if not self._closing:
                log.warning("watchdog listener stopped: %s", e)
        finally:
            sel.close()
            if self._closing:
                self._release()

    def _accept(self, sel) -> None:
        while True:
            if len(self._conns) >= MAX_PENDING:   # full: the backlog waits until one is done
                sel.unregister(self._sock)        # (a readable socket left in the set would spin)
                self._paused = True
                return
            try:
                conn, _peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:           # out of descriptors: the pending ones finish first
                if self._closing:
                    return
                log.warning("watchdog listener: accept failed: %s", e)
                time.sleep(0.1)            # the socket stays readable: not a busy loop
                return
            conn.setblocking(False)
            c = _In(conn, time.monotonic() + step())
            self._conns[conn] = c
            sel.register(conn, selectors.EVENT_WRITE, c)
            self._step(sel, c)                 # the greeting, at once: a new socket can take it

    def _step(self, sel, c: _In) -> None:
        try:
            events = c.step(self._secret)
            if c.state in ("body", "answer"):      # authenticated: time runs per step, as a
                c.deadline = time.monotonic() + step()   # blocking read's timeout would
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ConnectionError, ValueError, EOFError) as e:
            self._drop(sel, c, e)
            return
        if events == PARSED:
            reply = None
            if not self._closing:
                try:
                    reply = self._on_message(c.msg)
                except Exception:  # noqa: BLE001 - the listener outlives a bad handler call
                    log.exception("watchdog trigger handler failed")
            try:
                events = c.answer(self._secret, bytes(reply) if isinstance(reply, (bytes, bytearray)) else b"")
            except OSError as e:
                self._drop(sel, c, e)
                return
        if events is not None:
            sel.modify(c.sock, events, c)
            return
        self._drop(sel, c, None)

    def _drop(self, sel, c: _In, error: BaseException | None) -> None:
        if error is not None:
            log.warning("watchdog listener: dropped a connection: %s", error)
        sel.unregister(c.sock)
        del self._conns[c.sock]
        c.sock.close()
        if self._paused and not self._closing:
            sel.register(self._sock, selectors.EVENT_READ, None)
            self._paused = False
        if error is not None and c.state == "answer" and c.reply and self._on_unsent is not None:
            try:
                self._on_unsent(c.msg)
            except Exception:  # noqa: BLE001
                log.exception("watchdog reply fallback failed")


# --------------------------------------------------------------------------------- forwarding

def message(root: int, n: int, v: int, addrs: list, trig: dict, up: str | None = None) -> bytes:
    """The trigger's body for relative index ``v``: the trigger, the addresses of ``v``'s subtree
    (``addrs`` indexed from ``v``) and ``up``, the sender's listener (where ``v`` answers)."""
    return pack({"kind": "trigger", "root": root, "n": n, "v": v, "trig": trig, "addrs": addrs, "up": up})


def forward(root: int, n: int, v: int, addrs: list, trig: dict, secret: bytes,
            step_timeout: float | None = None, delivered: list | None = None,
            on_reply: Callable[[int, bytes], None] | None = None) -> list[int]:
    """Deliver the trigger to ``v``'s children (``addrs``: addresses of ``subtree(v)``, from
    ``v`` on, None where unknown; ``addrs[0]``, this rank's own, is sent along as ``up``), to all
    at once (:func:`send_many`: a frozen child costs the step timeout once, not per sibling),
    taking over the subtree of a child that cannot be reached. Appends ``(relative index, address)`` of every rank it
    delivered to (this rank's children in the tree as it stands) to ``delivered``, and calls
    ``on_reply(relative index, reply)`` for every non-empty reply (a leaf's snapshot). Returns
    (once every branch is done) the relative indices that could not be reached at all."""
    up = addrs[0] if addrs else None
    step_timeout = step() if step_timeout is None else step_timeout
    return _spread(n, v, addrs, children(v, n), lambda c, block: message(root, n, c, block, trig, up),
                   secret, step_timeout, delivered, on_reply)


def relay(n: int, v: int, addrs: list, kids: list[int], body: bytes, secret: bytes,
          step_timeout: float | None = None) -> list[int]:
    """A later round down the tree (the report, the exit): ``body`` to ``kids`` (relative
    indices: ``v``'s children), covering the subtree of one that cannot be reached now (it died
    or stalled since) as :func:`forward` does, then trying each rank it could not reach once more
    with :data:`RETRY_STEPS` times the step timeout: it answered the trigger, so it is more
    likely starved than gone, and otherwise waits for its own fallback (the store, seconds
    later). Returns the relative indices not reached."""
    step_timeout = step() if step_timeout is None else step_timeout
    lost = _spread(n, v, addrs, kids, lambda c, block: body, secret, step_timeout, None)
    if not lost:
        return lost
    retry = [c for c in lost if 0 <= c - v < len(addrs) and addrs[c - v]]
    errors = send_many([(addrs[c - v], body) for c in retry], secret, RETRY_STEPS * step_timeout)
    return sorted({c for c in lost if c not in retry} | {c for c, e in zip(retry, errors) if e is not None})


def _spread(n: int, v: int, addrs: list, first: list[int], body_for, secret: bytes, step_timeout: float,
            delivered: list | None, on_reply: Callable[[int, bytes], None] | None = None) -> list[int]:
    """Deliver to ``first`` (relative indices) at once (:func:`send_many`), then to the children
    of each that could not be reached, level by level. Returns the relative indices not reached."""
    lost: list[int] = []
    todo = list(first)
    while todo:
        jobs, sent, later = [], [], []
        for c in todo:
            addr = addrs[c - v] if 0 <= c - v < len(addrs) else None
            if addr:
                jobs.append((addr, body_for(c, addrs[c - v:c - v + len(subtree(c, n))])))
                sent.append(c)
            else:
                lost.append(c)
                later += children(c, n)    # its children, in the next batch (largest first)
        replies: list[bytes] = []
        for c, (addr, _), err, reply in zip(sent, jobs, send_many(jobs, secret, step_timeout, replies), replies):
            if err is None:
                if delivered is not None:
                    delivered.append((c, addr))
                if reply and on_reply is not None:
                    on_reply(c, reply)
                continue
            log.info("watchdog fan-out: relative rank %d at %s unreachable (%s); covering its subtree", c, addr, err)
            lost.append(c)
            later += children(c, n)
        todo = later
    return sorted(lost)
