"""Ring backend: the compiled collectives in native/ over authenticated TCP connections.

Connection setup (all Python; the C library receives connected, authenticated descriptors):

1. Generation: every rank does ``store.add(f"{prefix}/gen/{rank}", 1)``; the n-th communicator a
   rank creates has generation n on every rank, so keys of different communicators never clash.
2. Address exchange: each rank listens on its ``Topology.address`` (or 0.0.0.0), publishes
   ``host:port`` under ``{prefix}/{gen}/addr/{rank}`` and reads everybody else's.
3. Connections on demand: a rank connects only to the peers its algorithms use
   (:func:`static_peers`: ring neighbours, the power-of-two distances of the binomial tree and
   the dissemination barrier, its recursive-doubling partners, the ranks of its host when they
   share memory, its two-level ring neighbours), about 2 log2 n + ranks per host, not n - 1. The
   set is symmetric (q is in p's iff p is in q's), so both sides of a pair know it: the higher
   rank connects, the lower accepts (its listener stays open for the communicator's life, on the
   process's shared acceptor). Alltoall, the one collective that needs every peer, opens the
   others in windows of distances under its deadline and closes them again within the budget
   (:meth:`RingBackend.alltoall`, HPCRING_RING_MAX_CONNECTIONS). Each connection is
   authenticated with the job secret before anything is parsed (mutual HMAC-SHA256
   challenge-response, :mod:`hpcring.collectives.handshake`):

   ``ctx`` is the store prefix, the generation and the listener's rank, so a proof for one
   communicator or rank is worthless for another. A connection that fails authentication is
   closed and logged; the listener keeps waiting for the real peer until the deadline.

Striping: with ``streams`` k > 1 the ring neighbours get k such connections (connection index
k in the handshake; the other peers carry latency-bound algorithms on connection 0 only) and the native ring passes stripe each chunk over them, driven by ``threads`` I/O
threads (native/ring_pass.c). Both come from the arguments, else HPCRING_RING_STREAMS /
HPCRING_RING_THREADS (a site sets them with ``fabric.ring_streams`` / ``fabric.ring_threads``),
else the measured defaults below; every rank must use the same values.

Shared memory: ranks with the same entry in ``Topology.hosts`` also share a POSIX shared-memory
segment (native/transport_shm.h) through which their collectives run (all of them on one node;
the two-level allreduce / reduce-scatter across nodes). The name is derived from the job secret,
the job (its id and array task: an array's tasks share the secret and may run at once on one
host), the generation and the host (:func:`shm_name`); the node's first rank creates it (O_EXCL,
mode 0600), the others map it, and every rank unlinks the name as soon as all have mapped it (or
on any setup failure), so no segment outlives the job whatever kills it. The ranks of a host stay
connected over TCP: the connection is the liveness signal (EOF = the peer died).

Payload bytes after the handshake are not MACed (same trust model as Gloo and NCCL: peers are
authenticated, the network path is trusted).
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np

from hpcring.collectives.arrays import _DT2TAG
from hpcring.collectives.backends import FLOAT_DTYPES, Backend
from hpcring.collectives.dtypes import DTYPE_CODES, OP_CODES   # checked against the C enums at import
from hpcring.collectives.ring_links import _NATIVE_ENV, RingConnections, _Links, _Missing, _advertised_host
from hpcring.collectives.ring_peers import (DEFAULT_MAX_CONNECTIONS, FULL_MESH_MAX_RANKS, UNLIMITED, HostLayout,
                                            node_layout, static_bound, static_peers)
from hpcring.collectives.ring_shm import default_shm_piece, shm_name
from hpcring.config import envvars
from hpcring.errors import BootstrapError, CollectiveError, UsageError

log = logging.getLogger("hpcring.collectives.ring")

try:
    from hpcring import _native
    _N = _native.Comm          # unbound methods: _call passes the (possibly just connected) Comm
except ImportError as e:  # pragma: no cover - only without a built extension
    _native = None
    _IMPORT_ERROR = e


# Measured on the 2-core dev machine (docs/collectives.md "Striping"): extra streams and threads
# only add switching when every core already runs a rank, so the defaults stay 1/1 there
# (HPCRING_RING_STREAMS / HPCRING_RING_THREADS in the registry). On a node with spare cores
# (cores >= 2 x ranks per node) raise both, e.g. 4 and 2, and re-measure with `hpcring bench`.
MAX_STREAMS = 16      # HR_MAX_STREAMS in native/hr_internal.h


def _translate(e: Exception) -> CollectiveError:
    msg = str(e)
    if "mismatched collective" in msg or "out of step" in msg:
        hint = "every rank must call the same collectives in the same order with the same sizes and dtypes"
    elif "timed out" in msg:
        hint = ("the peer is slow, hung or dead: look at its log; raise the deadline with timeout=, "
                "Communicator(timeout=) or HPCRING_TIMEOUT")
    else:
        hint = "a peer died or closed its connection: look at its log (the first failing rank is the cause)"
    return CollectiveError(msg, hint=hint)


class RingBackend(RingConnections, Backend):
    """Compiled ring/recursive-doubling collectives over TCP (host memory)."""

    name = "ring"
    device = "cpu"

    def __init__(self, comm, hosts: tuple[str, ...], links: _Links | None = None) -> None:
        self._native_comm = comm
        self.hosts = tuple(hosts)
        self._links = links                       # None: comm came with every connection it needs
        self._static: dict[int, int] = {}         # peer -> connections the algorithms always use
        self._extra: dict[int, int] = {}          # alltoall's other peers -> window that last used them
        self._windows = 0                         # alltoall windows run (the same on every rank)
        self._plan: tuple[int, bool] | None = None   # (distances per window, keep all), once
        self._setup_error: str | None = None
        self._setup_lock = threading.Lock()
        self._p2p_args: dict | None = None        # what the point-to-point mailbox needs (create)
        self._mailbox = None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, topology, store, secret: bytes | str, timeout: float | None = None, *,
               prefix: str = "hpcring/ring", conns_per_peer: int | None = None,
               sockbuf: int | None = None, rd_threshold: int | None = None,
               threads: int | None = None, shm: bool | None = None, lazy: bool = False,
               max_connections: int | None = None) -> "RingBackend":
        """Exchange addresses through ``store`` and open the authenticated connections the
        algorithms use (:func:`static_peers`; alltoall opens the rest on demand, keeping at most
        ``max_connections``, None: env HPCRING_RING_MAX_CONNECTIONS).

        ``timeout`` bounds the whole setup and is the default deadline of every collective
        (None: HPCRING_TIMEOUT or 300 s). ``sockbuf`` sets SO_SNDBUF/SO_RCVBUF (None: env
        HPCRING_SOCKBUF or the kernel's autotuning). ``rd_threshold``: allreduce messages below
        this many bytes use recursive doubling (None: env HPCRING_RD_THRESHOLD or the measured
        default). ``conns_per_peer`` (streams) and ``threads`` stripe the ring passes (None: env
        HPCRING_RING_STREAMS / HPCRING_RING_THREADS or 1). ``shm``: shared memory between the
        ranks of a host (None: env HPCRING_RING_SHM or on). Raises BootstrapError when peers cannot
        be reached or authenticated in time.

        ``lazy=True`` (what :meth:`Communicator.create` asks for) only listens and publishes the
        address here; the connections are opened by the first collective, under that collective's deadline,
        and a peer that does not come is reported like one late to any later collective
        (``allreduce#1: ... never joined``, a CollectiveError the watchdog diagnoses) instead of a
        bootstrap error at another deadline.
        """
        if _native is None:
            raise BootstrapError(f"hpcring._native is not built: {_IMPORT_ERROR}",
                                 hint="pip install . (or python setup.py build_ext --inplace)")
        if isinstance(secret, str):
            secret = secret.encode()
        if not secret:
            raise BootstrapError("the ring needs the non-empty per-job secret")
        timeout = envvars.collective_timeout(timeout)
        if sockbuf is None:
            sockbuf = envvars.get("HPCRING_SOCKBUF")
        if rd_threshold is None:
            rd_threshold = envvars.get("HPCRING_RD_THRESHOLD")
        for var, _attr in _NATIVE_ENV:
            envvars.get(var)               # a bad value is refused here, before any connection
        if conns_per_peer is None:
            conns_per_peer = envvars.get("HPCRING_RING_STREAMS")
        if threads is None:
            threads = envvars.get("HPCRING_RING_THREADS")
        if shm is None:
            shm = envvars.get("HPCRING_RING_SHM")
        if max_connections is None:
            max_connections = envvars.get("HPCRING_RING_MAX_CONNECTIONS")
        if max_connections is None:     # unset: no limit in a small job (a reconnect costs ~70 us per
            # peer per alltoall, measured), a large one stays within descriptors (docs/scale.md)
            max_connections = UNLIMITED if topology.size <= FULL_MESH_MAX_RANKS else DEFAULT_MAX_CONNECTIONS
        if not (1 <= conns_per_peer <= MAX_STREAMS and 1 <= threads <= MAX_STREAMS):
            raise UsageError(f"ring streams ({conns_per_peer}) and threads ({threads}) must be 1..{MAX_STREAMS}")
        rank, size = topology.rank, topology.size
        hosts = tuple(topology.hosts) if len(topology.hosts) == size else tuple(f"rank{r}" for r in range(size))
        if size == 1:
            comm = _native.Comm(0, 1, [None], list(hosts), timeout)
            return cls(comm, hosts)

        gen = store.add(f"{prefix}/gen/{rank}", 1)
        base = f"{prefix}/{gen}"
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.bind((topology.address or "0.0.0.0", 0))
            lsock.listen(max(16, size * conns_per_peer))
            port = lsock.getsockname()[1]
            address = _advertised_host(topology)
        except BaseException:
            lsock.close()
            raise
        p = _Links(rank=rank, size=size, hosts=hosts, store=store, secret=secret, base=base, lsock=lsock,
                   streams=conns_per_peer, threads=threads, timeout=timeout, sockbuf=sockbuf,
                   rd_threshold=rd_threshold, shm=shm, budget=max_connections,
                   job=f"{topology.job_id or ''}/{envvars.get('HPCRING_ARRAY_TASK')}")
        try:
            p.start()
            store.set(f"{base}/addr/{rank}", f"{address}:{port}".encode())
        except BaseException:
            p.close()
            raise
        be = cls(None, hosts, p)
        be._p2p_args = dict(rank=rank, size=size, hosts=hosts, store=store, secret=secret, base=base,
                            address=address, bind=topology.address)
        try:            # point-to-point listens from the start: a send never waits for the receiver to act
            be._box()
        except BaseException:
            p.close()
            raise
        if not lazy:
            try:
                be._connect_static(time.monotonic() + timeout)
            except _Missing as e:
                raise BootstrapError(
                    f"ring setup: rank {rank} got no authenticated connection from rank(s) "
                    f"{', '.join(f'{m} ({hosts[m]})' for m in e.missing)} within {timeout:.1f} s",
                    hint="those ranks did not start, crashed, or cannot reach this host's address") from None
        return be

    # -- Backend ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._native_comm.rank if self._native_comm is not None else self._links.rank

    @property
    def size(self) -> int:
        return self._native_comm.size if self._native_comm is not None else self._links.size

    @property
    def error(self) -> str | None:
        return self._native_comm.error if self._native_comm is not None else self._setup_error

    def describe(self) -> str:
        """The transport in use, for benchmark tables."""
        shm = self._comm.shm
        where = "tcp only" if shm is None else (
            f"shared memory ({shm[0]} ranks on this host)" + (
                "" if shm[1] == 1 else f", two-level allreduce over {shm[1]} hosts" if shm[1] else
                ", hosts differ in rank count: tcp across hosts"))
        c = self.connections()
        return (f"ring: {where}; {self._comm.streams} stream(s)/peer, {self._comm.threads} I/O thread(s); "
                f"{c['descriptors']} connection(s) to {len(c['peers'])} of {self.size - 1} peers")

    def link_waits(self) -> list[tuple[int, float, float]]:
        """``(peer, send_wait_s, recv_wait_s)`` per ring peer so far: the ring passes' time with a
        send to that peer blocked (its link would not take more) and waiting to receive from it
        (native/ring_pass.c); empty before the ring connects. For the straggler watcher."""
        c = self._native_comm
        return c.links() if c is not None else []

    def connections(self) -> dict:
        """This rank's TCP connections to its peers now: ``peers`` (sorted ranks connected),
        ``descriptors`` (connections, all streams: the descriptors the Comm holds), ``static``
        (peers the algorithms always use), ``extra`` (alltoall's peers kept open), ``budget``
        (HPCRING_RING_MAX_CONNECTIONS; None for a communicator built on given descriptors).
        The listener is one more descriptor while the communicator is open."""
        c = self._comm
        return {"peers": c.peers(), "descriptors": c.descriptors, "static": len(self._static),
                "extra": len(self._extra), "budget": self._links.budget if self._links else None}

    @property
    def rd_threshold(self) -> int:
        return self._comm.rd_threshold

    @rd_threshold.setter
    def rd_threshold(self, value: int) -> None:
        self._comm.rd_threshold = int(value)

    @property
    def rh_chunk(self) -> int:
        """Allreduce from ``rd_threshold`` up: recursive halving/doubling while bytes per rank are
        below this, the ring from there (native/allreduce.c; every rank must agree)."""
        return self._comm.rh_chunk

    @rh_chunk.setter
    def rh_chunk(self, value: int) -> None:
        self._comm.rh_chunk = int(value)

    @property
    def direct_max(self) -> int:
        """Allreduce on at most ``_native.DIRECT_MAX_RANKS`` ranks: one round of direct exchange
        while the bytes each rank sends, (size-1) x the message, are at most this (0: never;
        native/allreduce.c; every rank must agree)."""
        return self._comm.direct_max

    @direct_max.setter
    def direct_max(self, value: int) -> None:
        self._comm.direct_max = int(value)

    def _call(self, name, fn, *args):
        args = (*args[:-1], self._ensure(name, args[-1]))       # the last argument is the deadline
        try:
            fn(self._native_comm, *args)
        except _native.NativeError as e:
            raise _translate(e) from None
        except ValueError as e:
            raise UsageError(str(e)) from None

    def allreduce(self, sendbuf, recvbuf, dtype, op, timeout):
        if op == "avg" and dtype not in FLOAT_DTYPES:
            raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
        nc = self._native_comm
        if nc is None:                  # the lazy setup first (_call)
            self._call("allreduce", _N.allreduce, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)
            return
        try:                            # _call's work without its argument repacking (hot path)
            _N.allreduce(nc, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)
        except _native.NativeError as e:
            raise _translate(e) from None
        except ValueError as e:
            raise UsageError(str(e)) from None

    def allreduce_rec(self, flight, sendbuf, recvbuf, dtype, op, timeout) -> bool:
        """allreduce with its flight record written in C, in the same call (``flight``: the
        recorder's ``_native.Flight``; the per-call path). False, with nothing done or
        recorded, until the lazy setup has run (the caller records and calls :meth:`allreduce`).
        A failure raises allreduce's errors, with ``.seq`` the failed record's."""
        nc = self._native_comm
        if nc is None:
            return False
        try:
            _N.allreduce_rec(nc, flight, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)
        except (_native.NativeError, ValueError) as e:
            raise self.fast_error(e) from None
        return True

    def fast_call(self, flight, general):
        """The whole short path in one C call (``Comm.short``; fastpath.py ``_fast_try``) for a
        numpy array, armed with this communicator's flight ring and ``general`` (its answer for
        whatever it leaves to Python); None before the lazy setup."""
        nc = self._native_comm
        if nc is None:
            return None
        nc.short_setup(flight, np.ndarray, np.empty, {dt: DTYPE_CODES[tag] for dt, tag in _DT2TAG.items()},
                       dict(OP_CODES), general, self._a2a_whole())
        return nc.short

    @staticmethod
    def fast_error(e: BaseException) -> BaseException:
        """What the short path raises for the exception ``e`` of a native recorded call
        (``fast_call``'s, :meth:`allreduce_rec`): a CollectiveError with the
        failed record's ``seq`` kept, a UsageError for a ValueError, anything else as it is."""
        if _native is not None and isinstance(e, _native.NativeError):
            err = _translate(e)
            err.seq = getattr(e, "seq", None)
            return err
        if isinstance(e, ValueError):
            return UsageError(str(e))
        return e

    def allgather(self, sendbuf, recvbuf, dtype, timeout):
        self._call("allgather", _N.allgather, sendbuf, recvbuf, DTYPE_CODES[dtype], timeout)

    def reduce_scatter(self, sendbuf, recvbuf, dtype, op, timeout):
        if op == "avg" and dtype not in FLOAT_DTYPES:
            raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
        self._call("reduce_scatter", _N.reduce_scatter, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)

    def broadcast(self, buf, root, dtype, timeout):
        self._call("broadcast", _N.broadcast, buf, DTYPE_CODES[dtype], root, timeout)

    def alltoall(self, sendbuf, recvbuf, dtype, timeout):
        timeout = self._ensure("alltoall", timeout)
        nc = self._native_comm
        if self._a2a_whole() or nc.failed or (nc.shm is not None and nc.shm[1] == 1):
            # every connection there, already failed (C reports it), or one host's memory
            self._call("alltoall", _N.alltoall, sendbuf, recvbuf, DTYPE_CODES[dtype], timeout)
            return
        deadline = time.monotonic() + timeout
        width, keep_all = self._alltoall_plan()
        n, r = self.size, self.rank
        last = n // 2 + 1
        if width < last - 1:
            sendbuf = bytes(memoryview(sendbuf))  # later windows read it after earlier ones wrote (in place)
        for d0 in range(1, last, width):
            d1 = min(last, d0 + width)
            need = {(r + s * d) % n for d in range(d0, d1) for s in (1, -1)} - {r}
            extra = need - self._static.keys()
            if not keep_all:       # symmetric: q drops r exactly when r drops q (same windows)
                for q in [q for q in self._extra if q not in extra]:
                    nc.drop_peer(q)
                    del self._extra[q]
            missing = {q: 1 for q in extra if q not in self._extra}
            if missing:
                self._open(nc, missing, deadline, f"alltoall#{nc.seq + (d0 == 1)}")
            for q in extra:
                self._extra[q] = self._windows
            self._windows += 1
            self._call("alltoall", lambda c, *a: _N.alltoall(c, *a, d0, d1), sendbuf, recvbuf,
                       DTYPE_CODES[dtype], max(0.001, deadline - time.monotonic()))

    def _a2a_whole(self) -> bool:
        """Whether alltoall runs in one native call, every peer connected: connections given
        (tests), or every other rank one the algorithms keep anyway (up to 3 ranks, where alltoall
        is one round of direct exchange, native/direct_others.c)."""
        return self._links is None or len(self._static) >= self.size - 1

    def _alltoall_plan(self) -> tuple[int, bool]:
        """(distances per alltoall window, whether every connection fits the budget), the same on
        every rank: the budget less a bound of every rank's static connections (each window
        needs 2 connections per distance)."""
        if self._plan is None:
            p, n = self._links, self.size
            room = max(2, p.budget - static_bound(n, HostLayout(p.hosts), p.shm, p.streams))
            if room >= n - 1:
                self._plan = (n // 2, True)
            else:
                self._plan = (max(1, room // 2), False)
        return self._plan

    def barrier(self, timeout):
        self._call("barrier", _N.barrier, timeout)

    # -- point-to-point (hpcring.collectives.mailbox) --------------------------------------------
    def _box(self):
        if self._p2p_args is None:
            raise UsageError("point-to-point needs a ring communicator made by Communicator.create / "
                             "RingBackend.create (it meets its peers through the store)")
        if self._mailbox is None:
            with self._setup_lock:
                if self._mailbox is None:
                    from hpcring.collectives.mailbox import Mailbox  # deferred: mailbox, p2p (~4 ms) on first p2p use
                    self._mailbox = Mailbox(**self._p2p_args)
        return self._mailbox

    def p2p_send(self, buf, peer: int, tag: int, timeout: float, record=None):
        """Send ``buf`` (1-D uint8) to ``peer``; a :class:`~hpcring.collectives.p2p.Request`."""
        return self._box().send(buf, peer, tag, timeout, record)

    def p2p_recv(self, buf, peer: int | None, tag: int, timeout: float, record=None):
        """Receive into ``buf`` from ``peer`` (None: any rank); the request's result is the source."""
        return self._box().recv(buf, peer, tag, timeout, record)

    def abort(self, message: str) -> None:
        """Fail this communicator from any thread (elastic training: its round is lost): a
        collective in progress returns with ``message`` (CollectiveError), and so does every later
        one; the peers' connections are shut, so they fail at once too. A communicator that has
        not connected yet refuses to."""
        nc = self._native_comm
        if nc is None:          # no lock: a lazy setup holds it while it waits for its peers
            self._setup_error = self._setup_error or message
            return
        try:
            nc.abort(message)
        except Exception:  # noqa: BLE001 - closed meanwhile: nothing left to abort
            pass

    def close(self) -> None:
        if self._mailbox is not None:
            self._mailbox.close()
            self._mailbox = None
        if self._native_comm is not None:
            self._native_comm.close()
        if self._links is not None:
            self._links.close()
            self._links = None


__all__ = ["RingBackend", "MAX_STREAMS", "DTYPE_CODES", "OP_CODES", "HostLayout", "node_layout", "static_peers",
           "static_bound", "FULL_MESH_MAX_RANKS", "DEFAULT_MAX_CONNECTIONS", "UNLIMITED", "default_shm_piece",
           "shm_name"]
