"""Horovod's helper functions: broadcast model parameters, optimizer state and picklable objects;
allgather picklable objects."""
from __future__ import annotations

import io
import pickle

import torch

from hpcring.torch.exceptions import InvalidArgumentError
from hpcring.torch import ops


def broadcast_parameters(params, root_rank: int = 0, process_set=ops.global_process_set) -> None:
    """Overwrite ``params`` (a ``state_dict()``, ``named_parameters()`` or list of (name, tensor))
    on every rank with root's values, in place (the broadcasts run fused)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list) or hasattr(params, "__iter__"):
        items = list(params)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in items):
            raise InvalidArgumentError("broadcast_parameters: expected a state_dict or (name, tensor) pairs")
        items = sorted(items, key=lambda x: x[0])
    else:
        raise InvalidArgumentError(f"broadcast_parameters: unsupported type {type(params).__name__}")
    handles = []
    for name, p in items:
        if p is None:
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        if not torch.is_tensor(t):
            continue
        handles.append(ops.broadcast_async_(t, root_rank, name=f"broadcast_parameters.{name}",
                                            process_set=process_set))
    for h in handles:
        ops.synchronize(h)


def _object_name(name, kind: str, process_set):
    """``(name, None)``, or the set's next automatic name of ``kind`` and its mark: the first part
    carries the mark, so that a first part that stalls or is refused gives the name back."""
    if name:
        return name, None
    return ops.engine_for(process_set).take_auto(kind)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None, process_set=ops.global_process_set):
    """Root's ``obj`` (pickled) on every rank."""
    base, mark = _object_name(name, "broadcast_object", process_set)
    if ops.state.session().topology.rank == root_rank:
        payload = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        payload, n = None, torch.zeros(1, dtype=torch.int64)
    ops.synchronize(ops.broadcast_async_(n, root_rank, name=f"{base}.size", process_set=process_set, mark=mark))
    if payload is None:
        payload = torch.zeros(int(n.item()), dtype=torch.uint8)
    ops.broadcast_(payload, root_rank, name=f"{base}.data", process_set=process_set)
    return obj if ops.state.session().topology.rank == root_rank else _loads(payload.numpy().tobytes())


def allgather_object(obj, name: str | None = None, process_set=ops.global_process_set) -> list:
    """Every rank's ``obj`` (pickled), in rank order."""
    base, mark = _object_name(name, "allgather_object", process_set)
    data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    sizes = ops.synchronize(ops.allgather_async(torch.tensor([data.numel()], dtype=torch.int64),
                                                name=f"{base}.sizes", process_set=process_set, mark=mark)).tolist()
    blob = ops.allgather(data, name=f"{base}.data", process_set=process_set).numpy().tobytes()
    out, pos = [], 0
    for n in sizes:
        out.append(_loads(blob[pos:pos + n]))
        pos += n
    return out


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Root's optimizer state and hyper-parameters (lr, momentum, ...) on every rank.

    Unlike Horovod (which broadcasts tensor by tensor and runs a zero-lr step to create missing
    state), the whole ``state_dict()`` travels pickled through :func:`broadcast_object` and is
    loaded with ``load_state_dict`` (state tensors move to each parameter's device there)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidArgumentError("broadcast_optimizer_state: LBFGS is not supported (as in Horovod)")
    if not optimizer.state:
        _zero_grads(optimizer)
    sd = optimizer.state_dict() if ops.state.session().topology.rank == root_rank else None
    sd = broadcast_object(_to_cpu(sd), root_rank, name="broadcast_optimizer_state")
    optimizer.load_state_dict(sd)


def _zero_grads(optimizer) -> None:
    """Horovod creates a new optimizer's state with a step on zero gradients, and scripts rely on
    what that leaves: every trainable parameter's ``grad`` a zero tensor (sparse for SparseAdam),
    so that, e.g., ``hvd.broadcast(p.grad, 0)`` works before the first backward pass. The step
    itself is not taken here (the state travels whole from the root)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p.data)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf) if _has_tensors(obj) else pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return (b"T" if _has_tensors(obj) else b"P") + buf.getvalue()


def _loads(data: bytes):
    if data[:1] == b"T":
        return torch.load(io.BytesIO(data[1:]), map_location="cpu", weights_only=False)
    return pickle.loads(data[1:])


def _has_tensors(obj) -> bool:
    if torch.is_tensor(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensors(v) for v in obj)
    return False
