"""Socket and deadline helpers shared by the rendezvous store, interface probes and the ring's handshake."""
from __future__ import annotations

import socket
import time


class ConnectionClosed(ConnectionError, EOFError):
    """The peer closed the connection mid-message (both kinds, so either ``except`` catches it)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes (the socket's own timeout bounds each wait); raise ConnectionClosed."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionClosed(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), never negative."""
    return max(0.0, deadline - time.monotonic())
