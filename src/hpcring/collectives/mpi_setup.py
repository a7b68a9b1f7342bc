"""MPI's start and end for the MPI backend: importing mpi4py, the ranks' meeting before MPI_Init,
leaving without MPI_Finalize once a collective is stuck."""
from __future__ import annotations

import os
import sys
import time

from hpcring.errors import CollectiveError, HpcringError
from hpcring.ranks import rank_ranges


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise CollectiveError(f"the 'mpi' backend needs mpi4py, which does not import here: {e}",
                              hint="pip install mpi4py (against the cluster's MPI), or use backend='ring'") from None
    return MPI


def _all_arrived(store, topology, timeout: float, key: str = "hpcring/mpi/arrived") -> None:
    """Every rank of ``topology`` reached MPI setup within ``timeout`` s, else CollectiveError
    naming the ranks (and hosts) that did not.

    The last rank to arrive sets one key every rank waits on: the store answers all waiters at
    once, and no rank needs the store afterwards -- rank 0 serves it from a thread, which
    MPI_Init (holding the GIL until every rank has called it) would starve."""
    store.set(f"{key}/{topology.rank}", b"1")
    if store.add(key, 1) >= topology.size:
        store.set(f"{key}/all", b"1")
    try:
        store.get(f"{key}/all", timeout=timeout)
        if topology.rank != 0:
            store.add(f"{key}/ack", 1)
            return
        # rank 0 serves the store: it enters MPI_Init only once every rank has its answer (the
        # answers go out one by one, and MPI_Init may starve the store thread of the GIL)
        end = time.monotonic() + timeout
        while store.add(f"{key}/ack", 0) < topology.size - 1:
            if time.monotonic() > end:
                raise CollectiveError("MPI setup: not every rank acknowledged the meeting within "
                                      f"{timeout:g} s (rank 0 waited)")
            time.sleep(0.005)
        return
    except HpcringError:
        pass
    try:                 # a timed-out client is closed (its answer may still come): ask on a new one
        probe = type(store)(store.host, store.port, store._secret, timeout=5.0)
        missing = [r for r in range(topology.size) if probe.check(f"{key}/{r}") is None]
        probe.close()
    except (HpcringError, AttributeError, TypeError):
        missing = []
    who = (f"rank{'s' if len(missing) > 1 else ''} {rank_ranges(missing)} "
           f"({', '.join(sorted({topology.hosts[r] for r in missing if r < len(topology.hosts)}))})"
           if missing else "some rank")
    raise CollectiveError(f"MPI setup: {who} never reached it within {timeout:g} s (rank {topology.rank} waited)",
                          hint="those ranks did not start, crashed or hang before their first collective: "
                               "see their logs (hpcring logs JOB --rank R)")


_SKIP_FINALIZE: list = []


def _skip_finalize_at_exit() -> None:
    """A collective is stuck (it cannot be cancelled): MPI_Finalize, which mpi4py runs after the
    interpreter's atexit handlers, would wait for it forever and the rank would never exit (seen on
    the dev cluster: a rank that never started kept its peers alive until the time limit). So at
    interpreter exit the process ends with code 1 without finalizing; this handler, registered
    last, runs first: the others (the store's linger, exit records) would wait on peers too.
    Results, status files and logs are written before interpreter exit."""
    if _SKIP_FINALIZE:
        return
    _SKIP_FINALIZE.append(True)
    import atexit

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.write("hpcring: MPI communicator is dead (a collective timed out): exiting without "
                         "MPI_Finalize, which would hang\n")
        sys.stderr.flush()
        os._exit(1)
    atexit.register(leave)
