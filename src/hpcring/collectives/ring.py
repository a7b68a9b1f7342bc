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

from hpcring.bootstrap import auth
from hpcring.collectives.handshake import authenticate_connector, authenticate_listener, handshake_timeout
from hpcring.collectives.backends import FLOAT_DTYPES, Backend
from hpcring.collectives.dtypes import DTYPE_CODES, OP_CODES   # checked against the C enums at import
from hpcring.bootstrap.store_wire import StoreTimeoutError
from hpcring.config import envvars
from hpcring.errors import BootstrapError, CollectiveError, HpcringError, UsageError

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


def default_shm_piece(local_ranks: int) -> int:
    """1 MiB per rank on the host, 1-8 MiB: fewer barriers per byte as ranks get more (measured on
    2 cores, 64 MiB: 2 ranks 2 MiB 0.76-1.51 vs 1 MiB 0.50-0.54 GB/s; 4 ranks 2-4 MiB 0.30-0.50 vs
    1 MiB 0.22-0.37 GB/s). The segment holds 2 pieces per rank (8 ranks: 128 MiB of /dev/shm)."""
    return min(8, max(1, local_ranks)) << 20






def node_layout(hosts, rank: int) -> tuple[list[int], list[int] | None]:
    """(ranks on this rank's host, ranks with this rank's local index on every host in order of
    first appearance, or None when hosts differ in rank count: no two-level allreduce then)."""
    local = [r for r in range(len(hosts)) if hosts[r] == hosts[rank]]
    per_node: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        per_node.setdefault(h, []).append(r)
    if len({len(v) for v in per_node.values()}) != 1:
        return local, None
    return local, [v[local.index(rank)] for v in per_node.values()]


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


class HostLayout:
    """The ranks of each host, computed once (O(n)); what :func:`node_layout` says of one rank."""

    def __init__(self, hosts) -> None:
        self.per_node: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            self.per_node.setdefault(h, []).append(r)
        self.nodes = list(self.per_node.values())
        self.node_of = {h: i for i, h in enumerate(self.per_node)}
        self.hosts = hosts
        self.uniform = len({len(v) for v in self.nodes}) == 1

    def local(self, rank: int) -> list[int]:
        return self.per_node[self.hosts[rank]]

    def column_neighbours(self, rank: int) -> tuple[int, ...]:
        """The two-level ring's neighbours of ``rank`` (same local index, next/previous host)."""
        if not self.uniform or len(self.nodes) < 2:
            return ()
        i = self.node_of[self.hosts[rank]]
        li = self.nodes[i].index(rank)
        return (self.nodes[(i + 1) % len(self.nodes)][li], self.nodes[(i - 1) % len(self.nodes)][li])


# Cut-overs and striping in native/ that an environment variable may override (unset: the
# measured defaults there): variable, the native Comm's attribute.
_NATIVE_ENV = (("HPCRING_RING_STRIPE_MIN", "stripe_min"), ("HPCRING_TWOLEVEL_MIN", "twolevel_min"),
               ("HPCRING_BCAST_TREE_MAX", "bcast_tree_max"), ("HPCRING_RH_CHUNK", "rh_chunk"),
               ("HPCRING_DIRECT_MAX", "direct_max"))


def static_peers(rank: int, size: int, hosts, shm: bool, streams: int = 1,
                 layout: HostLayout | None = None) -> dict[int, int]:
    """The peers ``rank``'s collectives other than alltoall use -> connections to each (``streams``
    for the ring passes' neighbours, 1 for the latency-bound algorithms). Symmetric: q is in
    rank's set iff rank is in q's, with the same count, so both sides of a pair agree without a
    word. Must follow native/: allreduce_ring / allgather_ring / reduce_scatter_ring /
    broadcast_pipeline (r +- 1), broadcast_tree (any root: r +- 2^i), barrier (r +- 2^i),
    allreduce_rd and allreduce_rh (fold r^1 below 2 rem, partners v ^ 2^i), allreduce_direct
    (every rank, in a job of at most DIRECT_MAX_RANKS = 3: the ring's neighbours), shared memory (the
    host's ranks: the liveness signal) and allreduce_shm's two-level ring (column neighbours)."""
    out: dict[int, int] = {}

    def add(q: int, k: int = 1) -> None:
        q %= size
        if q != rank:
            out[q] = max(out.get(q, 0), k)

    if size < 2:
        return out
    add(rank + 1, streams)
    add(rank - 1, streams)
    d = 2
    while d < size:
        add(rank + d)
        add(rank - d)
        d *= 2
    p = 1
    while p * 2 <= size:
        p *= 2
    rem = size - p
    if rank < 2 * rem and rank % 2 == 0:
        add(rank + 1)                      # folds into its odd partner and sits out
    else:
        v = rank // 2 if rank < 2 * rem else rank - rem
        if rank < 2 * rem:
            add(rank - 1)
        m = 1
        while m < p:
            pv = v ^ m
            add(pv * 2 + 1 if pv < rem else pv + rem)
            m *= 2
    if shm:
        layout = layout or HostLayout(hosts)
        local = layout.local(rank)
        if len(local) > 1:        # shared memory: every host of a uniform job has >= 2 ranks
            for q in local:
                add(q)
            for q in layout.column_neighbours(rank):
                add(q, streams)
    return out


FULL_MESH_MAX_RANKS = 256          # default budget: no limit up to this many ranks ...
DEFAULT_MAX_CONNECTIONS = 48       # ... and this many connections beyond
UNLIMITED = 1 << 20                # (a rank never holds more than (n - 1) x streams)


def static_bound(size: int, layout: HostLayout, shm: bool, streams: int = 1) -> int:
    """At least every rank's static connections (sum of :func:`static_peers` counts), the same
    on every rank and O(log n) once the layout is known: +-1 and +-2^i (translation invariant),
    log2 p + 1 recursive-doubling partners, the largest host's ranks and two column neighbours.
    Alltoall's window width comes from it, so it must not depend on the rank asking."""
    if size < 2:
        return 0
    offs = {d % size for i in range(size.bit_length()) for d in (1 << i, -(1 << i)) if (1 << i) < size} - {0}
    ring = {1 % size, (size - 1) % size} - {0}
    n = len(offs - ring) + len(ring) * streams + (size.bit_length() - 1) + 1
    if shm:
        most = max(len(v) for v in layout.nodes)
        if most > 1:
            n += most - 1 + (2 * streams if layout.uniform and len(layout.nodes) > 1 else 0)
    return n


def shm_name(secret: bytes, job: str, base: str, host: str) -> str:
    """The POSIX name of a host's shared-memory segment: the same on the ranks of one communicator
    on one host, another for every other job, array task (an array's tasks share the secret and
    may run at once on one host), communicator generation or host."""
    parts = (job, base, host)
    return "/hpcring-" + auth.mac(secret, b"hpcring-ring-v1 shm", *(s.encode() + b"\0" for s in parts)).hex()[:32]


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
        from hpcring.collectives.mailbox import ACCEPTOR
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
                s = RingBackend._connect(host, port, deadline, q, self.hosts[q])
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
        from hpcring.collectives.mailbox import ACCEPTOR
        ACCEPTOR.unregister(self.lsock)
        self.lsock.close()
        with self.cond:
            self.closed = True
            socks = [s for q in self.inbox.values() for s in q]
            self.inbox.clear()
        for s in socks:
            s.close()


class RingBackend(Backend):
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
                self._attach_shm(comm, p.store, p.secret, p.base, rank, hosts, deadline, job=p.job)
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

    @staticmethod
    def _attach_shm(comm, store, secret: bytes, base: str, rank: int, hosts: tuple[str, ...],
                    deadline: float, job: str = "") -> None:
        """Map the host's shared-memory segment (see the module docstring); no-op for a rank
        alone on its host."""
        local, column = node_layout(hosts, rank)
        if len(local) < 2:
            return
        piece = (envvars.get("HPCRING_RING_SHM_PIECE") or default_shm_piece(len(local))) // 64 * 64
        name = shm_name(secret, job, base, hosts[rank])
        leader = local[0]
        try:
            if rank == leader:
                _native.shm_unlink(name)      # a leftover of this very job's earlier attempt
                comm.shm_attach(name, True, local, column, piece)
                store.set(f"{base}/shm/created/{leader}", b"1")
            else:
                store.get(f"{base}/shm/created/{leader}", timeout=max(0.1, deadline - time.monotonic()))
                comm.shm_attach(name, False, local, column, piece)
            store.set(f"{base}/shm/mapped/{rank}", b"1")
            store.gather([f"{base}/shm/mapped/{r}" for r in local], timeout=max(0.1, deadline - time.monotonic()))
        except _native.NativeError as e:
            raise BootstrapError(f"ring setup: rank {rank} ({hosts[rank]}): shared memory: {e}",
                                 hint="check /dev/shm (size, permissions), or turn shared memory "
                                      "off on every rank with HPCRING_RING_SHM=0") from None
        except StoreTimeoutError as e:
            raise BootstrapError(f"ring setup: rank {rank} ({hosts[rank]}): the ranks of this host "
                                 f"did not all map the shared-memory segment in time "
                                 f"(missing: {', '.join(e.missing or [])})",
                                 hint="a rank of this host did not start or failed; see its log") from None
        finally:
            _native.shm_unlink(name)          # on every path: no name outlives the setup

    @staticmethod
    def _connect(host: str, port: int, deadline: float, peer: int, peer_host: str) -> socket.socket:
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
        recorder's ``_native.Flight``; issue 23's per-call path). False, with nothing done or
        recorded, until the lazy setup has run (the caller records and calls :meth:`allreduce`).
        A failure raises allreduce's errors, with ``.seq`` the failed record's."""
        nc = self._native_comm
        if nc is None:
            return False
        try:
            _N.allreduce_rec(nc, flight, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)
        except _native.NativeError as e:
            err = _translate(e)
            err.seq = getattr(e, "seq", None)
            raise err from None
        except ValueError as e:
            raise UsageError(str(e)) from None
        return True

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
        if self._links is None or nc.failed or (nc.shm is not None and nc.shm[1] == 1):
            # every connection given (tests), already failed (C reports it), or one host's memory
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
                    from hpcring.collectives.mailbox import Mailbox
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
