"""A rate-limited log for the store's lines about dropped peers."""
from __future__ import annotations

import logging
import time


class _RateLog:
    """At most ``burst`` lines per ``period`` seconds; the rest are counted and summarised once.

    A flood of bad peers must not turn into megabytes of job log (seen: 414,548 lines in 10 s).
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, period: float = 10.0) -> None:
        self._log, self._burst, self._period = logger, burst, period
        self._window, self._count, self._suppressed = 0.0, 0, 0

    def __call__(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._window >= self._period:
            if self._suppressed:
                self._log.warning("store: %d similar messages suppressed in the last %.0fs",
                                  self._suppressed, self._period)
            self._window, self._count, self._suppressed = now, 0, 0
        if self._count < self._burst or not self._log.isEnabledFor(level) or level < logging.INFO:
            self._count += level >= logging.INFO
            self._log.log(level, msg, *args)
        else:
            self._suppressed += 1
