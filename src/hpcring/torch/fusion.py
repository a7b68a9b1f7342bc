"""Tensor Fusion: ready allreduces (and broadcasts) with the same fusion key (kind, dtype,
device, op, scale factors, root) are packed into one buffer up to the fusion threshold, run as
one collective and unpacked. The plan is computed from negotiated values only (fusion keys,
element counts and dtypes, in the negotiated order), so every rank cuts the same chunks, a
joined rank's zero stand-ins included."""
from __future__ import annotations

import contextlib
import time

import torch

from hpcring.torch import executor
from hpcring.torch.entry import FUSABLE


def plan(ready: list, threshold: int) -> list[list]:
    """``ready`` in execution order: lists of entries, each one collective (fused when > 1)."""
    groups: dict[object, list] = {}
    order: list[object] = []
    for e in ready:
        key = e.fuse_hash if e.kind in FUSABLE else ("single", id(e))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(e)
    out: list[list] = []
    for key in order:
        members = groups[key]
        if members[0].kind not in FUSABLE:
            out.append(members)
            continue
        chunk: list = []
        nbytes = 0
        for e in members:
            if chunk and nbytes + e.nbytes > threshold:
                out.append(chunk)
                chunk, nbytes = [], 0
            chunk.append(e)
            nbytes += e.nbytes
        if chunk:
            out.append(chunk)
    return out


class FusionBuffers:
    """One persistent buffer per (dtype, device), grown on demand."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, dtype, device, n: int) -> torch.Tensor:
        key = (dtype, device)
        b = self._buffers.get(key)
        if b is None or b.numel() < n:
            b = torch.empty(max(n, 1), dtype=dtype, device=device)
            self._buffers[key] = b
        return b[:n]


def stream_context(chunk: list):
    """The first entry's CUDA stream (waiting on the others'), or nothing on the host."""
    stream = chunk[0].stream
    if stream is None:
        return contextlib.nullcontext()
    for e in chunk[1:]:
        if e.stream is not None and e.stream != stream:
            stream.wait_stream(e.stream)
    return torch.cuda.stream(stream)


def run_fused(comm, chunk: list, buffers: FusionBuffers, timeout: float) -> tuple[float, float, float, float]:
    """Pack, run one collective, unpack; returns the phase times (t0, t1, t2, t3)."""
    first = chunk[0]
    total = sum(e.numel for e in chunk)
    t0 = time.time()
    if len(chunk) == 1:
        buf = first.output.view(-1)
        if first.output is not first.tensor:
            buf.copy_(first.tensor.reshape(-1))
    else:
        buf = buffers.get(first.tensor.dtype, first.tensor.device, total)
        torch.cat([e.tensor.reshape(-1) for e in chunk], out=buf)
    t1 = time.time()
    if first.kind == "allreduce":
        executor.reduce_(comm, buf, first.op, first.pre, first.post, timeout)
    else:
        executor.broadcast_(comm, buf, first.root, timeout)
    t2 = time.time()
    if len(chunk) > 1:
        pos = 0
        for e in chunk:
            e.output.view(-1).copy_(buf[pos:pos + e.numel])
            pos += e.numel
    return t0, t1, t2, time.time()
