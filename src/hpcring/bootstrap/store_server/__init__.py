"""The rendezvous store's server: one selector thread in rank 0 (see store_wire for the protocol).

Scale: one thread and one epoll loop serve every connection (no thread per client);
a blocking GET/MGET on keys not yet set is parked in a *wait group* (all requests for the same
key list share one, so 8192 ranks reading the same N keys cost O(N) bookkeeping, not O(N^2)),
and answered when the last key arrives or at its deadline by the timer heap. The process's soft
RLIMIT_NOFILE is raised to what the job needs (:func:`ensure_fd_limit`).

One mechanism a module: limits (descriptors), ratelog, conn (one connection's state), listener
(accept, cap, eviction, back-off), loop (select, timers, handshake and frames, replies), ops (data,
op handlers, wait groups), server (StoreServer), process (StoreServerProcess; ``__main__``: its child).
"""
from hpcring.bootstrap.store_server.limits import CONNECTIONS_PER_RANK, ensure_fd_limit, fd_need
from hpcring.bootstrap.store_server.process import StoreServerProcess
from hpcring.bootstrap.store_server.server import StoreServer

__all__ = ["CONNECTIONS_PER_RANK", "StoreServer", "StoreServerProcess", "ensure_fd_limit", "fd_need"]
