"""``hvd.elastic``: Horovod Elastic's PyTorch API on hpcring.

    import hpcring.torch as hvd
    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state): ...          # state.commit() every few batches
    train(state)

Start the workers with the elastic driver (``python -m hpcring.elastic.driver --np 3 --min-np 2
--max-np 4 -- python train.py``). When a worker dies, a collective on the others raises
HorovodInternalError (the ring's connections break at once; the coordinator also aborts the
round, for a frozen worker); ``run`` restores the last commit, shuts hpcring.torch down, joins the
next round (new ranks and size: the survivors, oldest first, then newcomers) and syncs the state
from the new rank 0. A worker that joins later makes the others raise HostsUpdatedInterrupt at
their next ``commit()``/``check_host_updates()``; they reset without restoring and the newcomer
receives the committed state in the sync. Without the driver (``hpcring run``, ``submit``) the
API works, nothing ever joins, and a HorovodInternalError is raised after ``restore()``: the job
fails and a restart (``--max-restarts``) takes over, as it must with MPI (no ULFM here).
"""
from __future__ import annotations

import functools

from hpcring.elastic.member import ElasticJobError
from hpcring.torch.elastic import _runtime
from hpcring.torch.elastic.sampler import ElasticSampler
from hpcring.torch.elastic.state import (ObjectState, State, StateHandler, TorchState, get_handler_registry,
                                         set_handler_registry)
from hpcring.torch.exceptions import HorovodInternalError, HostsUpdatedInterrupt
import hpcring.torch as hvd


def run(func):
    """Run ``func(state, *args, **kwargs)`` on the current workers, again after every reset,
    until it returns. Before each call the state is synced from rank 0 (not after a removal-only
    HostsUpdatedInterrupt, which keeps every rank's state). No collective may run before the
    decorated function is called: a joining worker's first collectives are the sync's."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        _runtime.listen(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()
                    if not _runtime.enabled():
                        raise           # nothing to rebuild the communicator with: restart the job
                    skip_sync, _runtime.next_reason = False, "error"
                except HostsUpdatedInterrupt as e:
                    skip_sync, _runtime.next_reason = e.skip_sync, "interrupt"
                _reset()
                if skip_sync and _runtime.round_needs_sync():
                    skip_sync = False      # another member failed or is new: all ranks sync alike
                state.on_reset()
        finally:
            _runtime.unlisten(state)
    return wrapper


def _reset() -> None:
    hvd.shutdown()
    hvd.init()


__all__ = ["ElasticJobError", "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "StateHandler", "TorchState", "get_handler_registry", "run", "set_handler_registry"]
