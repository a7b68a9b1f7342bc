"""The side channel's messages between two ranks: a body (JSON, zlib-compressed when large), the
authenticated exchange that carries it, and the senders (:func:`send`, :func:`send_many`); the
receiving end is :mod:`hpcring.diagnostics.watchdog.listener`.

A connection is authenticated before anything it sends is parsed
(:data:`hpcring.bootstrap.auth.DIAG`: the connector's MAC covers the body's length and SHA-256,
the body is read only after the MAC and the length cap are checked and is then compared with that
digest); the listener's proof is the acknowledgement, and it may carry a reply (its proof covers
the reply's length and digest too): a leaf of the tree answers the trigger with its snapshot, so 7
ranks in 8 open no connection of their own in a failure. Bodies are JSON, never pickled; a large
one (a subtree's snapshots) travels zlib-compressed (:func:`pack`), inflated only after its MAC and
digest are checked and only up to :data:`MAX_INFLATED`.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import selectors
import socket
import struct
import time
import zlib

from hpcring.bootstrap import auth
from hpcring.netio import recv_exact
from hpcring.collectives.handshake import handshake_timeout

STEP_TIMEOUT = 2.0            # connect + greeting + acknowledgement of one child (see step())
MAX_BODY = 8 << 20            # a 4096-rank root's message is ~100 KiB of addresses
MAX_INFLATED = 256 << 20      # a compressed body may not inflate past this (64k ranks' snapshots: ~64 MiB)
COMPRESS_OVER = 16 << 10      # bodies above this travel compressed (snapshots differ little: ~10x)
_EXTRA = struct.Struct(">I32s")  # body length, SHA-256 of the body (covered by the handshake MAC)


def step() -> float:
    """The step timeout in force: :data:`STEP_TIMEOUT`, or a fifth of HPCRING_HANDSHAKE_TIMEOUT
    where that was raised for ranks starved of CPU (2 s at its 10 s default): a starved child is
    then not taken for a stopped one."""
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

