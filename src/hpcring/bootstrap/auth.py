"""The per-job secret and the one HMAC challenge-response every hpcring listener uses.

Secret: 32 random bytes as 64 hex characters, in a file of mode 0600 (``HPCRING_SECRET_FILE``) or,
for a process alone, in ``HPCRING_SECRET``. Both forms give the same key: the stripped hex text as
bytes. :func:`new_secret` makes one, :func:`write_secret_file` stores it, :func:`load_secret` reads
it back (refusing a file others may read) and :func:`delete_secret_file` removes it.

Handshake (the store, the ring's peer links, the interface probes and the watchdog's trigger
fan-out, each with its own labels and magic so a proof made for one can never be replayed on
another)::

    listener -> connector   magic + Ns                        (Ns: 32 random bytes)
    connector -> listener   Nc + MAC(client label, bind, Ns, Nc, extra) + extra
    listener -> connector   MAC(server label, bind, Ns, Nc, extra)

``MAC = HMAC-SHA256(secret, concatenation)``. ``bind`` is context both sides know already (the
ring binds the communicator's context); ``extra`` is a fixed-size field the connector sends and
the MAC covers (the ring's rank and connection index). The listener verifies the MAC over the
fixed-size frame before it interprets a single byte of it. The steps are separate functions so a
blocking caller (ring, probes, store client) and a non-blocking one (store server) share them,
and each keeps its own error messages.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact

NONCE_LEN = 32
MAC_LEN = 32
SECRET_BYTES = 32


# ------------------------------------------------------------------------------------- secret

def new_secret() -> str:
    """A fresh secret as hex text (what files and HPCRING_SECRET hold)."""
    return secrets.token_hex(SECRET_BYTES)


def write_secret_file(path: str | os.PathLike, *, exclusive: bool = False) -> Path:
    """Write a fresh secret to ``path`` with mode 0600 (parents created) and return the path.

    ``exclusive``: fail if the file exists (fresh per-job names); otherwise it is overwritten.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)   # the umask or a pre-existing file may have left wider bits
        os.write(fd, (new_secret() + "\n").encode("ascii"))
    finally:
        os.close(fd)
    return path


def new_secret_file(folder: str | os.PathLike) -> Path:
    """Write a fresh secret to ``<folder>/.secret`` (mode 0600) and return its path."""
    return write_secret_file(Path(folder) / ".secret")


def new_job_secret(root: str | os.PathLike) -> Path:
    """A fresh secret under ``<root>/.secrets/<random>.key`` (folder mode 0700); never on a command line."""
    d = Path(root) / ".secrets"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    return write_secret_file(d / f"{secrets.token_hex(8)}.key", exclusive=True)


def delete_secret_file(path: str | os.PathLike | None) -> bool:
    """Remove a secret file; True if it existed. Missing files are fine (cleanup may run twice)."""
    if not path:
        return False
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def load_secret(environ: Mapping[str, str] | None = None) -> bytes:
    """The per-job secret from HPCRING_SECRET_FILE (preferred) or HPCRING_SECRET.

    A secret file that group or others may read is refused: anyone who can read it can join the
    job's rendezvous.
    """
    env = os.environ if environ is None else environ
    path = env.get("HPCRING_SECRET_FILE")
    if path:
        return _read_secret_file(Path(path))
    text = env.get("HPCRING_SECRET", "").strip()
    if text:
        try:
            return text.encode("ascii", "strict")
        except UnicodeEncodeError:
            raise BootstrapError("HPCRING_SECRET is not ASCII text",
                                 hint="use the hex text hpcring writes (hpcring.bootstrap.auth.new_secret())") from None
    raise BootstrapError(
        "no per-job secret: neither HPCRING_SECRET_FILE nor HPCRING_SECRET is set",
        hint="jobs submitted by hpcring get HPCRING_SECRET_FILE=<job_dir>/.secrets/<id>.key; "
             "when launching by hand, create one with hpcring.bootstrap.auth.new_secret_file(folder)")


def _missing_hint(path: Path) -> str:
    """Why a job's secret file is missing, told from what is still there."""
    if path.parent.is_dir():
        # The folder is visible here, so it is shared: the file itself was removed. hpcring removes
        # it only once the scheduler reports the job over (status, --wait, cancel, the local
        # backend's end), so this run outlived its job or was started again by hand.
        return (f"the job's folder {path.parent} is here but its secret is gone: hpcring deletes it "
                "when the job has ended (as the scheduler reports it); a run started after that, or "
                "by hand, needs a new job (`hpcring submit`) or HPCRING_SECRET_FILE pointing at a "
                "live secret")
    return (f"the folder {path.parent} does not exist on this host: the job folder must be on a "
            "file system every node can read (set HPCRING_JOB_DIR or the site's job_dir to one)")


def _read_secret_file(path: Path) -> bytes:
    try:
        st = path.stat()
    except OSError as e:
        raise BootstrapError(f"cannot read secret file {path} (HPCRING_SECRET_FILE): {e.strerror}",
                             hint=_missing_hint(path)) from e
    if st.st_mode & 0o077:
        raise BootstrapError(
            f"secret file {path} is readable by group or others (mode {stat.filemode(st.st_mode)}); "
            "refusing to use it",
            hint=f"chmod 600 {path}  (anyone who can read it can join this job's rendezvous)")
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise BootstrapError(f"cannot read secret file {path} (HPCRING_SECRET_FILE): {e}",
                             hint="recreate it with new_secret_file()") from e
    if not text:
        raise BootstrapError(f"secret file {path} is empty", hint="recreate it with new_secret_file()")
    return text.encode("ascii")


# ------------------------------------------------------------------------------------- handshake

class NotAPeer(ConnectionError):
    """The listener's greeting does not start with the expected magic."""


class BadProof(ConnectionError):
    """A MAC did not match this job's secret (the other side holds another secret, or forged it)."""


def mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


@dataclass(frozen=True)
class Handshake:
    """One protocol's parameters; see the module docstring for the exchange."""

    magic: bytes
    client_label: bytes
    server_label: bytes
    extra_len: int = 0

    @property
    def hello_len(self) -> int:
        return len(self.magic) + NONCE_LEN

    @property
    def proof_len(self) -> int:
        """Bytes the connector sends after the hello: Nc, its MAC, the extra field."""
        return NONCE_LEN + MAC_LEN + self.extra_len

    def client_proof(self, secret: bytes, ns: bytes, nc: bytes, bind: bytes = b"", extra: bytes = b"") -> bytes:
        return mac(secret, self.client_label, bind, ns, nc, extra)

    def server_proof(self, secret: bytes, ns: bytes, nc: bytes, bind: bytes = b"", extra: bytes = b"") -> bytes:
        return mac(secret, self.server_label, bind, ns, nc, extra)

    # -- listener ----------------------------------------------------------------------------
    def hello(self) -> tuple[bytes, bytes]:
        """(Ns, the greeting to send)."""
        ns = secrets.token_bytes(NONCE_LEN)
        return ns, self.magic + ns

    def check(self, secret: bytes, ns: bytes, frame: bytes, bind: bytes = b"") -> tuple[bytes, bytes]:
        """Verify the connector's ``proof_len``-byte frame; (Nc, extra) or BadProof."""
        nc, proof = frame[:NONCE_LEN], frame[NONCE_LEN:NONCE_LEN + MAC_LEN]
        extra = frame[NONCE_LEN + MAC_LEN:self.proof_len]
        if len(frame) != self.proof_len or not hmac.compare_digest(
                proof, self.client_proof(secret, ns, nc, bind, extra)):
            raise BadProof("handshake MAC does not match this job's secret")
        return nc, extra

    def accept(self, sock, secret: bytes, bind: bytes = b"") -> tuple[bytes, bytes, bytes]:
        """Blocking listener side up to (not including) the answer: greet, read and check the
        frame. Returns (Ns, Nc, extra); send :meth:`server_proof` once ``extra`` is acceptable."""
        ns, greeting = self.hello()
        sock.sendall(greeting)
        nc, extra = self.check(secret, ns, recv_exact(sock, self.proof_len), bind)
        return ns, nc, extra

    # -- connector ---------------------------------------------------------------------------
    def read_hello(self, sock) -> bytes:
        """Ns from the listener's greeting; NotAPeer if the magic is wrong (EOF/OSError propagate)."""
        hello = recv_exact(sock, self.hello_len)
        if hello[:len(self.magic)] != self.magic:
            raise NotAPeer("bad magic in the greeting")
        return hello[len(self.magic):]

    def prove(self, sock, secret: bytes, ns: bytes, bind: bytes = b"", extra: bytes = b"") -> bytes:
        """Send our proof, read and check the listener's; returns Nc. BadProof on a wrong answer;
        EOF/OSError while reading the answer propagate (the listener refused us or went away)."""
        if len(extra) != self.extra_len:
            raise ValueError(f"extra field must be {self.extra_len} bytes")
        nc = secrets.token_bytes(NONCE_LEN)
        sock.sendall(nc + self.client_proof(secret, ns, nc, bind, extra) + extra)
        answer = recv_exact(sock, MAC_LEN)
        if not hmac.compare_digest(answer, self.server_proof(secret, ns, nc, bind, extra)):
            raise BadProof("the listener could not prove it knows the job secret")
        return nc


STORE = Handshake(b"HRS1", b"hpcring-store-v1 client", b"hpcring-store-v1 server")
STORE_SESSION_LABEL = b"hpcring-store-v1 session"
RING = Handshake(b"HRR1", b"hpcring-ring-v1 connect", b"hpcring-ring-v1 accept", extra_len=8)
PROBE = Handshake(b"", b"hpcring-probe-v1 client", b"hpcring-probe-v1 server")
# the watchdog's trigger fan-out (hpcring.diagnostics.watchdog.wire): extra = body length + its SHA-256
DIAG = Handshake(b"HRD1", b"hpcring-diag-v1 trigger", b"hpcring-diag-v1 listener", extra_len=36)
