"""``DistributedOptimizer``: allreduce each gradient from a hook as soon as autograd has
accumulated it (overlapping communication with the rest of the backward pass); ``step()`` waits
only for what is still in flight, then runs the wrapped optimizer's step.

Semantics follow Horovod's: gradients are averaged (``op=Average``) across ranks; with
``backward_passes_per_step=k`` gradients accumulate locally for k backward passes and are reduced
on the k-th (nothing is divided by k: scale the loss, as with Horovod); ``num_groups``/``groups``
reduce parameter groups together; ``gradient_predivide_factor=f`` divides by f before the sum and
multiplies by f/size after it.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from hpcring.torch.exceptions import InvalidArgumentError, InvalidStateError, NotSupportedError
from hpcring.torch import ops, state
from hpcring.torch.compression import Compression
from hpcring.torch.process_sets import ProcessSet
from hpcring.torch.functions import broadcast_object


def _included(process_set) -> bool:
    """Whether this rank is in ``process_set``; an unregistered set raises (engine_for's error)."""
    if process_set is None or process_set is ops.global_process_set:
        return True
    if isinstance(process_set, ProcessSet) and process_set.included() is False:
        return False
    ops.engine_for(process_set)
    return True


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=ops.Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                 process_set=ops.global_process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        # a rank outside the set builds the optimizer and steps on its own gradients (Horovod)
        self._in_set = _included(process_set)
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
                raise InvalidArgumentError("DistributedOptimizer: named_parameters must be (name, parameter) pairs, "
                                 "as model.named_parameters() gives")
        else:
            named = [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(self.param_groups)
                     for j, p in enumerate(g["params"])]
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise InvalidArgumentError(f"DistributedOptimizer: duplicate parameter names: {', '.join(dups)}")
        ids = {id(p) for _, p in named}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in ids]
        if unnamed:
            raise InvalidArgumentError(f"DistributedOptimizer: {len(unnamed)} optimizer parameter(s) are missing from "
                             "named_parameters", hint="pass model.named_parameters() of the model being optimized")
        if op == ops.Adasum:
            raise NotSupportedError("hpcring.torch does not implement Adasum", hint="use op=hvd.Average")
        if backward_passes_per_step < 1:
            raise InvalidArgumentError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._parameter_names = {p: n for n, p in named}     # Horovod's attribute; scripts read it
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self._delay = {p: backward_passes_per_step for _, p in named}
        self._handles: dict = {}          # param or tuple of params -> (handle, ctx(s))
        self._hook_handles = []
        self._requires_update: set = set()
        self._synchronized = False
        self._should_synchronize = True
        self._p_to_group: dict = {}
        self._group_ready: dict = {}
        self._expected: list[str] = []
        if self._engine is not None and self._engine.size > 1:
            self._make_groups(num_groups, groups)
            self._register_hooks()
            self._expected = self._submission_names()
            self._expect()

    # -- setup ----------------------------------------------------------------------------------
    def _make_groups(self, num_groups, groups) -> None:
        if groups is not None:
            if num_groups:
                raise InvalidArgumentError("DistributedOptimizer: give num_groups or groups, not both")
            if isinstance(groups, int):
                num_groups, groups = groups, None
        plist = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if groups is not None:
            made = [tuple(g) for g in groups]
        elif num_groups:
            # the same order on every rank: rank 0's name order
            order = broadcast_object([self._parameter_names[p] for p in plist], root_rank=0,
                                     process_set=self.process_set)
            plist.sort(key=lambda p: order.index(self._parameter_names[p]))
            k, extra = divmod(len(plist), num_groups)
            made, pos = [], 0
            for i in range(num_groups):
                n = k + (i < extra)
                if n:
                    made.append(tuple(plist[pos:pos + n]))
                pos += n
        else:
            return
        for g in made:
            for p in g:
                self._p_to_group[p] = g
            self._group_ready[g] = 0

    def _register_hooks(self) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                self._requires_update.add(p)
                if hasattr(p, "register_post_accumulate_grad_hook"):     # torch >= 2.1
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
                else:                                                    # the grad accumulator node
                    acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    acc.register_hook(self._make_hook(p))
                    self._hook_handles.append(acc)

    @property
    def _engine(self):
        """The engine of the optimizer's set now (None outside it): looked up each time, since an
        elastic reset (shutdown, init) replaces the engines under an optimizer that lives on."""
        return ops.engine_for(self.process_set) if self._in_set else None

    def _submission_names(self) -> list[str]:
        """The names one step submits: each parameter's, or per group ``<first name>.<i>``."""
        names = [self._parameter_names[p] for p in self._requires_update if p not in self._p_to_group]
        for g in self._group_ready:
            names += [f"{self._parameter_names[g[0]]}.{i}" for i in range(len(g))]
        return names

    def _expect(self) -> None:
        """Tell the engine which names this step will bring, so that its fusion cycle starts as
        soon as the last gradient is queued instead of waiting out the cycle time."""
        if state._engine is not None:      # restore() runs after a failure, with the engine shut down
            self._engine.expect(self, self._expected)

    # -- communication --------------------------------------------------------------------------
    def _factors(self):
        if self.op == ops.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _dense_grad(self, p):
        """What is reduced for ``p``: its gradient, or a dense copy of a sparse one when
        sparse_as_dense is set (``p.grad`` itself stays sparse: :meth:`_finish` writes the result
        back as sparse, as Horovod does, so that sparse-only optimizers such as SparseAdam work)."""
        if p.grad.is_sparse and self.sparse_as_dense:
            return p.grad.to_dense()
        return p.grad

    def _allreduce_grad_async(self, p):
        grad = self._dense_grad(p)
        if grad.is_sparse:        # Horovod: indices and values allgathered (op Average or Sum)
            name = self._parameter_names[p]
            self._engine.substitute(self, name, [f"{name}.indices", f"{name}.values"])
            return ops.sparse_allreduce_async(grad, name=name, op=self.op, process_set=self.process_set), (None, None)
        compressed, ctx = self._compression.compress(grad)
        pre, post = self._factors()
        h = ops.allreduce_async_(compressed if compressed.is_contiguous() else compressed.contiguous(),
                                 name=self._parameter_names[p], op=self.op, prescale_factor=pre, postscale_factor=post,
                                 process_set=self.process_set)
        return h, (compressed, ctx)

    def _grouped_allreduce_async(self, group):
        for p in group:
            if self._dense_grad(p).is_sparse:
                raise InvalidArgumentError(f"DistributedOptimizer: parameter '{self._parameter_names[p]}' has a sparse "
                                           "gradient, which grouped allreduces do not take",
                                           hint="pass sparse_as_dense=True")
        pairs = [self._compression.compress(self._dense_grad(p)) for p in group]
        pre, post = self._factors()
        h = ops.grouped_allreduce_async_([c if c.is_contiguous() else c.contiguous() for c, _ in pairs],
                                         name=self._parameter_names[group[0]], op=self.op, prescale_factor=pre,
                                         postscale_factor=post, process_set=self.process_set)
        return h, pairs

    def _make_hook(self, p):
        def hook(*_):
            if p.grad is None:
                return
            if self._delay[p] <= 0:
                raise InvalidStateError("DistributedOptimizer: gradients were computed more than backward_passes_per_step "
                                 f"({self.backward_passes_per_step}) times before step()",
                                 hint="raise backward_passes_per_step to accumulate gradients locally")
            self._delay[p] -= 1
            if self._delay[p] > 0:
                self._handles.setdefault(p, (None, None))
                return
            group = self._p_to_group.get(p)
            if group is not None:
                self._group_ready[group] += 1
                if self._group_ready[group] == len(group):
                    self._handles[group] = self._grouped_allreduce_async(group)
                    for gp in group:
                        self._handles.pop(gp, None)
                    self._group_ready[group] = 0
                return
            self._handles[p] = self._allreduce_grad_async(p)
        return hook

    def synchronize(self) -> None:
        """Start what the hooks did not (parameters without a gradient this step still take part, so
        every rank submits the same names) and wait for all of it. Outside the optimizer's process
        set there is nothing to wait for (Horovod)."""
        if self._engine is None:
            self._synchronized = True
            return
        done = set()
        for key in self._handles:
            done.update(key) if isinstance(key, tuple) else done.add(key)
        for p in self._requires_update - done:
            if p in self._p_to_group:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._handles[p] = self._allreduce_grad_async(p)
        for group, n in list(self._group_ready.items()):
            if 0 < n < len(group) or (n == 0 and group not in self._handles and any(
                    self._delay[gp] < self.backward_passes_per_step for gp in group)):
                for gp in group:
                    if gp.grad is None:
                        gp.grad = torch.zeros_like(gp)
                self._handles[group] = self._grouped_allreduce_async(group)
                self._group_ready[group] = 0
        for key, (h, ctx) in list(self._handles.items()):
            if h is None:
                self._handles[key] = self._allreduce_grad_async(key)
        for key, (h, ctx) in self._handles.items():
            outs = ops.synchronize(h)
            if isinstance(key, tuple):
                for gp, out, (compressed, c) in zip(key, outs, ctx):
                    self._finish(gp, out, compressed, c)
            else:
                self._finish(key, outs, *ctx)
        self._handles.clear()
        self._synchronized = True
        self._expect()

    def _finish(self, p, out, compressed, ctx) -> None:
        self._delay[p] = self.backward_passes_per_step
        if compressed is None:                 # a sparse gradient: the gathered sparse tensor
            p.grad = out
        elif p.grad.is_sparse:                 # sparse_as_dense: back to sparse for the update
            dense = self._compression.decompress(out, ctx)
            p.grad.zero_().add_(dense if dense.is_sparse else dense.to_sparse())
        elif compressed is not p.grad:           # compressed or made contiguous: copy back
            p.grad.copy_(self._compression.decompress(out, ctx))

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                # Horovod's words: scripts filter warnings on them
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        tuner = self._engine.autotuner if self._engine is not None else None
        if tuner is not None:
            tuner.on_step()
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if any(h is not None for h, _ in self._handles.values()):
            raise InvalidStateError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                             "or optimizer.synchronize()", hint="call step() (or synchronize()) first")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        if self._expected:
            self._expect()
        return super(self.__class__, self).load_state_dict(*args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=ops.Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=None):
    """Wrap ``optimizer`` (any torch optimizer): same class name and behaviour, gradients averaged
    across the ranks of ``process_set`` before each step. Sparse gradients are allgathered as
    Horovod's sparse allreduce does, or made dense first with ``sparse_as_dense=True``."""
    if _included(process_set):
        ops.engine_for(process_set)     # a set that is not registered: a clear error now
    if gradient_predivide_factor != 1.0 and op != ops.Average:
        raise InvalidArgumentError("gradient_predivide_factor needs op=hvd.Average")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
