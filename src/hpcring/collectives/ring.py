"""Ring backend: the compiled collectives in native/ over authenticated TCP connections.

Connection setup (all Python; the C library receives connected, authenticated descriptors):

1. Generation: every rank does ``store.add(f"{prefix}/gen/{rank}", 1)``; the n-th communicator a
   rank creates has generation n on every rank, so keys of different communicators never clash.
2. Address exchange: each rank listens on its ``Topology.address`` (or 0.0.0.0), publishes
   ``host:port`` under ``{prefix}/{gen}/addr/{rank}`` and reads everybody else's.
3. Full mesh: rank i connects to every j < i and accepts from every j > i (in a thread, so the
   two happen at once). Each connection is authenticated with the job secret before anything is
   parsed (mutual HMAC-SHA256 challenge-response, :func:`_auth_listener` / :func:`_auth_connector`):

   * listener -> connector: ``b"HRR1" + Nl`` (32 random bytes);
   * connector -> listener, fixed 76 bytes: ``Nc + HMAC(secret, "hpcring-ring-v1 connect" + ctx +
     Nl + Nc + i + k) + i + k`` (u32 rank i, u32 connection index k); the listener reads exactly
     76 bytes and checks the MAC before it looks at i or k;
   * listener -> connector: ``HMAC(secret, "hpcring-ring-v1 accept" + ctx + Nl + Nc + i + k + j)``.

   ``ctx`` is the store prefix, the generation and the listener's rank, so a proof for one
   communicator or rank is worthless for another. A connection that fails authentication is
   closed and logged; the listener keeps waiting for the real peer until the deadline.

Striping: with ``streams`` k > 1 every peer pair gets k such connections (connection index k in
the handshake) and the native ring passes stripe each chunk over them, driven by ``threads`` I/O
threads (native/ring_pass.c). Both come from the arguments, else HPCRING_RING_STREAMS /
HPCRING_RING_THREADS (a site sets them with ``fabric.ring_streams`` / ``fabric.ring_threads``),
else the measured defaults below; every rank must use the same values.

Shared memory: ranks with the same entry in ``Topology.hosts`` also share a POSIX shared-memory
segment (native/transport_shm.h) through which their collectives run (all of them on one node;
the two-level allreduce / reduce-scatter across nodes). The name is derived from the job secret,
the generation and the host; the node's first rank creates it (O_EXCL, mode 0600), the others map
it, and every rank unlinks the name as soon as all have mapped it (or on any setup failure), so
no segment outlives the job whatever kills it. The TCP mesh stays: it is the liveness signal
(EOF = the peer died) and carries barrier and alltoall.

Payload bytes after the handshake are not MACed (same trust model as Gloo and NCCL: peers are
authenticated, the network path is trusted).
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from hpcring.bootstrap import auth
from hpcring.collectives.backends import DTYPES, FLOAT_DTYPES, OPS, Backend
from hpcring.bootstrap.store import StoreTimeoutError
from hpcring.config import envvars
from hpcring.errors import BootstrapError, CollectiveError, HpcringError, UsageError

log = logging.getLogger("hpcring.collectives.ring")

try:
    from hpcring import _native
    _N = _native.Comm          # unbound methods: _call passes the (possibly just connected) Comm
except ImportError as e:  # pragma: no cover - only without a built extension
    _native = None
    _IMPORT_ERROR = e

DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}      # must match enum hr_dtype
OP_CODES = {name: i for i, name in enumerate(OPS)}            # must match enum hr_redop

_U32x2 = struct.Struct(">II")   # (rank, connection index): the handshake's extra field
HANDSHAKE_TIMEOUT = 10.0

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


def default_timeout() -> float:
    """HPCRING_TIMEOUT (seconds) or the registry's default (hpcring.config.envvars)."""
    return envvars.get("HPCRING_TIMEOUT")






def _auth_connector(sock: socket.socket, secret: bytes, ctx: bytes, rank: int, conn: int) -> None:
    """Connector side of the handshake (hpcring.bootstrap.auth, bound to the communicator's
    context, the MAC covering our rank and connection index); raises ConnectionError when the
    listener refuses us or cannot prove it knows the secret."""
    try:
        nl = auth.RING.read_hello(sock)
    except auth.NotAPeer:
        raise ConnectionError("the listener is not an hpcring ring endpoint (bad magic)") from None
    try:
        auth.RING.prove(sock, secret, nl, ctx, _U32x2.pack(rank, conn))
    except auth.BadProof:
        raise ConnectionError("the listener could not prove it knows the job secret") from None
    except ConnectionError:
        raise ConnectionError("the listener refused authentication (different job secret?)") from None


def _auth_listener(sock: socket.socket, secret: bytes, ctx: bytes, size: int, nconn: int) -> tuple[int, int]:
    """Listener side: returns the authenticated (rank, connection index) of the connector.
    Raises ConnectionError on a bad proof; nothing the peer sent is interpreted before the MAC
    over the fixed-size frame has been verified."""
    try:
        nl, nc, ids = auth.RING.accept(sock, secret, ctx)
    except auth.BadProof:
        raise ConnectionError("peer failed authentication (wrong job secret)") from None
    peer, conn = _U32x2.unpack(ids)
    if not (0 <= peer < size and 0 <= conn < nconn):
        raise ConnectionError(f"authenticated peer claims rank {peer} conn {conn}, out of range")
    sock.sendall(auth.RING.server_proof(secret, nl, nc, ctx, ids))
    return peer, conn


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


class _Pending:
    """What a communicator created with ``lazy=True`` needs to connect on its first collective:
    the listener (accepting from higher ranks from creation on, so a peer that is already in its
    first collective can finish its side) and the settings of :meth:`RingBackend.create`."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)
        self.fds: list[list[int | None]] = [[None] * self.streams for _ in range(self.size)]
        self.socks: list[socket.socket] = []
        self.accept_err: list[BaseException] = []
        self.stop = threading.Event()
        self.acceptor: threading.Thread | None = None

    def close(self) -> None:
        self.stop.set()
        if self.acceptor is not None:
            self.acceptor.join(2.0)
        self.lsock.close()
        for s in self.socks:
            s.close()


class RingBackend(Backend):
    """Compiled ring/recursive-doubling collectives over TCP (host memory)."""

    name = "ring"
    device = "cpu"

    def __init__(self, comm, hosts: tuple[str, ...], pending: _Pending | None = None) -> None:
        self._native_comm = comm
        self.hosts = tuple(hosts)
        self._pending = pending
        self._setup_error: str | None = None
        self._setup_lock = threading.Lock()
        self._p2p_args: dict | None = None        # what the point-to-point mailbox needs (create)
        self._mailbox = None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, topology, store, secret: bytes | str, timeout: float | None = None, *,
               prefix: str = "hpcring/ring", conns_per_peer: int | None = None,
               sockbuf: int | None = None, rd_threshold: int | None = None,
               threads: int | None = None, shm: bool | None = None, lazy: bool = False) -> "RingBackend":
        """Exchange addresses through ``store`` and build the authenticated full mesh.

        ``timeout`` bounds the whole setup and is the default deadline of every collective
        (None: HPCRING_TIMEOUT or 300 s). ``sockbuf`` sets SO_SNDBUF/SO_RCVBUF (None: env
        HPCRING_SOCKBUF or the kernel's autotuning). ``rd_threshold``: allreduce messages below
        this many bytes use recursive doubling (None: env HPCRING_RD_THRESHOLD or the measured
        default). ``conns_per_peer`` (streams) and ``threads`` stripe the ring passes (None: env
        HPCRING_RING_STREAMS / HPCRING_RING_THREADS or 1). ``shm``: shared memory between the
        ranks of a host (None: env HPCRING_RING_SHM or on). Raises BootstrapError when peers cannot
        be reached or authenticated in time.

        ``lazy=True`` (what :meth:`Communicator.create` asks for) only listens and publishes the
        address here; the mesh is built by the first collective, under that collective's deadline,
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
        if conns_per_peer is None:
            conns_per_peer = envvars.get("HPCRING_RING_STREAMS")
        if threads is None:
            threads = envvars.get("HPCRING_RING_THREADS")
        if shm is None:
            shm = envvars.get("HPCRING_RING_SHM")
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
        p = _Pending(rank=rank, size=size, hosts=hosts, store=store, secret=secret, base=base, lsock=lsock,
                     streams=conns_per_peer, threads=threads, timeout=timeout, sockbuf=sockbuf,
                     rd_threshold=rd_threshold, shm=shm)
        p.acceptor = threading.Thread(target=cls._accept_all, name=f"hpcring-ring-accept:{rank}", daemon=True,
                                      args=(p, f"{base}/{rank}".encode()))
        p.acceptor.start()
        try:
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
                be._connect_mesh(time.monotonic() + timeout)
            except _Missing as e:
                raise BootstrapError(
                    f"ring setup: rank {rank} got no authenticated connection from rank(s) "
                    f"{', '.join(f'{m} ({hosts[m]})' for m in e.missing)} within {timeout:.1f} s",
                    hint="those ranks did not start, crashed, or cannot reach this host's address") from None
        return be

    # -- the mesh (at creation, or on the first collective when lazy) ------------------------
    def _connect_mesh(self, deadline: float) -> None:
        """Connect to every lower rank, wait for every higher one, then build the native Comm.
        Raises :class:`_Missing` naming the peers that did not come by ``deadline``, BootstrapError
        for any other setup failure; the pending state is released either way."""
        p = self._pending
        rank, size, hosts = p.rank, p.size, p.hosts
        try:
            self._connect_lower(p, deadline)
            while p.acceptor.is_alive() and not p.accept_err and time.monotonic() < deadline:
                if all(all(f is not None for f in p.fds[q]) for q in range(rank + 1, size)):
                    break
                p.acceptor.join(min(0.05, max(0.0, deadline - time.monotonic())))
            p.stop.set()
            p.acceptor.join(2.0)
            if p.accept_err:
                raise p.accept_err[0]
            missing = [q for q in range(size) if q != rank and any(f is None for f in p.fds[q])]
            if missing:
                raise _Missing(missing)
            comm = _native.Comm(rank, size, [None if q == rank else p.fds[q] for q in range(size)],
                                list(hosts), p.timeout, p.sockbuf)
        except BaseException:
            p.close()
            self._pending = None
            raise
        p.lsock.close()
        for s in p.socks:          # the Comm owns the descriptors now
            s.detach()
        self._pending = None
        if p.rd_threshold is not None:
            comm.rd_threshold = int(p.rd_threshold)
        comm.threads = p.threads
        for var, attr in (("HPCRING_RING_STRIPE_MIN", "stripe_min"), ("HPCRING_TWOLEVEL_MIN", "twolevel_min"),
                          ("HPCRING_BCAST_TREE_MAX", "bcast_tree_max")):
            if envvars.get(var) is not None:           # unset: the measured defaults in native/
                setattr(comm, attr, envvars.get(var))
        if p.shm:
            try:
                self._attach_shm(comm, p.store, p.secret, p.base, rank, hosts, deadline)
            except BaseException:
                comm.close()
                raise
        self._native_comm = comm

    def _connect_lower(self, p: _Pending, deadline: float) -> None:
        """Connect to every lower rank as its address appears (in any order: one late peer must
        not keep this rank from the others, or they would name this rank missing too)."""
        todo = list(range(p.rank))
        delay = 0.002
        while todo:
            for peer in list(todo):
                text = p.store.check(f"{p.base}/addr/{peer}")
                if text is None:
                    continue
                host, _, port = text.decode().rpartition(":")
                for k in range(p.streams):
                    s = self._connect(host, int(port), deadline, peer, p.hosts[peer])
                    p.socks.append(s)
                    try:
                        s.settimeout(max(0.1, min(HANDSHAKE_TIMEOUT, deadline - time.monotonic())))
                        _auth_connector(s, p.secret, f"{p.base}/{peer}".encode(), p.rank, k)
                    except (OSError, ConnectionError) as e:
                        raise BootstrapError(
                            f"ring setup: rank {peer} ({p.hosts[peer]}) at {host}:{port} refused rank "
                            f"{p.rank}: {e}", hint="all ranks must use the same per-job secret") from None
                    p.fds[peer][k] = s.fileno()
                todo.remove(peer)
            if not todo:
                return
            if time.monotonic() >= deadline:
                raise _Missing(todo)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(0.1, delay * 2)

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
            p = self._pending
            try:
                self._connect_mesh(t0 + timeout)
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
            self._ensure("setup", self._pending.timeout if self._pending else 1.0)
        return self._native_comm

    @staticmethod
    def _attach_shm(comm, store, secret: bytes, base: str, rank: int, hosts: tuple[str, ...],
                    deadline: float) -> None:
        """Map the host's shared-memory segment (see the module docstring); no-op for a rank
        alone on its host."""
        local, column = node_layout(hosts, rank)
        if len(local) < 2:
            return
        piece = (envvars.get("HPCRING_RING_SHM_PIECE") or default_shm_piece(len(local))) // 64 * 64
        name = "/hpcring-" + auth.mac(secret, b"hpcring-ring-v1 shm", base.encode(),
                                  hosts[rank].encode()).hex()[:32]
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

    @staticmethod
    def _accept_all(p: _Pending, ctx: bytes) -> None:
        want = (p.size - 1 - p.rank) * p.streams
        got = 0
        try:
            while got < want and not p.stop.is_set():
                p.lsock.settimeout(0.2)        # short: the first collective stops it (p.stop)
                try:
                    s, addr = p.lsock.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return                     # closed under us
                try:
                    s.settimeout(HANDSHAKE_TIMEOUT)
                    peer, k = _auth_listener(s, p.secret, ctx, p.size, p.streams)
                    if peer <= p.rank or p.fds[peer][k] is not None:
                        raise ConnectionError(f"unexpected connection from rank {peer} conn {k}")
                except (OSError, ConnectionError) as e:
                    log.warning("ring rank %d: refused connection from %s:%s: %s", p.rank, addr[0], addr[1], e)
                    s.close()
                    continue
                p.socks.append(s)
                p.fds[peer][k] = s.fileno()
                got += 1
        except BaseException as e:  # pragma: no cover - unexpected
            p.accept_err.append(e)

    # -- Backend ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._native_comm.rank if self._native_comm is not None else self._pending.rank

    @property
    def size(self) -> int:
        return self._native_comm.size if self._native_comm is not None else self._pending.size

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
        return f"ring: {where}; {self._comm.streams} stream(s)/peer, {self._comm.threads} I/O thread(s)"

    @property
    def rd_threshold(self) -> int:
        return self._comm.rd_threshold

    @rd_threshold.setter
    def rd_threshold(self, value: int) -> None:
        self._comm.rd_threshold = int(value)

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

    def allgather(self, sendbuf, recvbuf, dtype, timeout):
        self._call("allgather", _N.allgather, sendbuf, recvbuf, DTYPE_CODES[dtype], timeout)

    def reduce_scatter(self, sendbuf, recvbuf, dtype, op, timeout):
        if op == "avg" and dtype not in FLOAT_DTYPES:
            raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
        self._call("reduce_scatter", _N.reduce_scatter, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)

    def broadcast(self, buf, root, dtype, timeout):
        self._call("broadcast", _N.broadcast, buf, DTYPE_CODES[dtype], root, timeout)

    def alltoall(self, sendbuf, recvbuf, dtype, timeout):
        self._call("alltoall", _N.alltoall, sendbuf, recvbuf, DTYPE_CODES[dtype], timeout)

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

    def close(self) -> None:
        if self._mailbox is not None:
            self._mailbox.close()
            self._mailbox = None
        if self._native_comm is not None:
            self._native_comm.close()
        elif self._pending is not None:
            self._pending.close()
            self._pending = None
