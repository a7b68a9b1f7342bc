"""A ring communicator's connections: its listener and the authenticated connects (:class:`_Links`),
the static set opened at creation or by the first collective, alltoall's others on demand."""
from __future__ import annotations

import logging
import socket
import threading
import time

from hpcring.collectives.handshake import authenticate_connector, authenticate_listener, handshake_timeout
from hpcring.collectives.ring_peers import static_peers
from hpcring.collectives.ring_shm import attach_shm
from hpcring.config import envvars
from hpcring.errors import BootstrapError, CollectiveError, HpcringError

log = logging.getLogger("hpcring.collectives.ring")    # the ring's own logger

try:
    from hpcring import _native
except ImportError:  # pragma: no cover - only without a built extension (RingBackend.create refuses)
    _native = None


# Cut-overs and striping in native/ that an environment variable may override (unset: the
# measured defaults there): variable, the native Comm's attribute.
_NATIVE_ENV = (("HPCRING_RING_STRIPE_MIN", "stripe_min"), ("HPCRING_TWOLEVEL_MIN", "twolevel_min"),
               ("HPCRING_BCAST_TREE_MAX", "bcast_tree_max"), ("HPCRING_RH_CHUNK", "rh_chunk"),
               ("HPCRING_DIRECT_MAX", "direct_max"), ("HPCRING_RING_CMA_MIN", "cma_min"),
               ("HPCRING_RING_CMA_GATHER_MIN", "cma_gather_min"),
               ("HPCRING_RING_CMA_ALLGATHER_MIN", "cma_allgather_min"))


def _advertised_host(topology) -> str:
    if topology.address:
        return topology.address
    try:
        return socket.gethostbyname(topology.host)
    except OSError:
        pass
    if topology.num_nodes == 1 or len(set(topology.hosts)) == 1:
        return "127.0.0.1"
    raise BootstrapError(
        f"rank {topology.rank}: no address to publish for the ring (Topology.address is unset and "
        f"host {topology.host!r} does not resolve)",
        hint="run hpcring.init() (it picks and verifies an interface) or set Topology.address")


class _Missing(Exception):
    """Peers that did not connect (or publish an address) by the setup's deadline."""

    def __init__(self, missing: list[int]) -> None:
        super().__init__(missing)
        self.missing = missing


def _who(ranks: list[int], hosts) -> str:
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)} "
            f"({', '.join(sorted({hosts[r] for r in ranks}))})")


def connect_peer(host: str, port: int, deadline: float, peer: int, peer_host: str) -> socket.socket:
    delay = 0.01
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise BootstrapError(
                    f"ring setup: cannot connect to rank {peer} ({peer_host}) at {host}:{port}: {e}",
                    hint="is that rank alive, and is the address reachable from here?") from None
            time.sleep(delay)
            delay = min(0.5, delay * 2)


class _Links:
    """A communicator's connections: its listener (open for the communicator's life, served by
    the process's shared acceptor, each handshake on a short thread of its own) and what it needs
    to open connections on demand, plus the settings of :meth:`RingBackend.create` the first
    collective needs when it was created ``lazy``."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)
        self.addrs: dict[int, tuple[str, int]] = {}
        self.inbox: dict[tuple[int, int], list[socket.socket]] = {}   # accepted, not yet taken
        self.cond = threading.Condition()
        self.closed = False
        self.handshakes: list[threading.Thread] = []

    def start(self) -> None:
        from hpcring.collectives.mailbox import ACCEPTOR  # deferred: mailbox, p2p (~4 ms) with p2p only
        self.lsock.setblocking(False)
        ACCEPTOR.register(self.lsock, self._on_accept)

    def _on_accept(self, s: socket.socket, addr) -> None:
        t = threading.Thread(target=self._handshake, args=(s, addr), daemon=True,
                             name=f"hpcring-ring-auth:{self.rank}")
        self.handshakes = [x for x in self.handshakes if x.is_alive()] + [t]
        t.start()

    def _handshake(self, s: socket.socket, addr) -> None:
        try:
            s.setblocking(True)
            s.settimeout(handshake_timeout())
            peer, k = authenticate_listener(s, self.secret, f"{self.base}/{self.rank}".encode(), self.size,
                                     self.streams)
            if peer <= self.rank:              # the higher rank of a pair connects
                raise ConnectionError(f"unexpected connection from lower rank {peer}")
        except (OSError, ConnectionError) as e:
            log.warning("ring rank %d: refused connection from %s:%s: %s", self.rank, addr[0], addr[1], e)
            s.close()
            return
        with self.cond:
            q = self.inbox.setdefault((peer, k), [])
            if self.closed or len(q) >= 2:     # a peer opens a pair's connection once per use
                log.warning("ring rank %d: refused a surplus connection from rank %d", self.rank, peer)
                s.close()
                return
            q.append(s)
            self.cond.notify_all()

    def connect(self, need: dict[int, int], deadline: float) -> dict[int, list[socket.socket]]:
        """Open ``need`` (peer -> connections) by ``deadline``: connect to the lower peers as their
        addresses appear (in any order: one late peer must not keep this rank from the others,
        or they would name this rank missing too), take the higher peers' from the acceptor.
        Raises :class:`_Missing` naming the peers that did not come; sockets opened are closed
        on any failure."""
        got: dict[int, list[socket.socket]] = {}
        try:
            self._connect_lower({q: k for q, k in need.items() if q < self.rank}, deadline, got)
            higher = {q: k for q, k in need.items() if q > self.rank}
            with self.cond:
                while True:
                    for q, k in list(higher.items()):
                        if all(self.inbox.get((q, j)) for j in range(k)):
                            got[q] = [self.inbox[(q, j)].pop(0) for j in range(k)]
                            del higher[q]
                    left = deadline - time.monotonic()
                    if not higher or left <= 0:
                        break
                    self.cond.wait(min(left, 1.0))
            if higher:
                raise _Missing(sorted(higher))
        except BaseException:
            for socks in got.values():
                for s in socks:
                    s.close()
            raise
        return got

    def _connect_lower(self, need: dict[int, int], deadline: float, got: dict) -> None:
        todo = [q for q in sorted(need) if q not in self.addrs]
        delay = 0.002
        while todo:               # one round trip per poll for all addresses still missing
            for q, text in zip(list(todo), self.store.multi_check([f"{self.base}/addr/{q}" for q in todo])):
                if text is not None:
                    host, _, port = text.decode().rpartition(":")
                    self.addrs[q] = (host, int(port))
                    todo.remove(q)
            if not todo:
                break
            if time.monotonic() >= deadline:
                raise _Missing(todo)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(0.1, delay * 2)
        for q in sorted(need):
            host, port = self.addrs[q]
            got[q] = socks = []
            for k in range(need[q]):
                s = connect_peer(host, port, deadline, q, self.hosts[q])
                socks.append(s)
                try:
                    s.settimeout(max(0.1, min(handshake_timeout(), deadline - time.monotonic())))
                    authenticate_connector(s, self.secret, f"{self.base}/{q}".encode(), self.rank, k)
                except socket.timeout:          # accepted by its kernel, never answered: stalled
                    raise _Missing([q]) from None
                except (OSError, ConnectionError) as e:
                    raise BootstrapError(
                        f"ring setup: rank {q} ({self.hosts[q]}) at {host}:{port} refused rank "
                        f"{self.rank}: {e}", hint="all ranks must use the same per-job secret") from None

    def close(self) -> None:
        from hpcring.collectives.mailbox import ACCEPTOR  # deferred: mailbox, p2p (~4 ms) with p2p only
        ACCEPTOR.unregister(self.lsock)
        self.lsock.close()
        with self.cond:
            self.closed = True
            socks = [s for q in self.inbox.values() for s in q]
            self.inbox.clear()
        for s in socks:
            s.close()


class RingConnections:
    """Mixed into :class:`~hpcring.collectives.ring.RingBackend`: its connections."""

    # -- connections (at creation, or on the first collective when lazy; alltoall's on demand) ---
    def _connect_static(self, deadline: float) -> None:
        """Open the connections the algorithms use, then build the native Comm (the other
        peers' entries empty). Raises :class:`_Missing` naming the peers that did not come by
        ``deadline``, BootstrapError for any other setup failure; the listener is closed on
        failure."""
        p = self._links
        rank, size, hosts = p.rank, p.size, p.hosts
        need = static_peers(rank, size, hosts, p.shm, p.streams)
        try:
            socks = p.connect(need, deadline)
            fds: list = [None] * size
            for q, ss in socks.items():
                fds[q] = [s.fileno() for s in ss] + [-1] * (p.streams - len(ss))
            try:
                comm = _native.Comm(rank, size, fds, list(hosts), p.timeout, p.sockbuf)
            except BaseException:
                for ss in socks.values():
                    for s in ss:
                        s.close()
                raise
        except BaseException:
            p.close()
            self._links = None
            raise
        for ss in socks.values():          # the Comm owns the descriptors now
            for s in ss:
                s.detach()
        self._static = need
        if p.rd_threshold is not None:
            comm.rd_threshold = int(p.rd_threshold)
        comm.threads = p.threads
        for var, attr in _NATIVE_ENV:
            if envvars.get(var) is not None:           # unset: the measured defaults in native/
                setattr(comm, attr, envvars.get(var))
        if p.shm:
            try:
                attach_shm(comm, p.store, p.secret, p.base, rank, hosts, deadline, job=p.job)
            except BaseException:
                comm.close()
                p.close()
                self._links = None
                raise
        self._native_comm = comm

    def _ensure(self, name: str, timeout: float) -> float:
        """Connect on the first collective (lazy); returns the time left of ``timeout`` for the
        collective itself. A peer that never connects is that collective's missing rank."""
        if self._native_comm is not None:
            return timeout
        with self._setup_lock:
            if self._native_comm is not None:
                return timeout
            if self._setup_error is not None:
                raise CollectiveError(self._setup_error)
            t0 = time.monotonic()
            p = self._links
            try:
                self._connect_static(t0 + timeout)
            except _Missing as e:
                self._setup_error = (
                    f"{name}#1 never joined by {_who(e.missing, p.hosts)}: no ring connection from "
                    f"{'it' if len(e.missing) == 1 else 'them'} within the {timeout:g} s deadline "
                    f"(rank {p.rank} waited)")
                raise CollectiveError(self._setup_error, hint="that rank is late to its first collective, "
                                      "hung or dead: look at its log (hpcring stacks JOB)") from None
            except (HpcringError, OSError, _native.NativeError) as e:
                self._setup_error = f"{name}#1 ring setup failed on rank {p.rank}: {getattr(e, 'message', e)}"
                raise CollectiveError(self._setup_error, hint=getattr(e, "hint", None)) from None
            return max(0.001, timeout - (time.monotonic() - t0))

    @property
    def _comm(self):
        """The native communicator; a lazy one connects here (collectively, with the default
        deadline) when something needs it before the first collective."""
        if self._native_comm is None:
            self._ensure("setup", self._links.timeout if self._links else 1.0)
        return self._native_comm

    def _open(self, nc, need: dict[int, int], deadline: float, name: str) -> None:
        """Connect ``need`` for the collective about to run; a peer that does not come fails the
        communicator (sticky, every connection shut so its other peers stop too) naming it."""
        p = self._links
        try:
            socks = p.connect(need, deadline)
        except _Missing as e:
            msg = (f"{name} never joined by {_who(e.missing, p.hosts)}: no ring connection "
                   f"{'with it' if len(e.missing) == 1 else 'with them'} within the deadline (rank {p.rank} waited)")
            nc.abort(msg)
            raise CollectiveError(msg, hint="that rank is late, hung or dead: look at its log "
                                  "(hpcring stacks JOB)") from None
        except (HpcringError, OSError) as e:
            msg = f"{name} connecting on rank {p.rank} failed: {getattr(e, 'message', e)}"
            nc.abort(msg)
            raise CollectiveError(msg, hint=getattr(e, "hint", None)) from None
        for q, ss in socks.items():
            nc.set_peer(q, [s.fileno() for s in ss])
            for s in ss:
                s.detach()
