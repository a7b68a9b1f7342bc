"""StoreServer: the store served from a thread of rank 0, composed of loop.py's Loop (with its
listener and op table)."""
from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping

from hpcring.bootstrap.store_server.limits import _fd_limit, ensure_fd_limit
from hpcring.bootstrap.store_server.listener import listen
from hpcring.bootstrap.store_server.loop import Loop
from hpcring.bootstrap.store_wire import DEFAULT_MAX_FRAME, FD_RESERVE, FRAME_TIMEOUT, HANDSHAKE_TIMEOUT
from hpcring.errors import BootstrapError
from hpcring.config import envvars


class StoreServer:
    """Key-value store served from a background thread (one selector loop, non-blocking sockets).

    Contract: binds at construction (raises ``OSError`` if ``port`` is taken so the caller can try
    another), serves until :meth:`close`. Every peer must pass the challenge-response handshake
    before any of its bytes are interpreted; a bad handshake or a frame with a bad MAC or an
    oversized length closes the connection with a log line naming the peer, before parsing.
    ``stats`` counts what happened (for tests and diagnostics).

    ``clients``: connections the job will open (ranks x :data:`CONNECTIONS_PER_RANK`); the soft
    descriptor limit is raised for them (:func:`ensure_fd_limit`: an error when not even one per
    rank of ``ranks`` fits, a warning when only some of the rest do) and the listen backlog is
    sized for them.

    ``initial``: keys the store holds before it accepts anyone (rank 0's world key, which a rank
    reads to tell this store from another step's on a neighbouring port).

    Flood resistance: at most ``max_connections`` open connections (default: what the descriptor
    limit allows, less a reserve); when full, or when accept() fails with EMFILE/ENFILE/ENOBUFS,
    the oldest connection still in its handshake is dropped to make room and accepting pauses with
    exponential back-off (no busy loop). A started frame must be complete within
    ``frame_timeout`` seconds (slowloris). Numeric request fields are checked (a GET timeout must
    be finite and >= 0). Log lines about dropped peers are rate-limited.
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, secret: bytes,
                 max_frame: int = DEFAULT_MAX_FRAME, backlog: int = 1024,
                 max_connections: int | None = None, frame_timeout: float = FRAME_TIMEOUT,
                 clients: int | None = None, ranks: int | None = None,
                 handshake_timeout: float | None = None,
                 initial: Mapping[str, bytes] | None = None) -> None:
        if not secret:
            raise BootstrapError("StoreServer needs a non-empty per-job secret")
        if clients:
            ensure_fd_limit(clients, ranks=ranks, required=ranks)
            backlog = max(backlog, min(clients, 65535))   # the kernel caps it at somaxconn
        self._secret = bytes(secret)
        self.max_frame = max_frame
        self.max_connections = max(8, max_connections or _fd_limit() - FD_RESERVE)
        self.frame_timeout = frame_timeout
        if handshake_timeout is None:          # HPCRING_HANDSHAKE_TIMEOUT, else store_wire's 10 s
            handshake_timeout = envvars.get("HPCRING_HANDSHAKE_TIMEOUT", default=HANDSHAKE_TIMEOUT)
        self.handshake_timeout = float(handshake_timeout)
        lsock = listen(host, port, backlog)
        self.host = host
        self.port = lsock.getsockname()[1]
        self.stats = {"connections": 0, "authenticated": 0, "rejected_handshake": 0,
                      "rejected_frame": 0, "frames": 0, "evicted": 0, "accept_errors": 0,
                      "slow_frame": 0, "bad_request": 0, "peak_connections": 0, "parked": 0}
        self._loop = Loop(lsock, self._secret, address=self.address, stats=self.stats, max_frame=max_frame,
                          max_connections=self.max_connections, frame_timeout=frame_timeout,
                          handshake_timeout=self.handshake_timeout)
        self._ops = self._loop.ops
        self._ops.data.update(initial or {})   # before the first client: nobody sees the store without it
        self._thread = threading.Thread(target=self._loop.run, name=f"hpcring-store:{self.port}", daemon=True)
        self._thread.start()
        # The server is a daemon thread inside rank 0: at interpreter exit it would be frozen
        # mid-batch (e.g. after answering rank 0 but before the other barrier waiters). Stopping it
        # from atexit lets the loop finish the batch it is in and flush its replies first.
        atexit.register(self.close)

    # -- public -----------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def keys(self) -> list[str]:
        """Snapshot of the stored keys (diagnostics and tests; not a wire operation)."""
        return list(self._ops.data)

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection; waits at most ``timeout`` for the thread."""
        atexit.unregister(self.close)
        if not self._loop.stop():
            return
        self._thread.join(timeout)

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
