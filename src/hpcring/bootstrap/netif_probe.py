"""The authenticated interface probe: a short-lived listener per candidate address, and a connect.

Used by the verification between ranks (:mod:`hpcring.bootstrap.netif_verify`) and by
``hpcring doctor`` (reachability and its bandwidth sink). Peers prove the job secret with the
handshake of :mod:`hpcring.bootstrap.auth` before the listener reads anything else.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from hpcring.bootstrap import auth

log = logging.getLogger("hpcring.bootstrap.netif")


class ProbeListener:
    """Short-lived authenticated listener on one candidate address.

    Contract: binds ``(address, 0)`` at construction (``port`` 0 and ``error`` set when that
    fails); each accepted peer gets a nonce and must answer with the HMAC before anything else is
    read; wrong answers are logged with the peer address and dropped.
    ``on_authenticated(conn)``, if given, is called with each peer's socket after a successful
    challenge (in that peer's thread; the socket is closed when it returns), so other tools can
    reuse the authentication for a short exchange of their own (``hpcring doctor``'s bandwidth sink).
    Test seams for dead links: ``listen=False`` binds but never listens (connects are refused);
    ``listen="blackhole"`` listens with a full accept queue that is never drained, so the kernel
    drops further SYNs and connects time out, like a firewalled or unrouted link.
    """

    def __init__(self, address: str, secret: bytes, *, listen: bool | str = True,
                 io_timeout: float = 2.0, on_authenticated=None) -> None:
        self.address, self._secret, self._io_timeout = address, secret, io_timeout
        self._on_authenticated = on_authenticated
        self.port, self.error = 0, None
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
            self.port = self._sock.getsockname()[1]
            self._fillers: list[socket.socket] = []
            if listen == "blackhole":
                self._sock.listen(0)
                self._fill_queue()
                return
            if listen:
                self._sock.listen(256)
        except OSError as e:
            self.error = f"cannot bind {address}: {e.strerror}"
            return
        self._sock.settimeout(0.2)   # lets the accept loop notice close() quickly
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"hpcring-probe:{address}")
        if listen:
            self._thread.start()

    def _fill_queue(self) -> None:
        for _ in range(3):   # backlog 0 holds one connection; the rest sit in SYN retry
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect((self.address, self.port))
            except BlockingIOError:
                pass
            self._fillers.append(c)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn, peer), daemon=True).start()

    def _answer(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                conn.settimeout(self._io_timeout)
                try:
                    ns, nc, _ = auth.PROBE.accept(conn, self._secret)
                except auth.BadProof:
                    log.warning("interface probe on %s:%d: dropped unauthenticated peer %s:%d",
                                self.address, self.port, peer[0], peer[1])
                    return
                conn.sendall(auth.PROBE.server_proof(self._secret, ns, nc))
                if self._on_authenticated is not None:
                    self._on_authenticated(conn)
            except (OSError, EOFError) as e:
                log.debug("probe from %s failed: %s", peer, e)

    def close(self) -> None:
        self._stop.set()
        for c in getattr(self, "_fillers", ()):
            c.close()
        self._sock.close()


class ProbeFailed(Exception):
    """A probe did not authenticate; ``str()`` is the short reason :func:`probe` returns."""


def probe_connect(address: str, port: int, secret: bytes, timeout: float = 2.0) -> socket.socket:
    """Connect to a :class:`ProbeListener` and run the challenge within ``timeout`` seconds; return
    the authenticated socket (the caller closes it) or raise ProbeFailed with a short reason."""
    if not port:
        raise ProbeFailed("peer has no listener on this address")
    t0 = time.monotonic()
    s = None
    try:
        s = socket.create_connection((address, port), timeout=timeout)
        s.settimeout(max(0.1, timeout - (time.monotonic() - t0)))
        try:
            auth.PROBE.prove(s, secret, auth.PROBE.read_hello(s))
        except auth.BadProof:
            raise ProbeFailed("answered with a bad MAC (another job's rank?)") from None
        return s
    except (OSError, EOFError, ProbeFailed) as e:
        if s is not None:
            s.close()
        if isinstance(e, ProbeFailed):
            raise
        raise ProbeFailed(_probe_reason(e, timeout)) from None


def _probe_reason(e: BaseException, timeout: float) -> str:
    if isinstance(e, (TimeoutError, socket.timeout)):
        return f"timed out after {timeout:.1f}s"
    if isinstance(e, EOFError):
        return "peer closed the connection (secret mismatch?)"
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"


def probe(address: str, port: int, secret: bytes, timeout: float = 2.0) -> str | None:
    """Connect and run the challenge; None on success, else a short reason (never raises)."""
    try:
        probe_connect(address, port, secret, timeout).close()
        return None
    except ProbeFailed as e:
        return str(e)
