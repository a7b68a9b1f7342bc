"""Autograd functions for the collectives, with Horovod's backward passes (horovod.torch.mpi_ops):

* allreduce: the gradient allreduced with the same op and scale factors;
* allgather: the gradient averaged over the set, this rank's rows kept (a reduce-scatter of the
  gradient's slices);
* broadcast: the gradient averaged over the set on the root, zeros elsewhere;
* alltoall: the gradient sent back (alltoall with the received splits);
* reducescatter: the gradient allgathered (times the set's size for Sum, times the scale factors);
* the grouped forms: the same, grouped.

Used by :mod:`hpcring.torch.ops` only when the input requires a gradient and grad mode is on.
"""
from __future__ import annotations

import torch

from hpcring.torch import ops


def wanted(tensor) -> bool:
    return torch.is_tensor(tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _pset_rank_size(process_set):
    eng = ops.engine_for(process_set)
    return eng.rank, eng.size


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, pre, post, process_set):
        ctx.args = (average, op, pre, post, process_set)
        return ops.synchronize(ops.allreduce_async(tensor, average, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx, grad):
        average, op, pre, post, process_set = ctx.args
        g = ops.synchronize(ops.allreduce_async(grad, average, None, op, pre, post, process_set))
        return g, None, None, None, None, None, None


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return ops.synchronize(ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = ops.synchronize(ops.allreduce_async(grad, op=ops.Average, process_set=ctx.process_set))
        dims = ops.synchronize(ops.allgather_async(torch.tensor([ctx.dim], dtype=torch.int64),
                                                   process_set=ctx.process_set))
        r, _ = _pset_rank_size(ctx.process_set)
        offset = int(dims[:r].sum().item())
        return reduced.narrow(0, offset, ctx.dim), None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = int(root_rank), process_set
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = ops.synchronize(ops.allreduce_async(grad, op=ops.Average, process_set=ctx.process_set))
        if ops.state.session().topology.rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, got = ops.synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.got, ctx.process_set = got, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(got)
        return out, got

    @staticmethod
    def backward(ctx, grad, *_):
        g, _ = ops.synchronize(ops.alltoall_async(grad.contiguous(), ctx.got, process_set=ctx.process_set))
        return g, None, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, pre, post):
        ctx.args = (op, process_set, pre, post)
        return ops.synchronize(ops.reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx, grad):
        op, process_set, pre, post = ctx.args
        _, size = _pset_rank_size(process_set)
        g = grad * (size if op == ops.Sum else 1) * pre * post
        return ops.synchronize(ops.allgather_async(g, process_set=process_set)), None, None, None, None, None


# -- the public, differentiable forms (hpcring.torch exports these) ---------------------------
def allreduce(tensor, average=None, name=None, compression=ops.Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=ops.global_process_set):
    """The reduced tensor (a new one); ``op`` defaults to Average, as in Horovod. Differentiable."""
    compressed, ctx = compression.compress(tensor)
    if wanted(compressed):
        out = Allreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    else:
        out = ops.synchronize(ops.allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                                                  process_set))
    return compression.decompress(out, ctx)


def allgather(tensor, name=None, process_set=ops.global_process_set):
    """All ranks' tensors concatenated along the first dimension (which may differ by rank)."""
    if wanted(tensor):
        return Allgather.apply(tensor, name, process_set)
    return ops.allgather(tensor, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=ops.global_process_set):
    """Root's tensor (``root_rank`` is a global rank) on every rank of the set. Differentiable."""
    if wanted(tensor):
        return Broadcast.apply(tensor, root_rank, name, process_set)
    return ops.broadcast(tensor, root_rank, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=ops.global_process_set):
    """Rows ``splits[j]`` (default: equal shares) go to rank j; with ``splits`` given, returns
    ``(output, received_splits)``. Differentiable."""
    if wanted(tensor):
        return Alltoall.apply(tensor, splits, name, process_set)
    return ops.alltoall(tensor, splits, name, process_set)


def reducescatter(tensor, name=None, compression=ops.Compression.none, op=ops.Average,
                  process_set=ops.global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction (the first ``dim0 % size`` ranks get one row more). Differentiable."""
    compressed, ctx = compression.compress(tensor)
    if wanted(compressed):
        out = Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = ops.synchronize(ops.reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                                      postscale_factor))
    return compression.decompress(out, ctx)


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, pre, post, process_set, *tensors):
        ctx.args = (average, op, pre, post, process_set)
        return tuple(ops.synchronize(ops.grouped_allreduce_async(list(tensors), average, name, op, pre, post,
                                                                 process_set)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, pre, post, process_set = ctx.args
        outs = ops.synchronize(ops.grouped_allreduce_async([g.contiguous() for g in grads], average, None, op, pre,
                                                           post, process_set))
        return (None,) * 6 + tuple(outs)


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(ops.synchronize(ops.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = ops.synchronize(ops.grouped_allreduce_async([g.contiguous() for g in grads], op=ops.Average,
                                                              process_set=ctx.process_set))
        dims = ops.synchronize(ops.allgather_async(torch.tensor([ctx.dims], dtype=torch.int64),
                                                   process_set=ctx.process_set))
        r, _ = _pset_rank_size(ctx.process_set)
        offsets = dims[:r].sum(0).tolist() if r else [0] * len(grads)
        return (None, None) + tuple(g.narrow(0, int(o), d) for g, o, d in zip(reduced, offsets, ctx.dims))


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, pre, post, *tensors):
        ctx.args = (op, process_set, pre, post)
        return tuple(ops.synchronize(ops.grouped_reducescatter_async(list(tensors), name, op, process_set, pre,
                                                                     post)))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        _, size = _pset_rank_size(process_set)
        scaled = [g * (size if op == ops.Sum else 1) * pre * post for g in grads]
        return (None,) * 5 + tuple(ops.synchronize(ops.grouped_allgather_async(scaled, process_set=process_set)))


def grouped_allreduce(tensors, average=None, name=None, compression=ops.Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=ops.global_process_set):
    """Each tensor reduced (one handle; members fused with other ready tensors). Differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    ins = [c for c, _ in pairs]
    if any(wanted(t) for t in ins):
        outs = GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set, *ins)
    else:
        outs = ops.synchronize(ops.grouped_allreduce_async(ins, average, name, op, prescale_factor, postscale_factor,
                                                           process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allgather(tensors, name=None, process_set=ops.global_process_set):
    """Each tensor allgathered (one handle). Differentiable."""
    if any(wanted(t) for t in tensors):
        return list(GroupedAllgather.apply(name, process_set, *tensors))
    return ops.synchronize(ops.grouped_allgather_async(tensors, name, process_set))


def grouped_reducescatter(tensors, name=None, compression=ops.Compression.none, op=ops.Average,
                          process_set=ops.global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Each tensor reduce-scattered (one handle). Differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    ins = [c for c, _ in pairs]
    if any(wanted(t) for t in ins):
        outs = GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *ins)
    else:
        outs = ops.synchronize(ops.grouped_reducescatter_async(ins, name, op, process_set, prescale_factor,
                                                               postscale_factor))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
