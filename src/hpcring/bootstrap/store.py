"""Authenticated TCP rendezvous store: rank 0 serves, every rank is a client.

One module per concern: ``store_wire`` (protocol, frames, errors; its docstring describes the
wire format), ``store_server`` (:class:`StoreServer`), ``store_client`` (:class:`StoreClient`),
and :mod:`hpcring.bootstrap.auth` (the job secret and the handshake). This module re-exports
them, so ``from hpcring.bootstrap.store import StoreClient`` keeps working.
"""
from __future__ import annotations

from hpcring.bootstrap.auth import load_secret, new_secret_file  # noqa: F401
from hpcring.bootstrap.store_client import StoreClient  # noqa: F401
from hpcring.bootstrap.store_server import StoreServer  # noqa: F401
from hpcring.bootstrap.store_wire import *  # noqa: F401,F403
from hpcring.bootstrap.store_wire import (_DIR_TO_CLIENT, _DIR_TO_SERVER, BootstrapError,  # noqa: F401
                                          recv_exact)
