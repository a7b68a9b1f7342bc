"""What the watchdog reads of a Communicator, for tests that run many watchdogs in one process:
a flight recorder with ``done`` finished allreduces and, when ``stuck``, one started and never
finished (``.stuck``), and a backend without an error."""
from __future__ import annotations

import types

from hpcring.collectives.recorder import FlightRecorder


class WatchedComm:
    def __init__(self, rank: int, size: int, stuck: bool, done: int = 3, count: int = 4) -> None:
        self.recorder = FlightRecorder(rank, size, "ring", capacity=16)
        self.backend = types.SimpleNamespace(error=None)
        for _ in range(done):
            rec = self.recorder.queue("allreduce", "float32", count, None, 5.0, site="train.py:10 in step")
            FlightRecorder.start(rec)
            FlightRecorder.finish(rec)
        self.stuck = None
        if stuck:
            self.stuck = self.recorder.queue("allreduce", "float32", count, None, 5.0, site="train.py:10 in step")
            FlightRecorder.start(self.stuck)
