"""The watchdog's store keys, bounds and environment settings: one place for the values its
paths (the tree's, the store's, the ending) share."""
from __future__ import annotations

import logging
import os

EXIT_CODE = 1
GRACE_ENV, ON_FAILURE_ENV = "HPCRING_DIAG_GRACE", "HPCRING_ON_FAILURE"
TRIGGER, REPORT, ADDR = "diag/trigger", "diag/report", "diag/addr/"
GRACE_STRETCH = 3            # the reporter waits at most this many graces while snapshots still arrive
PUBLISH_TIMEOUT = 5.0        # how long start() may wait for the store to publish our address
JITTER_RANKS = 256           # above this many ranks a failing rank waits up to JITTER_MAX_S for a trigger ...
JITTER_MAX_S = 1.0           # ... (scaled by n / 4096) before it opens a store connection of its own
CLAIM_TIMEOUT = 5.0          # a claim of the trigger on the session's connection (as a new one's connect)
ACK_TIMEOUT = 5.0            # abort mode: how long a rank waits for its subtree's acknowledgements
GROUP_SPAN = 64              # a rank heading a subtree of this many publishes it to the store itself

log = logging.getLogger("hpcring.diagnostics.watchdog")


def grace_default() -> float:
    try:
        return max(0.5, float(os.environ.get(GRACE_ENV, "5")))
    except ValueError:
        return 5.0


def abort_default() -> bool:
    return os.environ.get(ON_FAILURE_ENV, "abort").strip().lower() != "raise"
