"""A batched request's keys and items, checked and cut so that each request fits the store's
frame cap (almost always one batch); used by :class:`~hpcring.bootstrap.store_client.StoreClient`."""
from __future__ import annotations

from collections.abc import Mapping

from hpcring.bootstrap.store_wire import COUNT, KEYLEN, encode_items


def as_items(items) -> list[tuple[str, bytes]]:
    """``(key, value)`` pairs from a mapping or pairs; TypeError for a value that is not bytes."""
    items = list(items.items() if isinstance(items, Mapping) else items)
    for key, value in items:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"store values are bytes, not {type(value).__name__} (key {key!r})")
    return [(k, bytes(v)) for k, v in items]


def label(keys: list[str]) -> str:
    """How errors name a batch: its first key and how many more."""
    return keys[0] if len(keys) == 1 else f"{keys[0]} (and {len(keys) - 1} more)" if keys else "(none)"


def _budget(max_frame: int) -> int:
    return max_frame - 64   # room for the request header and the MGET's fixed fields


def key_batches(keys: list[str], max_frame: int) -> list[list[str]]:
    """``keys`` split so that each request fits the frame cap (almost always one batch)."""
    out, cur, size = [], [], COUNT.size
    for k in keys:
        n = KEYLEN.size + len(k.encode("utf-8"))
        if cur and size + n > _budget(max_frame):
            out.append(cur)
            cur, size = [], COUNT.size
        cur.append(k)
        size += n
    return out + [cur] if cur or not out else out


def item_batches(items: list[tuple[str, bytes]], max_frame: int) -> list[bytes]:
    """``items`` encoded as MSET arguments, split so that each request fits the frame cap."""
    out, cur, size = [], [], COUNT.size
    for k, v in items:
        n = KEYLEN.size + len(k.encode("utf-8")) + COUNT.size + len(v)
        if cur and size + n > _budget(max_frame):
            out.append(encode_items(cur))
            cur, size = [], COUNT.size
        cur.append((k, v))
        size += n
    return out + [encode_items(cur)] if cur or not out else out
