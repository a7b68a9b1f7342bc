"""The watchdog's trigger fan-out: a binomial tree over the ranks, rooted at the rank that saw the
failure first, so a trigger reaches n ranks in floor(log2 n) hops without any rank keeping a
connection open for the whole job.

Tree (indices relative to the root: ``v = (rank - root) % n``): the children of ``v`` are
``v + 2**k`` for every ``2**k`` below ``v``'s lowest set bit (all powers below n for the root),
largest first; the subtree of ``c`` is the contiguous block ``[c, c + lowbit(c))``. A message to
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
import secrets
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable

from hpcring.bootstrap import auth
from hpcring.netio import recv_exact

log = logging.getLogger("hpcring.diagnostics.fanout")

STEP_TIMEOUT = 2.0            # connect + greeting + acknowledgement of one child
MAX_BODY = 8 << 20            # a 4096-rank root's message is ~100 KiB of addresses
MAX_INFLATED = 256 << 20      # a compressed body may not inflate past this (64k ranks' snapshots: ~64 MiB)
COMPRESS_OVER = 16 << 10      # bodies above this travel compressed (snapshots differ little: ~10x)
_EXTRA = struct.Struct(">I32s")  # body length, SHA-256 of the body (covered by the handshake MAC)


# ------------------------------------------------------------------------------------- the tree

def lowbit(v: int, n: int) -> int:
    """Size bound of ``v``'s subtree: its lowest set bit (n for the root)."""
    return n if v == 0 else v & -v


def children(v: int, n: int) -> list[int]:
    """Children of relative index ``v`` in an ``n``-rank tree, the largest subtree first."""
    out, step, top = [], 1, lowbit(v, n)
    while step < top and v + step < n:
        out.append(v + step)
        step <<= 1
    return out[::-1]


def subtree(v: int, n: int) -> range:
    """The relative indices under ``v`` (``v`` included)."""
    return range(v, min(n, v + lowbit(v, n)))


def depth(n: int) -> int:
    """Hops from the root to the farthest rank: the most bits set in an index below n."""
    return max(0, n.bit_length() - 1)


# ------------------------------------------------------------------------------------ the wire

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


def send(address: str, body: bytes, secret: bytes, timeout: float = STEP_TIMEOUT) -> None:
    """Deliver ``body`` to the listener at ``host:port``; returns once the listener proved it
    knows the secret (which it does only after checking our MAC and the body: the acknowledgement).
    Raises OSError/ConnectionError (refused, no greeting in time, bad proof)."""
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
    """A rank's trigger listener: one thread accepting on ``bind`` (port 0: any), calling
    ``on_message(dict)`` for every authenticated message, in that thread."""

    def __init__(self, bind: str, secret: bytes, on_message: Callable[[dict], None]) -> None:
        self._secret, self._on_message = secret, on_message
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind, 0))
            self._sock.listen(64)
        except BaseException:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="hpcring-watchdog-listen", daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.close()
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _serve(self) -> None:
        while not self._closing:
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.5)   # wakes to see close()
                if not ready:
                    continue
                conn, _peer = self._sock.accept()
            except (OSError, ValueError):
                return
            with conn:
                msg = self._read(conn)
            if msg is not None:
                try:
                    self._on_message(msg)
                except Exception:  # noqa: BLE001 - the listener outlives a bad handler call
                    log.exception("watchdog trigger handler failed")

    def _read(self, conn: socket.socket) -> dict | None:
        """One message, or None (logged) when the peer fails authentication or sends nonsense."""
        try:
            conn.settimeout(STEP_TIMEOUT)
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
            step_timeout: float = STEP_TIMEOUT, delivered: list | None = None) -> list[int]:
    """Deliver the trigger to ``v``'s children (``addrs``: addresses of ``subtree(v)``, from
    ``v`` on, None where unknown; ``addrs[0]``, this rank's own, is sent along as ``up``), one
    thread per child so that a frozen child delays only its own subtree, taking over the subtree
    of a child that cannot be reached. Appends ``(relative index, address)`` of every rank it
    delivered to (this rank's children in the tree as it stands) to ``delivered``. Returns (once
    every branch is done) the relative indices that could not be reached at all."""
    lost: list[int] = []
    up = addrs[0] if addrs else None

    def branch(first: int) -> None:
        todo = [first]
        while todo:
            c = todo.pop(0)
            block = subtree(c, n)
            addr = addrs[c - v] if c - v < len(addrs) else None
            if addr:
                try:
                    send(addr, message(root, n, c, addrs[c - v:c - v + len(block)], trig, up), secret, step_timeout)
                    if delivered is not None:
                        delivered.append((c, addr))
                    continue
                except (OSError, ConnectionError, ValueError) as e:
                    log.info("watchdog fan-out: relative rank %d at %s unreachable (%s); covering its subtree",
                             c, addr, e)
            lost.append(c)
            todo[0:0] = children(c, n)     # its children, before the rest (largest first)

    threads = [threading.Thread(target=branch, args=(c,), name="hpcring-watchdog-fanout", daemon=True)
               for c in children(v, n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(lost)


def send_all(addresses: list[str], body: bytes, secret: bytes, timeout: float = STEP_TIMEOUT) -> list[str]:
    """Deliver one ``body`` to each of ``addresses`` in parallel (a later round down the tree:
    the children the trigger reached); returns the addresses that failed. Bounded by ``timeout``
    plus a second: a child that stops now is left to its own fallback (the store)."""
    failed: list[str] = []

    def one(addr: str) -> None:
        try:
            send(addr, body, secret, timeout)
        except (OSError, ConnectionError, ValueError) as e:
            log.info("watchdog fan-out: %s unreachable (%s)", addr, e)
            failed.append(addr)
    threads = [threading.Thread(target=one, args=(a,), name="hpcring-watchdog-send", daemon=True) for a in addresses]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout + 1.0
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return failed
