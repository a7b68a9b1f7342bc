"""What runs on the engine thread once an operation is ready on every rank: the collectives on
an hpcring Communicator, for every torch dtype, with Horovod's arithmetic.

* dtypes: the communicator reduces float16/bfloat16/float32/float64/int32/int64/uint8; other
  dtypes travel as a wider one for reductions (int8, int16, bool, uint16/32: int64, wrapped back
  on the cast as an int8 sum wraps in Horovod; float8: float32; complex: its real view, sum only)
  and as raw bytes for the data-moving collectives (allgather, broadcast, alltoall).
* scaling, as Horovod's ScaleBuffer: floating tensors are multiplied; integer tensors are
  computed in double and truncated toward zero (C's cast): ``int(7 * 0.5) == 3``,
  ``int(-7 * 0.5) == -3``. Average is a postscale of 1/size (Horovod since 0.21), so an integer
  average truncates too: ``-75 / 2 -> -37``.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcring.collectives.backends import chunk_counts
from hpcring.collectives.dtypes import torch_dtypes
from hpcring.torch.exceptions import InvalidArgumentError

WIRE = torch_dtypes(torch)      # what the communicator reduces
_WIDE = {torch.int8: torch.int64, torch.int16: torch.int64, torch.bool: torch.int64}
for _n in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _n):
        _WIDE[getattr(torch, _n)] = torch.int64
for _n in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _n):
        _WIDE[getattr(torch, _n)] = torch.float32


def check_reducible(t: torch.Tensor, op: str, what: str) -> None:
    """Refuse at submission what no rank could reduce (every rank refuses alike)."""
    if t.is_complex():
        if op != "sum":
            raise InvalidArgumentError(f"{what}: complex tensors reduce with Sum or Average only, not {op}")
        return
    if t.dtype not in WIRE and t.dtype not in _WIDE:
        raise InvalidArgumentError(f"{what}: dtype {t.dtype} cannot be reduced")


def to_wire(buf: torch.Tensor) -> torch.Tensor:
    """A tensor the communicator reduces that stands for ``buf`` (``buf`` itself when it can)."""
    if buf.dtype in WIRE:
        return buf
    if buf.is_complex():
        return torch.view_as_real(buf)
    return buf.to(_WIDE[buf.dtype])


def from_wire(wire: torch.Tensor, buf: torch.Tensor) -> None:
    if wire is buf:
        return
    if buf.is_complex():
        return                                    # a view: reduced in place
    if buf.dtype == torch.bool:
        buf.copy_(wire != 0)
    else:
        buf.copy_(wire)                           # a C cast: an int8 sum wraps as in Horovod


def scale_(t: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's ScaleBuffer, in place: floats multiplied, integers truncated toward zero.

    A float factor of exactly 1/k (an Average's 1/size) divides by k instead: x / k is correctly
    rounded, where Horovod's x * fl(1/k) can be an ulp off (so its own 3-rank join test, which
    expects ``t * 2 / 3``, fails on Horovod's CPU path and passes here)."""
    if factor == 1.0:
        return t
    if t.is_floating_point() or t.is_complex():
        k = round(1.0 / factor) if factor > 0 else 0
        if k > 1 and 1.0 / k == factor:
            t.div_(k)
        else:
            t.mul_(factor)
    elif t.dtype == torch.bool:
        t.copy_(t.double().mul_(factor).trunc_() != 0)
    else:
        t.copy_(t.double().mul_(factor).trunc_())
    return t


def reduce_(comm, buf: torch.Tensor, op: str, pre: float, post: float, timeout: float) -> None:
    """``buf`` (1-D, contiguous) reduced over ``comm`` in place, with the scale factors."""
    scale_(buf, pre)
    wire = to_wire(buf)
    comm.allreduce(wire, op=op, out=wire, timeout=timeout)
    from_wire(wire, buf)
    scale_(buf, post)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as uint8, shape (rows, bytes per row); a view where possible."""
    rows = t.shape[0] if t.dim() else 1
    per = (t.numel() // rows if rows else int(np.prod(t.shape[1:], dtype=np.int64))) * t.element_size()
    flat = t.reshape(-1)
    b = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    return b.reshape(rows, per)


def from_bytes(b: torch.Tensor, dtype, tail) -> torch.Tensor:
    b = b.contiguous().reshape(-1)
    out = b.view(dtype) if b.numel() else torch.empty(0, dtype=dtype, device=b.device)
    return out.reshape(-1, *tail)


def broadcast_(comm, buf: torch.Tensor, root: int, timeout: float) -> None:
    wire = buf if buf.dtype in WIRE else buf.reshape(-1).view(torch.uint8)
    comm.broadcast(wire, root=root, timeout=timeout)


def allgather(comm, t: torch.Tensor, timeout: float) -> torch.Tensor:
    """All ranks' ``t`` concatenated along the first dimension (which may differ by rank)."""
    tail = tuple(t.shape[1:])
    b = as_bytes(t)
    rows = comm.allgather(np.array([b.shape[0]], dtype=np.int64), timeout=timeout).reshape(-1).tolist()
    most = max(rows)
    if most == 0 or b.shape[1] == 0:
        return torch.empty((sum(rows), *tail), dtype=t.dtype, device=t.device)
    padded = b if b.shape[0] == most else torch.cat([b, b.new_zeros((most - b.shape[0], b.shape[1]))])
    g = comm.allgather(padded.contiguous(), timeout=timeout)
    out = torch.cat([g[r, :rows[r]] for r in range(comm.size)])
    return from_bytes(out, t.dtype, tail)


def alltoall(comm, t: torch.Tensor, splits: list[int], timeout: float):
    """Rows ``splits[j]`` to rank j; returns (received rows in rank order, received splits)."""
    size, me = comm.size, comm.rank
    tail = tuple(t.shape[1:])
    m = comm.allgather(np.array(splits, dtype=np.int64), timeout=timeout).reshape(size, size)   # m[i, j]: i -> j
    got = [int(m[i, me]) for i in range(size)]
    b = as_bytes(t)
    most = int(m.max())
    if most == 0 or b.shape[1] == 0:
        return torch.empty((sum(got), *tail), dtype=t.dtype, device=t.device), torch.tensor(got, dtype=torch.int32)
    send = b.new_zeros((size, most, b.shape[1]))
    pos = 0
    for j, n in enumerate(splits):
        send[j, :n] = b[pos:pos + n]
        pos += n
    recv = comm.alltoall(send, timeout=timeout)
    out = torch.cat([recv[i, :got[i]] for i in range(size)])
    return from_bytes(out, t.dtype, tail), torch.tensor(got, dtype=torch.int32)


def reducescatter(comm, t: torch.Tensor, op: str, pre: float, post: float, timeout: float) -> torch.Tensor:
    """This rank's rows of the reduction: the first dimension split as evenly as possible, the
    first ``dim0 % size`` ranks getting one row more."""
    x = scale_(t.clone(), pre)
    wire = to_wire(x)
    counts = chunk_counts(t.shape[0], comm.size)
    if len(set(counts)) == 1:
        out = comm.reduce_scatter(wire.contiguous(), op=op, timeout=timeout)
    else:          # uneven rows: reduce everything, keep this rank's rows
        start = sum(counts[:comm.rank])
        out = comm.allreduce(wire.contiguous(), op=op, timeout=timeout)[start:start + counts[comm.rank]]
    if t.is_complex():
        out = torch.view_as_complex(out.contiguous())
    elif out.dtype != t.dtype:
        out = (out != 0) if t.dtype == torch.bool else out.to(t.dtype)
    return scale_(out.clone(), post)


def run_single(comm, e, timeout: float):
    """Run a non-fusable entry (engine thread); returns the handle's result."""
    if e.kind == "barrier":
        comm.barrier(timeout=timeout)
        return None
    if e.kind == "allgather":
        return allgather(comm, e.tensor, timeout)
    if e.kind == "alltoall":
        return alltoall(comm, e.tensor, e.splits, timeout)
    if e.kind == "reducescatter":
        return reducescatter(comm, e.tensor, e.op, e.pre, e.post, timeout)
    raise InvalidArgumentError(f"hpcring.torch: unknown operation kind {e.kind!r}")
