"""The handshake of every connection between two ranks' collectives (the ring's links and the
point-to-point mailbox's): hpcring.bootstrap.auth's challenge-response bound to the
communicator's context, the MAC covering the connector's rank and connection index. Nothing the
peer sends is interpreted before its MAC is verified."""
from __future__ import annotations

import socket
import struct

from hpcring.bootstrap import auth
from hpcring.config import envvars

_U32x2 = struct.Struct(">II")   # (rank, connection index): the handshake's extra field


def handshake_timeout() -> float:
    """HPCRING_HANDSHAKE_TIMEOUT: how long a peer may take to authenticate a connection (10 s)."""
    return float(envvars.get("HPCRING_HANDSHAKE_TIMEOUT"))


def authenticate_connector(sock: socket.socket, secret: bytes, ctx: bytes, rank: int, conn: int) -> None:
    """Connector side of the handshake (hpcring.bootstrap.auth, bound to the communicator's
    context, the MAC covering our rank and connection index); raises ConnectionError when the
    listener refuses us or cannot prove it knows the secret."""
    try:
        nl = auth.RING.read_hello(sock)
    except auth.NotAPeer:
        raise ConnectionError("the listener is not an hpcring ring endpoint (bad magic)") from None
    try:
        auth.RING.prove(sock, secret, nl, ctx, _U32x2.pack(rank, conn))
    except auth.BadProof:
        raise ConnectionError("the listener could not prove it knows the job secret") from None
    except ConnectionError:
        raise ConnectionError("the listener refused authentication (different job secret?)") from None


def authenticate_listener(sock: socket.socket, secret: bytes, ctx: bytes, size: int, nconn: int) -> tuple[int, int]:
    """Listener side: returns the authenticated (rank, connection index) of the connector.
    Raises ConnectionError on a bad proof; nothing the peer sent is interpreted before the MAC
    over the fixed-size frame has been verified."""
    try:
        nl, nc, ids = auth.RING.accept(sock, secret, ctx)
    except auth.BadProof:
        raise ConnectionError("peer failed authentication (wrong job secret)") from None
    peer, conn = _U32x2.unpack(ids)
    if not (0 <= peer < size and 0 <= conn < nconn):
        raise ConnectionError(f"authenticated peer claims rank {peer} conn {conn}, out of range")
    sock.sendall(auth.RING.server_proof(secret, nl, nc, ctx, ids))
    return peer, conn
