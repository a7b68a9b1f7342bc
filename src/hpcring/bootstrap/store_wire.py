"""The rendezvous store's wire format: handshake, frames, requests, replies.

Wire protocol (version 1, all integers big-endian):

* hello (server -> client): ``b"HRS1" + Ns`` (32 random bytes).
* client proof: ``Nc (32 bytes) + HMAC(secret, "hpcring-store-v1 client" + Ns + Nc)``.
* server proof: ``HMAC(secret, "hpcring-store-v1 server" + Ns + Nc)``; both sides then use the
  session key ``K = HMAC(secret, "hpcring-store-v1 session" + Ns + Nc)``.
* frame: ``u32 body length | 32-byte MAC | body`` with
  ``MAC = HMAC(K, direction byte + u64 sequence number + body)``; the server checks the length cap
  and the MAC before it looks at a single byte of the body.
* request body: ``u8 op | u16 key length | key (UTF-8) | op arguments``;
  reply body: ``u8 status | payload``.

Because every connection has fresh nonces and numbered frames, a frame captured on one
connection is worthless on another (and cannot be replayed or reordered within one). No pickle:
values are opaque bytes, counters are ASCII decimals.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterable

from hpcring.bootstrap import auth
from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact  # noqa: F401  (tests forge frames through it)

MAGIC = auth.STORE.magic
NONCE_LEN = auth.NONCE_LEN
MAC_LEN = auth.MAC_LEN
HEADER = struct.Struct(">I")
SEQ = struct.Struct(">Q")
KEYLEN = struct.Struct(">H")
F64 = struct.Struct(">d")
I64 = struct.Struct(">q")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024   # store values are addresses and small blobs, not tensors
HANDSHAKE_TIMEOUT = 10.0               # an unauthenticated peer may not hold a slot longer
FRAME_TIMEOUT = 10.0                   # a started frame must be complete within this (slowloris)
MAX_GET_TIMEOUT = 7 * 24 * 3600.0      # a blocked GET's deadline: finite, at most a week
ACCEPT_BACKOFF = (0.05, 1.0)           # pause accepting after EMFILE & co.: first, longest (s)
FD_RESERVE = 32                        # descriptors left for the rest of rank 0 (logs, ring, ...)

OP_SET, OP_GET, OP_ADD, OP_CHECK, OP_DELETE, OP_PING = 1, 2, 3, 4, 5, 6
ST_OK, ST_TIMEOUT, ST_ERROR, ST_MISSING = 0, 1, 2, 3

_DIR_TO_SERVER = b"C"
_DIR_TO_CLIENT = b"S"

SECRET_HINT = ("every rank must read the same per-job secret (HPCRING_SECRET_FILE or HPCRING_SECRET); "
               "check that all ranks belong to the same job and that nothing else uses this port")


class StoreAuthError(BootstrapError):
    """The peer at the store address did not prove knowledge of this job's secret."""


class StoreTimeoutError(BootstrapError):
    """A blocking store call reached its deadline. ``missing``: the keys still absent then (for
    :meth:`StoreClient.gather`: every missing key, in the order asked; for ``get``: that key)."""

    def __init__(self, message: str, *, hint: str | None = None, missing: Iterable[str] = ()) -> None:
        super().__init__(message, hint=hint)
        self.missing = list(missing)


def json_value(obj) -> bytes:
    """``obj`` as a store value: compact JSON (values are parsed by other ranks, never unpickled)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def from_json(data: bytes):
    """The object a :func:`json_value` holds."""
    return json.loads(data.decode())


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def frame_mac(session_key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    """MAC of one frame; exposed so tests can forge frames byte by byte."""
    return _mac(session_key, direction, SEQ.pack(seq), body)


def encode_frame(session_key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    return HEADER.pack(len(body)) + frame_mac(session_key, direction, seq, body) + body


def encode_request(op: int, key: str, args: bytes = b"") -> bytes:
    kb = key.encode("utf-8")
    if len(kb) > 0xFFFF:
        raise BootstrapError(f"store key too long ({len(kb)} bytes): {key[:60]!r}...")
    return bytes([op]) + KEYLEN.pack(len(kb)) + kb + args


def session_key(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return _mac(secret, auth.STORE_SESSION_LABEL, ns, nc)


def client_proof(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return auth.STORE.client_proof(secret, ns, nc)


def server_proof(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return auth.STORE.server_proof(secret, ns, nc)
