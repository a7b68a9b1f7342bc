"""One store connection's state: its handshake, buffers, sequence numbers and deadlines."""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_wire import HANDSHAKE_TIMEOUT

if TYPE_CHECKING:
    from hpcring.bootstrap.store_server.ops import _Group


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
