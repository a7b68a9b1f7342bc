"""``hvd.elastic.State``, ``ObjectState`` and ``TorchState``: what survives a reset.

The contract (Horovod's ``horovod.common.elastic`` and ``horovod.torch.elastic.state``):

* ``commit()`` = ``save()`` (a copy in host memory) + ``check_host_updates()``;
* ``restore()`` puts back the last saved copy (after a failure: what was half updated is undone);
* ``sync()`` makes every rank hold rank 0's state (rank 0 of the new round is its oldest worker);
* ``check_host_updates()`` raises :class:`HostsUpdatedInterrupt` on every rank at the same call
  when workers wait to join (rank 0's view is broadcast, so all ranks agree);
* ``register_reset_callbacks(fns)``: called after each reset, before the next ``sync()``.

TorchState keeps ``torch.nn.Module``, ``torch.optim.Optimizer`` and :class:`ElasticSampler` values
through handlers (a deep copy of their ``state_dict``; broadcast on sync); every other keyword is an
attribute kept by value (``copy`` semantics of a plain assignment, as Horovod's ObjectState).
"""
from __future__ import annotations

import copy
import queue

import torch

from hpcring.torch.exceptions import HostsUpdatedInterrupt
from hpcring.torch.elastic.sampler import ElasticSampler
import hpcring.torch as hvd
from hpcring.torch.elastic import _runtime
from hpcring.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

NO_UPDATE, REMOVED, ADDED = 0, 1, 2      # Horovod's HostUpdateResult flags


class State:
    """Base of elastic state. ``bcast_object(obj)``: rank 0's ``obj`` on every rank;
    ``get_rank()``: this rank."""

    def __init__(self, bcast_object, get_rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions to call after every reset (e.g. to rescale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a reset (the new round is up): drop the notifications it answers, ``reset()``, then
        the callbacks in the order registered."""
        answered = _runtime.answered_update()
        pending = queue.Queue()
        while not self._host_messages.empty():
            stamp, res = self._host_messages.get()
            if stamp > answered:
                pending.put((stamp, res))
        self._host_messages = pending
        self._last_updated_timestamp = max(self._last_updated_timestamp, answered)
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """A notification: workers were added (2) or removed (1) at ``timestamp``."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state in host memory, then check for host updates (may raise
        HostsUpdatedInterrupt). Commits copy; commit every few batches when the model is large."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt (on every rank alike) when a notification newer than the
        last one answered arrived; ``skip_sync`` when workers were only removed."""
        newest = prev = self._last_updated_timestamp
        update = NO_UPDATE
        while not self._host_messages.empty():
            stamp, res = self._host_messages.get()
            if stamp > newest:
                newest = stamp
                update |= int(res)
        # every rank takes rank 0's view, so that all raise at this same call or none does
        prev, self._last_updated_timestamp, update = self._bcast_object((prev, newest, update))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == REMOVED)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Adjust to the new round before the sync (override; nothing by default)."""


class ObjectState(State):
    """Plain Python values, given as keywords and kept as attributes; ``sync`` broadcasts the
    last committed values from rank 0."""

    def __init__(self, bcast_object, get_rank, **kwargs) -> None:
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class StateHandler:
    """How TorchState keeps one value of a kind it knows (save / restore / sync)."""

    def __init__(self, value) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def set_value(self, value) -> None:
        """A new object assigned to the attribute: it becomes the saved state too."""
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """An object with ``state_dict``/``load_state_dict``: saved as a deep copy of its state dict."""

    def __init__(self, value) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class ModelStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))

    def reset(self) -> None:
        self.value.reset()         # repartition what is left of the epoch over the new ranks


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    return _handler_registry


def set_handler_registry(registry) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler_for(value):
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """A PyTorch training process's state: ``model`` and ``optimizer`` (optional), and any other
    keyword: a Module, Optimizer or ElasticSampler through its handler, anything else by value."""

    def __init__(self, model=None, optimizer=None, **kwargs) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            h = _handler_for(value)
            if h is not None:
                handlers[name] = h
            else:
                plain[name] = value
        self._handlers = handlers
        for name, h in handlers.items():
            setattr(self, name, h.value)
        super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank, **plain)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def reset(self) -> None:
        for h in self._handlers.values():
            if isinstance(h, SamplerStateHandler):
                h.reset()

    def __setattr__(self, name, value) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers and hasattr(self, name):
            handlers[name].set_value(value)
        super().__setattr__(name, value)
