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
* batched operations (key field empty): ``MSET`` args are an item list ``u32 n | n x (u16 klen |
  key | u32 vlen | value)``; ``MGET`` args are ``f64 timeout | u8 flags | key list`` with a key list
  ``u32 n | n x (u16 klen | key)``, answered once every key exists (``ST_OK`` + a value list
  ``u32 n | n x u32 length | the values, concatenated``; no values unless ``flags & MGET_VALUES``)
  or at the deadline (``ST_TIMEOUT`` + ``u32 m | m x u32 index`` of the keys still missing);
  ``MCHECK`` args are a key list, answered at once with a value list in which an absent key has the
  length ``ABSENT``. With ``flags & MGET_RANGE`` an MGET's key list is a *key range* ``u16 plen |
  prefix | u32 start | u32 n``, standing for ``prefix + str(i)`` for i in start..start+n-1 (what
  "every rank's key" is: the request stays a few bytes however large the job). A client may send several frames before reading the replies (pipelining);
  the server answers them in order, so "publish mine, read everyone's" is one round trip. A
  batched read whose reply would pass the frame cap is answered ``ST_TOOBIG``; the client then
  asks for the keys in halves.

Because every connection has fresh nonces and numbered frames, a frame captured on one
connection is worthless on another (and cannot be replayed or reordered within one). No pickle:
values are opaque bytes, counters are ASCII decimals.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from collections.abc import Iterable

from hpcring.bootstrap import auth
from hpcring.errors import BootstrapError

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
OP_MSET, OP_MGET, OP_MCHECK = 7, 8, 9
MGET_VALUES = 1                        # MGET flag: reply with the values (else only "all exist")
MGET_RANGE = 2                         # MGET flag: the keys are given as a key range
MAX_RANGE = 1 << 20                    # the most keys one key range may stand for
ABSENT = 0xFFFFFFFF                    # a value list's length for a key that does not exist
COUNT = struct.Struct(">I")
ST_OK, ST_TIMEOUT, ST_ERROR, ST_MISSING, ST_TOOBIG = 0, 1, 2, 3, 4   # TOOBIG: the reply would pass the frame cap

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
    h = hmac.new(session_key, direction + SEQ.pack(seq), hashlib.sha256)
    h.update(body)   # no copy of a large body (a batched read's reply is the whole job's values)
    return h.digest()


def encode_frame(session_key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    return HEADER.pack(len(body)) + frame_mac(session_key, direction, seq, body) + body


def encode_request(op: int, key: str, args: bytes = b"") -> bytes:
    kb = _key_bytes(key)
    return bytes([op]) + KEYLEN.pack(len(kb)) + kb + args


def _key_bytes(key: str) -> bytes:
    kb = key.encode("utf-8")
    if len(kb) > 0xFFFF:
        raise BootstrapError(f"store key too long ({len(kb)} bytes): {key[:60]!r}...")
    return kb


def encode_keys(keys: list[str]) -> bytes:
    """A key list: ``u32 n | n x (u16 klen | key)``."""
    parts = [COUNT.pack(len(keys))]
    for key in keys:
        kb = _key_bytes(key)
        parts += (KEYLEN.pack(len(kb)), kb)
    return b"".join(parts)


def decode_keys(buf, offset: int = 0) -> list[str]:
    """The keys of a key list that fills ``buf[offset:]`` exactly; ValueError if malformed."""
    mv = memoryview(buf)
    (n,) = COUNT.unpack_from(mv, offset)
    pos, end = offset + COUNT.size, len(mv)
    if n > (end - pos) // KEYLEN.size:
        raise ValueError(f"key list claims {n} keys in {end - pos} bytes")
    keys = []
    for _ in range(n):
        (klen,) = KEYLEN.unpack_from(mv, pos)
        pos += KEYLEN.size
        if pos + klen > end:
            raise ValueError("key length runs past the frame")
        keys.append(str(mv[pos:pos + klen], "utf-8"))
        pos += klen
    if pos != end:
        raise ValueError(f"{end - pos} bytes after the key list")
    return keys


def key_range(keys: list[str]) -> tuple[str, int] | None:
    """``(prefix, start)`` when ``keys`` are ``prefix + str(start + i)`` in order (and more than
    a handful), else None: such a list travels as a key range."""
    if len(keys) < 8 or len(keys) > MAX_RANGE:
        return None
    m = re.fullmatch(r"(.*?)([1-9][0-9]*|0)", keys[0], re.S)
    if m is None:
        return None
    prefix, start = m.group(1), int(m.group(2))
    if len(prefix.encode("utf-8")) > 0xFFFF or start + len(keys) > 0xFFFFFFFF:
        return None
    for i, key in enumerate(keys):
        if key != f"{prefix}{start + i}":
            return None
    return prefix, start


def encode_key_range(prefix: str, start: int, n: int) -> bytes:
    kb = _key_bytes(prefix)
    return KEYLEN.pack(len(kb)) + kb + COUNT.pack(start) + COUNT.pack(n)


def decode_key_range(buf, offset: int = 0) -> list[str]:
    """The keys a key range (filling ``buf[offset:]`` exactly) stands for; ValueError if malformed."""
    mv = memoryview(buf)
    (plen,) = KEYLEN.unpack_from(mv, offset)
    pos = offset + KEYLEN.size
    if pos + plen + 2 * COUNT.size != len(mv):
        raise ValueError("malformed key range")
    prefix = str(mv[pos:pos + plen], "utf-8")
    (start,) = COUNT.unpack_from(mv, pos + plen)
    (n,) = COUNT.unpack_from(mv, pos + plen + COUNT.size)
    if n > MAX_RANGE:
        raise ValueError(f"a key range may stand for at most {MAX_RANGE} keys, not {n}")
    return [f"{prefix}{i}" for i in range(start, start + n)]


def encode_items(items: list[tuple[str, bytes]]) -> bytes:
    """An item list: ``u32 n | n x (u16 klen | key | u32 vlen | value)``."""
    parts = [COUNT.pack(len(items))]
    for key, value in items:
        kb = _key_bytes(key)
        parts += (KEYLEN.pack(len(kb)), kb, COUNT.pack(len(value)), value)
    return b"".join(parts)


def decode_items(buf) -> list[tuple[str, bytes]]:
    """The (key, value) pairs of an item list that fills ``buf`` exactly; ValueError if malformed."""
    mv = memoryview(buf)
    (n,) = COUNT.unpack_from(mv, 0)
    pos, end = COUNT.size, len(mv)
    if n > (end - pos) // (KEYLEN.size + COUNT.size):
        raise ValueError(f"item list claims {n} items in {end - pos} bytes")
    items = []
    for _ in range(n):
        (klen,) = KEYLEN.unpack_from(mv, pos)
        pos += KEYLEN.size
        key = str(mv[pos:pos + klen], "utf-8")
        pos += klen
        (vlen,) = COUNT.unpack_from(mv, pos)
        pos += COUNT.size
        if pos + vlen > end:
            raise ValueError("value length runs past the frame")
        items.append((key, bytes(mv[pos:pos + vlen])))
        pos += vlen
    if pos != end:
        raise ValueError(f"{end - pos} bytes after the item list")
    return items


def encode_values(values: list[bytes | None]) -> bytes:
    """A value list: ``u32 n | n x u32 length (ABSENT for None) | the values, concatenated``."""
    lens = [ABSENT if v is None else len(v) for v in values]
    return b"".join([struct.pack(f">I{len(lens)}I", len(lens), *lens), *(v for v in values if v)])


def decode_values(buf) -> list[bytes | None]:
    """The values of a value list (None for an absent key); ValueError if malformed."""
    try:
        (n,) = COUNT.unpack_from(buf, 0)
        if n > (len(buf) - COUNT.size) // COUNT.size:
            raise ValueError(f"value list claims {n} values in {len(buf)} bytes")
        lens = struct.unpack_from(f">{n}I", buf, COUNT.size)
    except struct.error as e:
        raise ValueError(f"malformed value list: {e}") from None
    pos, out = COUNT.size * (n + 1), []
    for length in lens:
        if length == ABSENT:
            out.append(None)
        else:
            out.append(buf[pos:pos + length])
            pos += length
    if pos != len(buf):
        raise ValueError(f"value list lengths add up to {pos} bytes, the frame has {len(buf)}")
    return out


def encode_indices(indices: list[int]) -> bytes:
    return struct.pack(f">I{len(indices)}I", len(indices), *indices)


def decode_indices(buf) -> list[int]:
    (n,) = COUNT.unpack_from(buf, 0)
    if len(buf) != COUNT.size * (n + 1):
        raise ValueError(f"index list of {n} in {len(buf)} bytes")
    return list(struct.unpack_from(f">{n}I", buf, COUNT.size))


def session_key(secret: bytes, ns: bytes, nc: bytes) -> bytes:
    return _mac(secret, auth.STORE_SESSION_LABEL, ns, nc)

