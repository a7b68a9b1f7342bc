"""Calls on hpcring._native.P2P queues for the native point-to-point tests: post a send or a
receive of a numpy array with the next id, and wait for a request's result."""
from __future__ import annotations

import numpy as np

_ids = iter(range(1, 1 << 30))


def send(box, x, peer, tag=0, timeout=10.0):
    return box.isend(next(_ids), np.ascontiguousarray(x).view(np.uint8), peer, tag, timeout)


def recv(box, y, peer, tag=0, timeout=10.0):
    return box.irecv(next(_ids), y.view(np.uint8), peer, tag, timeout)


def done(req, timeout=10.0):
    """(failed, source, why, hint) once done; fails the test if not done within ``timeout`` s."""
    assert req.wait(timeout), "not done in time"
    return req.result()
