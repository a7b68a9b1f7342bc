"""DDP communication hook: keep gloo/NCCL as the process group, move gradients with hpcring.

    from hpcring.distributed import allreduce_hook
    model = DDP(model)                                # on gloo or nccl
    model.register_comm_hook(None, allreduce_hook)    # state: None (the session's communicator)
                                                      # or an hpcring Communicator

Each gradient bucket is divided by the world size and summed in place by
``Communicator.allreduce_async`` (DDP's own default does the same, so results match it); the
future completes on a completion thread once hpcring's worker has finished (host backends:
never on the worker, so a ``then()`` callback may issue collectives, see work.py) or is
stream-ordered on the bucket's CUDA stream (NCCL, see work.py), and the allreduce has hpcring's
deadline, flight record and hang report.
"""
# no `from __future__ import annotations`: DDP compares the hook's annotations with the real types
import torch
import torch.distributed as dist
from torch.futures import Future

from hpcring.distributed.work import COMPLETER, stream_ordered


def _communicator(state, device_type: str):
    if state is not None:
        return state
    from hpcring.session import current, init  # deferred: session (~100 ms) waits for a process group, not import torch (rank_site)
    session = current() or init()
    comm = session.communicator()
    if device_type == "cpu" and comm.device != "cpu":
        comm = session.communicator("ring")
    return comm


def allreduce_hook(state, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """``model.register_comm_hook(state, allreduce_hook)``: average each bucket over the ranks
    with hpcring (``state``: a Communicator, or None for the session's)."""
    buf = bucket.buffer()
    comm = _communicator(state, buf.device.type)
    buf.div_(comm.size)
    handle = comm.allreduce_async(buf, "sum", out=buf)
    if stream_ordered([handle]):      # NCCL: on the bucket's stream, done as torch's NCCL hook is
        fut: Future = Future(devices=[buf.device])
        fut.set_result(buf)
        return fut
    fut = Future()

    def done(handle) -> None:
        err = handle.exception()
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(buf)
    # completed off the worker thread: a then() callback may issue and wait on a collective
    handle.add_done_callback(lambda h: COMPLETER.submit(lambda: done(h)))
    return fut


__all__ = ["allreduce_hook"]
