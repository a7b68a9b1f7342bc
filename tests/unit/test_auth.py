"""bootstrap/auth: the job secret's life cycle and the one handshake, with wire bytes pinned."""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat
import threading

import pytest

from hpcring.bootstrap import auth
from hpcring.errors import BootstrapError

SECRET = b"ab" * 32


def H(*parts: bytes) -> bytes:
    return hmac.new(SECRET, b"".join(parts), hashlib.sha256).digest()


def test_secret_life_cycle(tmp_path):
    path = auth.new_job_secret(tmp_path)
    assert path.parent == tmp_path / ".secrets"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    text = path.read_text().strip()
    assert len(text) == 64 and int(text, 16) >= 0
    assert auth.load_secret({"HPCRING_SECRET_FILE": str(path)}) == text.encode()
    assert auth.load_secret({"HPCRING_SECRET": text}) == text.encode()
    assert auth.new_job_secret(tmp_path).read_text() != path.read_text()
    with pytest.raises(FileExistsError):
        auth.write_secret_file(path, exclusive=True)
    assert auth.delete_secret_file(path) and not path.exists()
    assert not auth.delete_secret_file(path)       # twice is fine
    with pytest.raises(BootstrapError, match="cannot read secret file"):
        auth.load_secret({"HPCRING_SECRET_FILE": str(path)})


def test_readable_secret_file_is_refused(tmp_path):
    path = auth.new_secret_file(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(BootstrapError, match="readable by group or others"):
        auth.load_secret({"HPCRING_SECRET_FILE": str(path)})


@pytest.mark.parametrize("hs,labels", [
    (auth.STORE, (b"hpcring-store-v1 client", b"hpcring-store-v1 server")),
    (auth.RING, (b"hpcring-ring-v1 connect", b"hpcring-ring-v1 accept")),
    (auth.PROBE, (b"hpcring-probe-v1 client", b"hpcring-probe-v1 server")),
])
def test_handshake_wire_bytes_are_the_protocols(hs, labels):
    """The proofs are exactly the HMACs each protocol has always sent (wire behaviour kept)."""
    ns, nc, bind = b"N" * 32, b"C" * 32, b"ctx-bytes"
    extra = b"\x00\x00\x00\x02\x00\x00\x00\x01" if hs.extra_len else b""
    assert hs.client_proof(SECRET, ns, nc, bind, extra) == H(labels[0], bind, ns, nc, extra)
    assert hs.server_proof(SECRET, ns, nc, bind, extra) == H(labels[1], bind, ns, nc, extra)


@pytest.mark.parametrize("their_secret,ok", [(SECRET, True), (b"other" * 8, False)])
def test_blocking_handshake_both_sides(their_secret, ok):
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    got = {}

    def listener():
        try:
            ns, nc, extra = auth.RING.accept(a, SECRET, b"ctx")
            got["extra"] = extra
            a.sendall(auth.RING.server_proof(SECRET, ns, nc, b"ctx", extra))
        except auth.BadProof:
            got["refused"] = True
            a.close()

    t = threading.Thread(target=listener)
    t.start()
    ns = auth.RING.read_hello(b)
    if ok:
        auth.RING.prove(b, their_secret, ns, b"ctx", b"12345678")
    else:
        with pytest.raises((auth.BadProof, ConnectionError, EOFError)):
            auth.RING.prove(b, their_secret, ns, b"ctx", b"12345678")
    t.join(5)
    assert got == ({"extra": b"12345678"} if ok else {"refused": True})
