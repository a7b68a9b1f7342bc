"""``SyncBatchNorm``: batch normalization with statistics over the global batch (all ranks).

Each rank sums x and x*x per channel; one allreduce (Sum) gives the global sums and count. The
allreduce is an autograd function whose backward is again an allreduce of the incoming gradient
(the Jacobian of a sum over ranks), so autograd differentiates through the global statistics
without a hand-written backward. Eval mode, or one rank, is plain batch norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hpcring.torch import ops


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return ops.allreduce(x, op=ops.Sum)

    @staticmethod
    def backward(ctx, grad):
        return ops.allreduce(grad.contiguous(), op=ops.Sum)


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` (any input of shape (N, C, ...))."""

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x):
        self._check_input_dim(x)
        if not self.training or ops.state.engine().size == 1:
            return super().forward(x)
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.full((1,), x.numel() // c, dtype=x.dtype, device=x.device)
        stats = _SumOverRanks.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        n = stats[-1]
        mean = stats[:c] / n
        var = stats[c:2 * c] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                if self.num_batches_tracked is not None:
                    self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


_ = F  # torch.nn.functional stays importable for users patching batch_norm
