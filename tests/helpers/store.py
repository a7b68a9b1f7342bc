"""The store's test tools: a client of a test server, a hand-made handshake to forge frames with."""
from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from hpcring.bootstrap import auth
from hpcring.bootstrap import store_wire as st
from hpcring.bootstrap.store_client import StoreClient
from hpcring.netio import recv_exact

SECRET = b"0123456789abcdef" * 4
SRC = str(Path(__file__).resolve().parents[2] / "src")


def client(srv, secret=SECRET, timeout=5.0):
    return StoreClient("127.0.0.1", srv.port, secret, timeout=timeout)


def raw_session(srv, secret=SECRET):
    """Do the handshake by hand; returns (socket, session key) so tests can forge frames."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    hello = recv_exact(s, 4 + 32)
    assert hello[:4] == st.MAGIC
    ns, nc = hello[4:], secrets.token_bytes(32)
    s.sendall(nc + auth.STORE.client_proof(secret, ns, nc))
    assert recv_exact(s, 32) == auth.STORE.server_proof(secret, ns, nc)
    return s, st.session_key(secret, ns, nc)


def is_closed_by_server(s, within=3.0) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except (TimeoutError, socket.timeout):
        return False


def wait_for(pred, timeout=3.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()
