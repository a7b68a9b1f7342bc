"""The store's listening socket: accepting, the connection cap, eviction and accept back-off."""
from __future__ import annotations

import itertools
import logging
import selectors
import socket
import time
from typing import TYPE_CHECKING

from hpcring.bootstrap.store_server.conn import _Conn
from hpcring.bootstrap.store_wire import ACCEPT_BACKOFF

if TYPE_CHECKING:
    from hpcring.bootstrap.store_server.loop import Loop


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking socket listening on ``host:port``; raises ``OSError`` if the port is taken."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR only skips TIME_WAIT leftovers; Linux still refuses a port someone listens on.
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, port))
        lsock.listen(backlog)
    except OSError:
        lsock.close()
        raise
    lsock.setblocking(False)
    return lsock


class Listener:
    """Accepts the loop's connections on ``lsock``: at most ``max_connections`` open (the oldest
    still in its handshake evicted to make room), accepting paused with back-off when full."""

    def __init__(self, loop: Loop, lsock: socket.socket, max_connections: int, handshake_timeout: float) -> None:
        self._loop = loop
        self.lsock = lsock
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.paused_until: float | None = None
        self._backoff = ACCEPT_BACKOFF[0]

    def accept(self) -> None:
        loop = self._loop
        for _ in range(64):   # drain the backlog in batches so 256 simultaneous connects are quick
            if len(loop.conns) >= self.max_connections and not self.evict_unauthenticated():
                self.pause("connection limit %d reached" % self.max_connections)
                return
            try:
                sock, addr = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE & co.: the connection stays in the kernel's backlog and the listener stays
                # readable, so retrying at once would spin. Free descriptors held by peers still
                # in their handshake and go on; with none to free, pause with back-off.
                loop.stats["accept_errors"] += 1
                if self.evict_unauthenticated(count=32):
                    loop.rlog(logging.WARNING, "store %s: accept() failed: %s; dropped peers without "
                              "a handshake to make room", loop.address, e)
                    continue
                self.pause(f"accept() failed: {e}")
                return
            self._backoff = ACCEPT_BACKOFF[0]
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", self.handshake_timeout)
            loop.stats["connections"] += 1
            loop.conns[conn] = None
            if len(loop.conns) > loop.stats["peak_connections"]:
                loop.stats["peak_connections"] = len(loop.conns)
            loop.sel.register(sock, selectors.EVENT_READ, conn)
            loop.schedule(conn.hello_deadline, conn)
            loop.send_raw(conn, conn.hello)

    def pause(self, why: str) -> None:
        if self.paused_until is not None:
            return
        loop = self._loop
        loop.rlog(logging.WARNING, "store %s: %s; not accepting for %.2fs (%d connections open)",
                  loop.address, why, self._backoff, len(loop.conns))
        try:
            loop.sel.unregister(self.lsock)
        except (KeyError, ValueError):
            pass
        self.paused_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, ACCEPT_BACKOFF[1])

    def resume(self) -> None:
        self.paused_until = None
        self._loop.sel.register(self.lsock, selectors.EVENT_READ, "accept")

    def evict_unauthenticated(self, count: int = 1) -> bool:
        """Drop the ``count`` oldest connections still in their handshake; False if there is none.

        Legitimate ranks finish their handshake within one round trip, so under a flood of idle
        or garbage connections the oldest unauthenticated one is the attacker's.
        """
        victims = [c for c in itertools.islice((c for c in self._loop.conns if not c.ready), count)]
        for conn in victims:
            self._loop.drop(conn, "evicted to make room (too many connections without a handshake)",
                            counter="evicted")
        return bool(victims)
