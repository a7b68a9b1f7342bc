"""Fixtures of the in-process tier."""
from __future__ import annotations

import pytest

from helpers.ring import SECRET, topology
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.collectives.api import Communicator


@pytest.fixture
def ranks():
    """make(n, timeout=10, short=True, hosts=None) -> n ring Communicators (threads of this process)
    meeting through a store (``make.port``); ``short`` False sends every message the general way;
    ``hosts``: each rank's host (default: all different)."""
    made = []
    with StoreServer("127.0.0.1", 0, secret=SECRET) as server:
        def make(n: int, timeout: float = 10.0, short: bool = True, hosts: tuple[str, ...] | None = None):
            comms = [Communicator.create(topology(r, n, hosts), StoreClient("127.0.0.1", server.port, SECRET, 10),
                                         SECRET, timeout=timeout) for r in range(n)]
            for c in comms:
                c.short_path = short
            made.extend(comms)
            return comms
        make.port = server.port
        yield make
        for c in made:
            c.close()
