"""Horovod's PyTorch collectives (``horovod.torch.mpi_ops``) on the hpcring engine.

Every operation is queued on its process set's engine (:mod:`hpcring.torch.engine`) under a name
and runs once every rank of the set has submitted that name. Without ``name=``, names are
``<op>.noname.<n>``, counted per kind of operation and process set from the operations the engine
accepted (:meth:`Engine.auto_name`), so unnamed calls of one kind must be made in the same order on
every rank (as in Horovod). ``*_async`` returns a handle for :func:`synchronize` / :func:`poll`.
The differentiable forms of ``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and
``reducescatter`` (what ``hpcring.torch`` exports) are in :mod:`hpcring.torch.autograd`.
"""
from __future__ import annotations

import torch

from hpcring.torch import state
from hpcring.torch.compression import Compression
from hpcring.torch.entry import AsyncHandle, Entry, GroupHandle
from hpcring.torch.exceptions import InvalidArgumentError, InvalidTypeError, NotSupportedError
from hpcring.torch.executor import check_reducible
from hpcring.torch.process_sets import engine_for, global_process_set

# Horovod's op constants (same values)
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "prod"}


def _name(name, op: str, eng=None) -> str:
    """``name``, or the set's next automatic name for ``op``; call it once the arguments are checked."""
    if name is not None:
        return name
    return (eng or state.engine()).take_auto(op)[0]


def _submit_parts(eng, entries: list[Entry], name, kind: str, suffixes=None) -> tuple[str, list[AsyncHandle]]:
    """Submit checked entries as the parts ``<name>.<suffix>`` of one operation (by default
    suffixes 0, 1, ...); an automatic name is taken only now, and its parts carry its mark."""
    mark = None
    if name is None:
        name, mark = eng.take_auto(kind)
    for i, e in enumerate(entries):
        e.set_name(f"{name}.{suffixes[i] if suffixes else i}")
        e.auto = mark
    return name, [eng.submit(e) for e in entries]


def _submit_group(eng, entries: list[Entry], name, kind: str) -> AsyncHandle:
    """Submit checked entries as one grouped operation (its result: the list of results)."""
    base, handles = _submit_parts(eng, entries, name, kind)
    return _group(handles, base)


def _resolve_op(average, op) -> int:
    if op is not None and average is not None:
        raise InvalidArgumentError("allreduce: give either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotSupportedError("hpcring.torch does not implement Adasum", hint="use op=hvd.Average (the default)")
    if op not in _OPS:
        raise InvalidArgumentError(f"allreduce: unknown op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


def _tensor(tensor, what: str) -> torch.Tensor:
    if not torch.is_tensor(tensor):
        raise InvalidTypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise InvalidArgumentError(f"{what}: sparse tensors go through hvd.sparse_allreduce_async "
                                   "(or DistributedOptimizer(sparse_as_dense=True))")
    return tensor


# -- allreduce ----------------------------------------------------------------------------
def _what(kind: str, name) -> str:
    return kind if name is None else f"{kind} '{name}'"


def _allreduce_entry(eng, tensor, name, op, prescale_factor, postscale_factor, inplace: bool) -> Entry:
    """A checked allreduce entry (``op`` resolved); in place: ``tensor`` must be contiguous."""
    if inplace:
        if not _tensor(tensor, "allreduce_").is_contiguous():
            raise InvalidArgumentError(f"allreduce_: tensor '{name}' must be contiguous to be reduced in place")
        t = out = tensor.detach()
    else:
        t = _tensor(tensor, "allreduce").detach().contiguous()
        out = torch.empty_like(t)
    check_reducible(t, _OPS[op], _what("allreduce", name))
    post = float(postscale_factor) / (eng.size if op == Average else 1)
    return Entry(name, "allreduce", t, out, op=_OPS[op], pre=float(prescale_factor), post=post)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> AsyncHandle:
    eng = engine_for(process_set)
    op = _resolve_op(average, op)
    return eng.submit(_allreduce_entry(eng, tensor, name, op, prescale_factor, postscale_factor, False))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The reduced tensor (a new one). ``op`` defaults to Average, as in Horovod."""
    compressed, ctx = compression.compress(tensor)
    out = synchronize(allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor, process_set))
    return compression.decompress(out, ctx)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> AsyncHandle:
    eng = engine_for(process_set)
    op = _resolve_op(average, op)
    return eng.submit(_allreduce_entry(eng, tensor, name, op, prescale_factor, postscale_factor, True))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _group(handles: list[AsyncHandle], name: str) -> AsyncHandle:
    """One handle over several (grouped ops): its result is the list of results."""
    return GroupHandle(name, handles)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> AsyncHandle:
    eng = engine_for(process_set)
    op = _resolve_op(average, op)
    return _submit_group(eng, [_allreduce_entry(eng, t, name, op, prescale_factor, postscale_factor, False)
                               for t in tensors], name, "grouped_allreduce")


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_allreduce_async([c for c, _ in pairs], average, name, op, prescale_factor,
                                               postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> AsyncHandle:
    eng = engine_for(process_set)
    op = _resolve_op(average, op)
    return _submit_group(eng, [_allreduce_entry(eng, t, name, op, prescale_factor, postscale_factor, True)
                               for t in tensors], name, "grouped_allreduce")


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set) -> AsyncHandle:
    """A sparse tensor reduced as Horovod does: its indices and values allgathered (every rank's
    entries concatenated, not coalesced), values divided by the set's size for Average."""
    eng = engine_for(process_set)
    if not (torch.is_tensor(tensor) and tensor.is_sparse):
        raise InvalidArgumentError("sparse_allreduce_async: expected a sparse COO tensor")
    op = _resolve_op(None, op)
    if op not in (Average, Sum):
        raise InvalidArgumentError("sparse_allreduce_async: op must be hvd.Average or hvd.Sum")
    t = tensor.detach()
    base, handles = _submit_parts(eng, [_allgather_entry(t._indices().t().contiguous(), name),
                                        _allgather_entry(t._values().contiguous(), name)],
                                  name, "sparse_allreduce", ("indices", "values"))
    size = eng.size

    def finish(parts):
        indices, values = parts
        if op == Average:
            values = values / size
        return torch.sparse_coo_tensor(indices.t(), values, t.size())
    return _Deferred(base, handles, finish)


class _Deferred(GroupHandle):
    """A group handle whose result is computed from its members' results (in the waiter)."""

    __slots__ = ("_fn",)

    def __init__(self, name: str, members: list[AsyncHandle], fn) -> None:
        super().__init__(name, members)
        self._fn = fn

    def wait(self, timeout: float | None = None):
        return self._fn(super().wait(timeout))

    def __call__(self):
        """Horovod's sparse handle is a function that returns the result: ``handle()``."""
        return self.wait()


# -- allgather / broadcast / alltoall / reducescatter ---------------------------------------
def _allgather_entry(tensor, name) -> Entry:
    t = _tensor(tensor, "allgather").detach().contiguous()
    return Entry(name, "allgather", t.reshape(1) if t.dim() == 0 else t)


def allgather_async(tensor, name=None, process_set=global_process_set, *, mark=None) -> AsyncHandle:
    """``mark``: the automatic name (Engine.take_auto) this call is the first part of."""
    e = _allgather_entry(tensor, name)
    e.auto = mark
    return engine_for(process_set).submit(e)


def allgather(tensor, name=None, process_set=global_process_set):
    """All ranks' tensors concatenated along the first dimension (which may differ by rank)."""
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> AsyncHandle:
    return _submit_group(engine_for(process_set), [_allgather_entry(t, name) for t in tensors], name,
                         "grouped_allgather")


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def _root(eng, process_set, root_rank) -> int:
    """``root_rank`` (a global rank, as in Horovod) as an index in the set."""
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"broadcast: root_rank must be an integer, got {root_rank!r}") from None
    members = eng.controller.members
    if members is None:
        if not 0 <= root < eng.size:
            raise InvalidArgumentError(f"broadcast: root_rank {root} out of range for {eng.size} ranks")
        return root
    if root not in members:
        raise InvalidArgumentError(f"broadcast: root_rank {root} is not a member of {process_set}")
    return members.index(root)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> AsyncHandle:
    eng = engine_for(process_set)
    root = _root(eng, process_set, root_rank)
    t = _tensor(tensor, "broadcast").detach().contiguous().clone()
    return eng.submit(Entry(name, "broadcast", t, t, root=root))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set, *, mark=None) -> AsyncHandle:
    eng = engine_for(process_set)
    root = _root(eng, process_set, root_rank)
    if not _tensor(tensor, "broadcast_").is_contiguous():
        raise InvalidArgumentError(f"broadcast_: tensor '{name}' must be contiguous to be written in place")
    t = tensor.detach()
    e = Entry(name, "broadcast", t, t, root=root)
    e.auto = mark
    return eng.submit(e)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return tensor


def _splits(splits, rows: int, size: int) -> list[int]:
    if splits is None:
        if rows % size:
            raise InvalidArgumentError(f"alltoall: first dimension {rows} is not divisible by {size} ranks",
                                       hint="pass splits= (rows sent to each rank)")
        return [rows // size] * size
    if torch.is_tensor(splits):
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise InvalidArgumentError(f"alltoall: splits must be integers, got a {splits.dtype} tensor")
        sp = splits.reshape(-1).tolist()
    else:
        sp = list(splits)
    if any(isinstance(s, bool) or not isinstance(s, int) and not (hasattr(s, "dtype") and "int" in str(s.dtype))
           for s in sp):
        raise InvalidArgumentError(f"alltoall: splits must be integers, got {sp}")
    sp = [int(s) for s in sp]
    if len(sp) != size or sum(sp) != rows or min(sp) < 0:
        raise InvalidArgumentError(f"alltoall: splits {sp} must have {size} non-negative entries summing to "
                                   f"the first dimension {rows}")
    return sp


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> AsyncHandle:
    eng = engine_for(process_set)
    t = _tensor(tensor, "alltoall").detach().contiguous()
    if t.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    sp = _splits(splits, t.shape[0], eng.size)
    return eng.submit(Entry(name, "alltoall", t, splits=sp))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[j]`` (default: equal shares) go to rank j. Returns the received rows
    concatenated in rank order; with ``splits`` given, ``(output, received_splits)`` as Horovod."""
    out, got = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, got)


def _reducescatter_entry(eng, tensor, name, op, prescale_factor, postscale_factor) -> Entry:
    op = _resolve_op(None, op)
    t = _tensor(tensor, "reducescatter").detach().contiguous()
    if t.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    check_reducible(t, _OPS[op], _what("reducescatter", name))
    post = float(postscale_factor) / (eng.size if op == Average else 1)
    return Entry(name, "reducescatter", t, op=_OPS[op], pre=float(prescale_factor), post=post)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> AsyncHandle:
    eng = engine_for(process_set)
    return eng.submit(_reducescatter_entry(eng, tensor, name, op, prescale_factor, postscale_factor))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction: the first dimension split as evenly as possible, the
    first ``dim0 % size`` ranks getting one row more (Horovod's split)."""
    compressed, ctx = compression.compress(tensor)
    out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> AsyncHandle:
    eng = engine_for(process_set)
    return _submit_group(eng, [_reducescatter_entry(eng, t, name, op, prescale_factor, postscale_factor)
                               for t in tensors], name, "grouped_reducescatter")


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_reducescatter_async([c for c, _ in pairs], name, op, process_set, prescale_factor,
                                                   postscale_factor))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def barrier(process_set=global_process_set) -> None:
    eng = engine_for(process_set)
    synchronize(eng.submit(Entry(None, "barrier", None)))


def join(device=-1) -> int:
    """Block until every rank has joined; meanwhile this rank contributes zeros to the other ranks'
    Sum/Average allreduces (their other operations fail, as in Horovod). Returns the rank that
    joined last."""
    return synchronize(state.engine().join())


def poll(handle: AsyncHandle) -> bool:
    return handle.done()


def synchronize(handle: AsyncHandle):
    """Wait for ``handle`` and return its result."""
    if not isinstance(handle, AsyncHandle):
        raise InvalidArgumentError(f"synchronize: expected a handle from an *_async call, got {type(handle).__name__}")
    return handle.wait()
