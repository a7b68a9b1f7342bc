"""The watchdog's trigger fan-out: a k-nomial tree (radix :data:`RADIX`) over the ranks, rooted at
the rank that saw the failure first, so a trigger reaches n ranks in about log8 n hops (4 at 4096
ranks, 6 at 64k) without any rank keeping a connection open for the whole job.

Tree (indices relative to the root: ``v = (rank - root) % n``, written in base k = RADIX): the
children of ``v`` are ``v + j * k**i`` for j = 1..k-1 and every ``k**i`` below ``span(v)``, the
place of ``v``'s lowest non-zero digit (all powers below n for the root), largest first; the
subtree of ``c`` is the contiguous block ``[c, c + span(c))``. A rank sends to its (k-1) log_k n
children at most in parallel, one thread each, so a level costs one round trip, not k: radix 2
(binomial) would be the optimum for one send at a time and takes 3x the levels. Each hop is a
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

Every rank listens on a TCP port of its own (published once as ``diag/addr/<rank>``). A
connection is authenticated before anything it sends is parsed (:data:`hpcring.bootstrap.auth.DIAG`:
the connector's MAC covers the body's length and SHA-256, the body is read only after the MAC and
the length cap are checked and is then compared with that digest); the listener's proof is the
acknowledgement. Bodies are JSON, never pickled; a large one (a subtree's snapshots) travels
zlib-compressed (:func:`pack`), inflated only after its MAC and digest are checked and only up to
:data:`MAX_INFLATED`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import secrets
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
MAX_HANDLERS = 32             # connections a listener reads at once (a root has up to 7 log8 n children)
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


def send(address: str, body: bytes, secret: bytes, timeout: float | None = None) -> None:
    """Deliver ``body`` to the listener at ``host:port``; returns once the listener proved it
    knows the secret (which it does only after checking our MAC and the body: the acknowledgement).
    Raises OSError/ConnectionError (refused, no greeting in time, bad proof). ``timeout``:
    :func:`step` when None."""
    timeout = step() if timeout is None else timeout
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        ns = auth.DIAG.read_hello(s)
        nc = secrets.token_bytes(auth.NONCE_LEN)
        extra = _EXTRA.pack(len(body), hashlib.sha256(body).digest())
        s.sendall(nc + auth.DIAG.client_proof(secret, ns, nc, b"", extra) + extra + body)   # proof, then body
        answer = recv_exact(s, auth.MAC_LEN)
        if not hmac.compare_digest(answer, auth.DIAG.server_proof(secret, ns, nc, b"", extra)):
            raise ConnectionError("the trigger listener could not prove it knows the job secret")


class Listener:
    """A rank's trigger listener: one thread accepting on ``bind`` (port 0: any) and handler
    threads reading the connections (started as needed, at most :data:`MAX_HANDLERS`, then kept:
    a parent hears its children's subtrees in parallel, a slow peer delays only its own message,
    and a thread is not started per message, which under load costs a GIL round trip each),
    calling ``on_message(dict)`` for every authenticated message, in a handler thread."""

    def __init__(self, bind: str, secret: bytes, on_message: Callable[[dict], None]) -> None:
        self._secret, self._on_message = secret, on_message
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind, 0))
            self._sock.listen(128)
        except BaseException:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._closing = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()   # accepted connections, then None: stop
        self._idle = 0                                         # handlers waiting on the queue
        self._handlers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="hpcring-watchdog-listen", daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)    # wakes the blocked accept() (Linux)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        for _ in self._handlers:
            self._queue.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _serve(self) -> None:
        # Blocked in accept() until a connection or close(): no periodic wake-up, which thousands
        # of idle ranks per node would pay for (4096 rank threads waking twice a second here).
        while not self._closing:
            try:
                conn, _peer = self._sock.accept()
            except (OSError, ValueError):
                return
            with self._lock:
                spawn = self._idle == 0 and len(self._handlers) < MAX_HANDLERS
                if spawn:
                    t = threading.Thread(target=self._handle, name="hpcring-watchdog-conn", daemon=True)
                    self._handlers.append(t)
            if spawn:
                t.start()
            self._queue.put(conn)      # at MAX_HANDLERS busy handlers, it waits for the first free

    def _handle(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            conn = self._queue.get()
            with self._lock:
                self._idle -= 1
            if conn is None or self._closing:
                if conn is not None:
                    conn.close()
                return
            with conn:
                msg = self._read(conn)
            if msg is not None and not self._closing:
                try:
                    self._on_message(msg)
                except Exception:  # noqa: BLE001 - the listener outlives a bad handler call
                    log.exception("watchdog trigger handler failed")

    def _read(self, conn: socket.socket) -> dict | None:
        """One message, or None (logged) when the peer fails authentication or sends nonsense."""
        try:
            conn.settimeout(step())
            ns, nc, extra = auth.DIAG.accept(conn, self._secret)   # MAC checked before any parsing
            length, digest = _EXTRA.unpack(extra)
            if length > MAX_BODY:
                raise ConnectionError(f"message of {length} bytes is over the {MAX_BODY}-byte cap")
            body = recv_exact(conn, length)
            if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
                raise ConnectionError("message body does not match its authenticated digest")
            msg = unpack(body)
            conn.sendall(auth.DIAG.server_proof(self._secret, ns, nc, b"", extra))
            return msg
        except (OSError, ConnectionError, ValueError, EOFError) as e:
            log.warning("watchdog listener: dropped a connection: %s", e)
            return None


# --------------------------------------------------------------------------------- forwarding

def message(root: int, n: int, v: int, addrs: list, trig: dict, up: str | None = None) -> bytes:
    """The trigger's body for relative index ``v``: the trigger, the addresses of ``v``'s subtree
    (``addrs`` indexed from ``v``) and ``up``, the sender's listener (where ``v`` answers)."""
    return pack({"kind": "trigger", "root": root, "n": n, "v": v, "trig": trig, "addrs": addrs, "up": up})


def forward(root: int, n: int, v: int, addrs: list, trig: dict, secret: bytes,
            step_timeout: float | None = None, delivered: list | None = None) -> list[int]:
    """Deliver the trigger to ``v``'s children (``addrs``: addresses of ``subtree(v)``, from
    ``v`` on, None where unknown; ``addrs[0]``, this rank's own, is sent along as ``up``), one
    thread per child so that a frozen child delays only its own subtree, taking over the subtree
    of a child that cannot be reached. Appends ``(relative index, address)`` of every rank it
    delivered to (this rank's children in the tree as it stands) to ``delivered``. Returns (once
    every branch is done) the relative indices that could not be reached at all."""
    up = addrs[0] if addrs else None
    step_timeout = step() if step_timeout is None else step_timeout
    return _spread(n, v, addrs, children(v, n), lambda c, block: message(root, n, c, block, trig, up),
                   secret, step_timeout, delivered)


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
    again: list[int] = []

    def retry(c: int) -> None:
        try:
            send(addrs[c - v], body, secret, RETRY_STEPS * step_timeout)
        except (OSError, ConnectionError, ValueError, TypeError, IndexError):
            again.append(c)
    threads = [threading.Thread(target=retry, args=(c,), name="hpcring-watchdog-retry", daemon=True)
               for c in lost]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RETRY_STEPS * step_timeout + 1.0)
    return sorted(again)


def _spread(n: int, v: int, addrs: list, first: list[int], body_for, secret: bytes, step_timeout: float,
            delivered: list | None) -> list[int]:
    lost: list[int] = []

    def branch(start: int) -> None:
        todo = [start]
        while todo:
            c = todo.pop(0)
            block = subtree(c, n)
            addr = addrs[c - v] if 0 <= c - v < len(addrs) else None
            if addr:
                try:
                    send(addr, body_for(c, addrs[c - v:c - v + len(block)]), secret, step_timeout)
                    if delivered is not None:
                        delivered.append((c, addr))
                    continue
                except (OSError, ConnectionError, ValueError) as e:
                    log.info("watchdog fan-out: relative rank %d at %s unreachable (%s); covering its subtree",
                             c, addr, e)
            lost.append(c)
            todo[0:0] = children(c, n)     # its children, before the rest (largest first)

    threads = [threading.Thread(target=branch, args=(c,), name="hpcring-watchdog-fanout", daemon=True)
               for c in first]
    for t in threads:
        t.start()
    for t in threads:           # each branch is bounded: step_timeout per rank it could not reach
        t.join()
    return sorted(lost)
