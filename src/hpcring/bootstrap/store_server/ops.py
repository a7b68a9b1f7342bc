"""The store's data and op handlers; a blocking GET/MGET on missing keys parks in a wait group."""
from __future__ import annotations

import logging
import struct
import time
from typing import TYPE_CHECKING

from hpcring.bootstrap.store_server.conn import _Conn
from hpcring.bootstrap.store_wire import (F64, I64, KEYLEN, MAX_GET_TIMEOUT, MGET_RANGE, MGET_VALUES, OP_ADD,
                                          OP_CHECK, OP_DELETE, OP_GET, OP_MCHECK, OP_MGET, OP_MSET, OP_PING,
                                          OP_SET, ST_ERROR, ST_MISSING, ST_OK, ST_TIMEOUT, ST_TOOBIG,
                                          decode_items, decode_key_range, decode_keys, encode_indices,
                                          encode_values)

if TYPE_CHECKING:
    from hpcring.bootstrap.store_server.loop import Loop

log = logging.getLogger("hpcring.bootstrap.store")


class _TooBig(ValueError):
    """A batched read's reply would pass the frame cap (answered ST_TOOBIG: ask for fewer keys)."""


class _Group:
    """Parked requests for one key list (a GET's key, or an MGET's flags and key list): they
    share the bookkeeping of which keys are still missing and the reply built once they exist."""

    __slots__ = ("gid", "keys", "missing", "members", "single", "values", "timeout_reply")

    def __init__(self, gid: bytes, keys: list[str], missing: set[str], single: bool, values: bool) -> None:
        self.gid, self.keys, self.missing = gid, keys, missing
        self.members: dict[_Conn, None] = {}
        self.single, self.values = single, values
        self.timeout_reply: tuple[int, bytes] | None = None   # (data version, payload) cache


class Ops:
    """The op table: the key-value data, one handler per op, and the wait groups of parked
    requests (one per key list: 8192 ranks reading the same N keys cost O(N) bookkeeping). Answers
    and deadlines go through ``loop``; bodies reach :meth:`handle` only once authenticated."""

    def __init__(self, loop: Loop, stats: dict[str, int], max_frame: int) -> None:
        self._loop = loop
        self.stats = stats
        self.max_frame = max_frame
        self._reply, self._schedule, self._runnable = loop.reply, loop.schedule, loop.runnable
        self.data: dict[str, bytes] = {}
        self._version = 0                               # bumped by every change of data
        self.groups: dict[bytes, _Group] = {}           # parked requests by key list
        self.waiters: dict[str, dict[_Group, None]] = {}   # missing key -> groups waiting for it
        self._reply_cache: dict[bytes, tuple[int, bytes]] = {}   # MGET key list -> (version, payload)

    # -- requests ---------------------------------------------------------------------------
    def handle(self, conn: _Conn, body: bytes) -> None:
        try:
            op = body[0]
            (klen,) = KEYLEN.unpack_from(body, 1)
            if 3 + klen > len(body):
                raise ValueError("key length runs past the frame")
            key = body[3:3 + klen].decode("utf-8")
            args = body[3 + klen:]
        except (IndexError, struct.error, ValueError) as e:
            self._reply(conn, ST_ERROR, f"malformed request: {e}".encode())
            return
        handler = self._HANDLERS.get(op)
        if handler is None:
            self.stats["bad_request"] += 1
            self._reply(conn, ST_ERROR, f"unknown op {op}".encode())
            return
        try:
            handler(self, conn, key, args)
        except _TooBig as e:   # a batched read of more than one frame: the client splits it
            self._reply(conn, ST_TOOBIG, str(e).encode())
        except (struct.error, ValueError, OverflowError) as e:
            self.stats["bad_request"] += 1
            self._reply(conn, ST_ERROR, f"bad arguments for op {op} on key {key!r}: {e}".encode())
        except Exception as e:   # a bug must cost this peer its connection, not every rank the store
            log.exception("store %s: op %d from %s failed", self._loop.address, op, conn.peer)
            self._loop.drop(conn, f"internal error on op {op}: {type(e).__name__}")

    def _store(self, key: str, value: bytes) -> None:
        self.data[key] = value
        self._version += 1

    def _op_set(self, conn: _Conn, key: str, value: bytes) -> None:
        self._store(key, value)
        # Waiters first: once the setter has its answer it may exit, and on rank 0 that ends the
        # server thread too; the waiters' replies must already be in their socket buffers by then.
        self._wake(key)
        self._reply(conn, ST_OK)

    def _op_mset(self, conn: _Conn, key: str, args: bytes) -> None:
        items = decode_items(args)
        for k, v in items:
            self._store(k, v)
        for k, _ in items:
            self._wake(k)   # before replying, as in _op_set
        self._reply(conn, ST_OK)

    @staticmethod
    def _timeout_arg(args: bytes, what: str) -> float:
        (timeout,) = F64.unpack_from(args, 0)
        if not (0.0 <= timeout <= MAX_GET_TIMEOUT):   # also false for NaN
            raise ValueError(f"{what} timeout {timeout!r} must be finite, >= 0 and <= {MAX_GET_TIMEOUT:g}s")
        return timeout

    def _op_get(self, conn: _Conn, key: str, args: bytes) -> None:
        if len(args) != F64.size:
            raise ValueError(f"GET takes an 8-byte timeout, not {len(args)} bytes")
        timeout = self._timeout_arg(args, "GET")
        if key in self.data:
            self._reply(conn, ST_OK, self.data[key])
            return
        if timeout <= 0:
            self._reply(conn, ST_TIMEOUT)
            return
        gid = b"G" + key.encode("utf-8")
        group = self.groups.get(gid) or self._new_group(gid, [key], {key}, single=True, values=True)
        self._park(conn, group, timeout)

    def _op_mget(self, conn: _Conn, key: str, args: bytes) -> None:
        if len(args) < F64.size + 1:
            raise ValueError("MGET takes a timeout, flags and a key list")
        timeout = self._timeout_arg(args, "MGET")
        gid = b"M" + args[F64.size:]   # flags + key list: requests for the same keys share a group
        group = self.groups.get(gid)
        if group is None:
            cached = self._reply_cache.get(gid)
            if cached is not None and cached[0] == self._version:
                self._reply(conn, ST_OK, cached[1])
                return
            keys = (decode_key_range if args[F64.size] & MGET_RANGE else decode_keys)(args, F64.size + 1)
            data = self.data
            missing = [i for i, k in enumerate(keys) if k not in data]
            if not missing:
                self._reply(conn, ST_OK, self._values_reply(gid, keys, bool(args[F64.size] & MGET_VALUES)))
            elif timeout <= 0:
                self._reply(conn, ST_TIMEOUT, encode_indices(missing))
            else:
                group = self._new_group(gid, keys, {keys[i] for i in missing}, single=False,
                                        values=bool(args[F64.size] & MGET_VALUES))
                self._park(conn, group, timeout)
        elif timeout <= 0:
            self._reply(conn, ST_TIMEOUT, self._missing_reply(group))
        else:
            self._park(conn, group, timeout)

    def _op_mcheck(self, conn: _Conn, key: str, args: bytes) -> None:
        data = self.data
        self._reply(conn, ST_OK, self._check_size(encode_values([data.get(k) for k in decode_keys(args)])))

    def _op_add(self, conn: _Conn, key: str, args: bytes) -> None:
        (n,) = I64.unpack(args)
        old = self.data.get(key, b"0")
        try:
            value = int(old) + n
        except ValueError:
            self._reply(conn, ST_ERROR, f"key {key!r} does not hold an integer".encode())
            return
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"counter {key!r} would overflow 64 bits")
        self._store(key, str(value).encode("ascii"))
        self._wake(key)   # before replying, as in _op_set
        self._reply(conn, ST_OK, I64.pack(value))

    def _op_check(self, conn: _Conn, key: str, args: bytes) -> None:
        if key in self.data:
            self._reply(conn, ST_OK, self.data[key])
        else:
            self._reply(conn, ST_MISSING)

    def _op_delete(self, conn: _Conn, key: str, args: bytes) -> None:
        existed = self.data.pop(key, None) is not None
        self._version += 1
        self._reply(conn, ST_OK if existed else ST_MISSING)

    def _op_ping(self, conn: _Conn, key: str, args: bytes) -> None:
        self._reply(conn, ST_OK, args)

    _HANDLERS = {OP_SET: _op_set, OP_GET: _op_get, OP_ADD: _op_add, OP_CHECK: _op_check,
                 OP_DELETE: _op_delete, OP_PING: _op_ping, OP_MSET: _op_mset, OP_MGET: _op_mget,
                 OP_MCHECK: _op_mcheck}

    # -- parked requests --------------------------------------------------------------------
    def _check_size(self, payload: bytes) -> bytes:
        if len(payload) + 1 > self.max_frame:
            raise _TooBig(f"the reply would be {len(payload)} bytes, over the frame cap of "
                             f"{self.max_frame}: read these keys in smaller batches")
        return payload

    def _values_reply(self, gid: bytes, keys: list[str], values: bool) -> bytes:
        """An MGET's OK payload (every key exists), cached until the data changes."""
        if not values:
            return b""
        data = self.data
        payload = self._check_size(encode_values([data[k] for k in keys]))
        cache = self._reply_cache
        if len(cache) >= 64 or sum(len(p) for _, p in cache.values()) + len(payload) > 64 << 20:
            cache.clear()   # a few recent key lists (the job's all-gathers), at most 64 MiB
        cache[gid] = (self._version, payload)
        return payload

    def _missing_reply(self, group: _Group) -> bytes:
        """An MGET's TIMEOUT payload: the indices of the keys still missing (cached per version)."""
        if group.timeout_reply is None or group.timeout_reply[0] != self._version:
            data = self.data
            group.timeout_reply = (self._version,
                                   encode_indices([i for i, k in enumerate(group.keys) if k not in data]))
        return group.timeout_reply[1]

    def _new_group(self, gid: bytes, keys: list[str], missing: set[str], *, single: bool, values: bool) -> _Group:
        group = _Group(gid, keys, missing, single, values)
        self.groups[gid] = group
        for k in missing:
            self.waiters.setdefault(k, {})[group] = None
        return group

    def _park(self, conn: _Conn, group: _Group, timeout: float) -> None:
        conn.pending = group
        conn.wait_deadline = time.monotonic() + timeout
        group.members[conn] = None
        self.stats["parked"] += 1
        self._schedule(conn.wait_deadline, conn)

    def leave(self, conn: _Conn) -> None:
        """Take ``conn`` out of its wait group (deadline reached, or dropped)."""
        group, conn.pending = conn.pending, None
        group.members.pop(conn, None)
        if not group.members:
            self._forget(group)

    def time_out(self, conn: _Conn) -> None:
        """``conn``'s parked request reached its deadline: out of its group, answered ST_TIMEOUT."""
        group = conn.pending
        self.leave(conn)
        if group.single:
            self._reply(conn, ST_TIMEOUT)
        else:
            self._reply(conn, ST_TIMEOUT, self._missing_reply(group))

    def _forget(self, group: _Group) -> None:
        """A group nobody waits for any more: unhook it from its missing keys."""
        if self.groups.get(group.gid) is group:
            del self.groups[group.gid]
        for k in group.missing:
            waiting = self.waiters.get(k)
            if waiting is not None:
                waiting.pop(group, None)
                if not waiting:
                    del self.waiters[k]

    def _wake(self, key: str) -> None:
        groups = self.waiters.pop(key, None)
        if not groups:
            return
        for group in groups:
            group.missing.discard(key)
            if not group.missing:
                self._complete(group)

    def _complete(self, group: _Group) -> None:
        """Every key of ``group`` arrived: answer all its members with one payload."""
        data = self.data
        again = {k for k in group.keys if k not in data}   # deleted after it arrived
        if again:
            group.missing = again
            for k in again:
                self.waiters.setdefault(k, {})[group] = None
            return
        if self.groups.get(group.gid) is group:
            del self.groups[group.gid]
        try:
            if group.single:
                status, payload = ST_OK, data[group.keys[0]]
            else:
                status, payload = ST_OK, self._values_reply(group.gid, group.keys, group.values)
        except _TooBig as e:
            status, payload = ST_TOOBIG, str(e).encode()
        members, group.members = group.members, {}
        for conn in members:
            if conn.closed or conn.pending is not group:
                continue
            conn.pending = None
            self._reply(conn, status, payload)
            self._runnable.append(conn)
