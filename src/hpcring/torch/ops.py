"""Horovod's PyTorch collectives (``horovod.torch.mpi_ops``) on the hpcring engine.

Every operation is queued on the engine (:mod:`hpcring.torch.engine`) under a name and runs once
every rank has submitted that name. Without ``name=``, names are ``<op>.noname.<n>`` with a
per-process counter, so unnamed calls must be made in the same order on every rank (as in
Horovod). ``*_async`` returns a handle for :func:`synchronize` / :func:`poll`.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from hpcring.collectives.backends import chunk_counts
from hpcring.errors import UsageError
from hpcring.torch import state
from hpcring.torch.compression import Compression
from hpcring.torch.engine import Entry, GroupHandle, Handle

# Horovod's op constants (same values)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "prod"}
_counter = itertools.count()


def _name(name, op: str) -> str:
    return name if name is not None else f"{op}.noname.{next(_counter)}"


def _resolve_op(average, op) -> int:
    if op is not None and average is not None:
        raise UsageError("allreduce: give either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise UsageError("hpcring.torch does not implement Adasum", hint="use op=hvd.Average (the default)")
    if op not in _OPS:
        raise UsageError(f"allreduce: unknown op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise UsageError("hpcring.torch supports only the global process set",
                         hint="drop process_set=; process sets are not implemented")


class _GlobalProcessSet:
    process_set_id = 0

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = _GlobalProcessSet()


# -- allreduce ----------------------------------------------------------------------------
def _allreduce_entry(tensor, output, name, op, prescale_factor, postscale_factor) -> Entry:
    post = float(postscale_factor) / (state.engine().size if op == Average else 1)
    return Entry(name, "allreduce", tensor, output, op=_OPS[op], pre=float(prescale_factor), post=post)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None) -> Handle:
    _check_process_set(process_set)
    op = _resolve_op(average, op)
    t = tensor.detach().contiguous()
    e = _allreduce_entry(t, torch.empty_like(t), _name(name, "allreduce"), op, prescale_factor, postscale_factor)
    return state.engine().submit(e)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """The reduced tensor (a new one). ``op`` defaults to Average, as in Horovod."""
    compressed, ctx = compression.compress(tensor)
    h = allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(synchronize(h), ctx)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None) -> Handle:
    _check_process_set(process_set)
    op = _resolve_op(average, op)
    if not tensor.is_contiguous():
        raise UsageError(f"allreduce_: tensor '{name}' must be contiguous to be reduced in place")
    t = tensor.detach()
    return state.engine().submit(_allreduce_entry(t, t, _name(name, "allreduce"), op, prescale_factor,
                                                  postscale_factor))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _group(handles: list[Handle], name: str) -> Handle:
    """One handle over several (grouped ops): its result is the list of results."""
    return GroupHandle(name, handles)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> Handle:
    base = _name(name, "grouped_allreduce")
    return _group([allreduce_async(t, average, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set)
                   for i, t in enumerate(tensors)], base)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_allreduce_async([c for c, _ in pairs], average, name, op, prescale_factor,
                                               postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> Handle:
    base = _name(name, "grouped_allreduce")
    return _group([allreduce_async_(t, average, f"{base}.{i}", op, prescale_factor, postscale_factor, process_set)
                   for i, t in enumerate(tensors)], base)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# -- allgather / broadcast / alltoall / reducescatter ---------------------------------------
def allgather_async(tensor, name=None, process_set=None) -> Handle:
    _check_process_set(process_set)
    t = tensor.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return state.engine().submit(Entry(_name(name, "allgather"), "allgather", t))


def allgather(tensor, name=None, process_set=None):
    """All ranks' tensors concatenated along the first dimension (which may differ by rank)."""
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=None) -> Handle:
    base = _name(name, "grouped_allgather")
    return _group([allgather_async(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)], base)


def grouped_allgather(tensors, name=None, process_set=None):
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> Handle:
    _check_process_set(process_set)
    _check_root(root_rank)
    t = tensor.detach().contiguous().clone()
    return state.engine().submit(Entry(_name(name, "broadcast"), "broadcast", t, t, root=int(root_rank)))


def broadcast(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> Handle:
    _check_process_set(process_set)
    _check_root(root_rank)
    if not tensor.is_contiguous():
        raise UsageError(f"broadcast_: tensor '{name}' must be contiguous to be written in place")
    t = tensor.detach()
    return state.engine().submit(Entry(_name(name, "broadcast"), "broadcast", t, t, root=int(root_rank)))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return tensor


def _check_root(root) -> None:
    n = state.engine().size
    if not 0 <= int(root) < n:
        raise UsageError(f"broadcast: root_rank {root} out of range for {n} ranks")


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> Handle:
    _check_process_set(process_set)
    t = tensor.detach().contiguous()
    size = state.engine().size
    if splits is None:
        if t.shape[0] % size:
            raise UsageError(f"alltoall: first dimension {t.shape[0]} is not divisible by {size} ranks",
                             hint="pass splits= (rows sent to each rank)")
        sp = [t.shape[0] // size] * size
    else:
        sp = [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits)]
        if len(sp) != size or sum(sp) != t.shape[0] or min(sp) < 0:
            raise UsageError(f"alltoall: splits {sp} must have {size} non-negative entries summing to "
                             f"the first dimension {t.shape[0]}")
    return state.engine().submit(Entry(_name(name, "alltoall"), "alltoall", t, splits=sp))


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Rows ``splits[j]`` (default: equal shares) go to rank j. Returns the received rows
    concatenated in rank order; with ``splits`` given, ``(output, received_splits)`` as Horovod."""
    out, got = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, got)


def reducescatter_async(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:
    _check_process_set(process_set)
    op = _resolve_op(None, op)
    t = tensor.detach().contiguous()
    if t.dim() == 0:
        raise UsageError("reducescatter needs a tensor with at least one dimension")
    post = float(postscale_factor) / (state.engine().size if op == Average else 1)
    return state.engine().submit(Entry(_name(name, "reducescatter"), "reducescatter", t, op=_OPS[op],
                                       pre=float(prescale_factor), post=post))


def reducescatter(tensor, name=None, op=Average, process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction: the first dimension split as evenly as possible, the
    first ``dim0 % size`` ranks getting one row more (Horovod's split)."""
    return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))


def barrier(process_set=None) -> None:
    _check_process_set(process_set)
    synchronize(state.engine().submit(Entry(_name(None, "barrier"), "barrier", None)))


def join(device=-1) -> int:
    """Block until every rank has joined; meanwhile this rank contributes zeros to the other ranks'
    allreduces. Returns the rank that joined last."""
    return synchronize(state.engine().join())


def poll(handle: Handle) -> bool:
    return handle.done()


def synchronize(handle: Handle):
    """Wait for ``handle`` and return its result."""
    if not isinstance(handle, Handle):
        raise UsageError(f"synchronize: expected a handle from an *_async call, got {type(handle).__name__}")
    return handle.wait()


# -- executed on the engine thread ------------------------------------------------------------
def run_single(comm, e: Entry):
    """Run a non-fusable entry on ``comm`` (engine thread); returns the handle's result."""
    if e.kind == "barrier":
        comm.barrier()
        return None
    t = e.tensor
    if e.kind == "allgather":
        rows = comm.allgather(np.array([t.shape[0]], dtype=np.int64)).reshape(-1).tolist()
        most = max(rows)
        padded = t if t.shape[0] == most else torch.cat([t, t.new_zeros((most - t.shape[0], *t.shape[1:]))])
        g = comm.allgather(padded)
        return torch.cat([g[r, :rows[r]] for r in range(comm.size)])
    if e.kind == "alltoall":
        size, me = comm.size, comm.rank
        m = comm.allgather(np.array(e.splits, dtype=np.int64)).reshape(size, size)   # m[i, j]: i sends to j
        most = max(int(m.max()), 1)
        send = t.new_zeros((size, most, *t.shape[1:]))
        pos = 0
        for j, n in enumerate(e.splits):
            send[j, :n] = t[pos:pos + n]
            pos += n
        recv = comm.alltoall(send)
        got = [int(m[i, me]) for i in range(size)]
        out = torch.cat([recv[i, :got[i]] for i in range(size)])
        return out, torch.tensor(got, dtype=torch.int32)
    if e.kind == "reducescatter":
        x = t * e.pre if e.pre != 1.0 else t
        counts = chunk_counts(t.shape[0], comm.size)
        if len(set(counts)) == 1:
            out = comm.reduce_scatter(x.contiguous(), op=e.op)
        else:          # uneven rows: reduce everything, keep this rank's rows
            start = sum(counts[:comm.rank])
            out = comm.allreduce(x.contiguous(), op=e.op)[start:start + counts[comm.rank]].clone()
        if e.post != 1.0:
            out = out * e.post if out.is_floating_point() else torch.div(out, 1.0 / e.post, rounding_mode="floor")
        return out
    raise UsageError(f"hpcring.torch: unknown operation kind {e.kind!r}")
