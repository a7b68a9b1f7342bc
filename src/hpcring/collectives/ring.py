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
from hpcring.errors import BootstrapError, CollectiveError, UsageError

log = logging.getLogger("hpcring.collectives.ring")

try:
    from hpcring import _native
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


class RingBackend(Backend):
    """Compiled ring/recursive-doubling collectives over TCP (host memory)."""

    name = "ring"
    device = "cpu"

    def __init__(self, comm, hosts: tuple[str, ...]) -> None:
        self._comm = comm
        self.hosts = tuple(hosts)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, topology, store, secret: bytes | str, timeout: float | None = None, *,
               prefix: str = "hpcring/ring", conns_per_peer: int | None = None,
               sockbuf: int | None = None, rd_threshold: int | None = None,
               threads: int | None = None, shm: bool | None = None) -> "RingBackend":
        """Exchange addresses through ``store`` and build the authenticated full mesh.

        ``timeout`` bounds the whole setup and is the default deadline of every collective
        (None: HPCRING_TIMEOUT or 300 s). ``sockbuf`` sets SO_SNDBUF/SO_RCVBUF (None: env
        HPCRING_SOCKBUF or the kernel's autotuning). ``rd_threshold``: allreduce messages below
        this many bytes use recursive doubling (None: env HPCRING_RD_THRESHOLD or the measured
        default). ``conns_per_peer`` (streams) and ``threads`` stripe the ring passes (None: env
        HPCRING_RING_STREAMS / HPCRING_RING_THREADS or 1). ``shm``: shared memory between the
        ranks of a host (None: env HPCRING_RING_SHM or on). Raises BootstrapError when peers cannot
        be reached or authenticated in time.
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

        deadline = time.monotonic() + timeout
        gen = store.add(f"{prefix}/gen/{rank}", 1)
        base = f"{prefix}/{gen}"
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        fds: list[list[int | None]] = [[None] * conns_per_peer for _ in range(size)]
        socks: list[socket.socket] = []
        try:
            lsock.bind((topology.address or "0.0.0.0", 0))
            lsock.listen(max(16, size * conns_per_peer))
            port = lsock.getsockname()[1]
            store.set(f"{base}/addr/{rank}", f"{_advertised_host(topology)}:{port}".encode())

            accept_err: list[BaseException] = []
            acceptor = threading.Thread(
                target=cls._accept_all, name=f"hpcring-ring-accept:{rank}", daemon=True,
                args=(lsock, secret, f"{base}/{rank}".encode(), rank, size, conns_per_peer,
                      deadline, fds, socks, accept_err, hosts))
            acceptor.start()
            try:
                for peer in range(rank):
                    text = store.get(f"{base}/addr/{peer}", timeout=max(0.1, deadline - time.monotonic())).decode()
                    host, _, p = text.rpartition(":")
                    for k in range(conns_per_peer):
                        s = cls._connect(host, int(p), deadline, peer, hosts[peer])
                        socks.append(s)
                        try:
                            s.settimeout(max(0.1, min(HANDSHAKE_TIMEOUT, deadline - time.monotonic())))
                            _auth_connector(s, secret, f"{base}/{peer}".encode(), rank, k)
                        except (OSError, ConnectionError) as e:
                            raise BootstrapError(
                                f"ring setup: rank {peer} ({hosts[peer]}) at {host}:{p} refused rank "
                                f"{rank}: {e}",
                                hint="all ranks must use the same per-job secret") from None
                        fds[peer][k] = s.fileno()
            finally:
                acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if accept_err:
                raise accept_err[0]
            missing = [p for p in range(size) if p != rank and any(f is None for f in fds[p])]
            if missing:
                raise BootstrapError(
                    f"ring setup: rank {rank} got no authenticated connection from rank(s) "
                    f"{', '.join(f'{p} ({hosts[p]})' for p in missing)} within {timeout:.1f} s",
                    hint="those ranks did not start, crashed, or cannot reach this host's address")
            comm = _native.Comm(rank, size, [None if p == rank else fds[p] for p in range(size)],
                                list(hosts), timeout, sockbuf)
        except BaseException:
            for s in socks:
                s.close()
            raise
        finally:
            lsock.close()
        for s in socks:          # the Comm owns the descriptors now
            s.detach()
        if rd_threshold is not None:
            comm.rd_threshold = int(rd_threshold)
        comm.threads = threads
        for var, attr in (("HPCRING_RING_STRIPE_MIN", "stripe_min"), ("HPCRING_TWOLEVEL_MIN", "twolevel_min"),
                          ("HPCRING_BCAST_TREE_MAX", "bcast_tree_max")):
            if envvars.get(var) is not None:           # unset: the measured defaults in native/
                setattr(comm, attr, envvars.get(var))
        if shm:
            try:
                cls._attach_shm(comm, store, secret, base, rank, hosts, deadline)
            except BaseException:
                comm.close()
                raise
        return cls(comm, hosts)

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
    def _accept_all(lsock, secret, ctx, rank, size, nconn, deadline, fds, socks, errs, hosts) -> None:
        want = (size - 1 - rank) * nconn
        got = 0
        try:
            while got < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                lsock.settimeout(min(left, 1.0))
                try:
                    s, addr = lsock.accept()
                except socket.timeout:
                    continue
                try:
                    s.settimeout(max(0.1, min(HANDSHAKE_TIMEOUT, deadline - time.monotonic())))
                    peer, k = _auth_listener(s, secret, ctx, size, nconn)
                    if peer <= rank or fds[peer][k] is not None:
                        raise ConnectionError(f"unexpected connection from rank {peer} conn {k}")
                except (OSError, ConnectionError) as e:
                    log.warning("ring rank %d: refused connection from %s:%s: %s", rank, addr[0], addr[1], e)
                    s.close()
                    continue
                socks.append(s)
                fds[peer][k] = s.fileno()
                got += 1
        except BaseException as e:  # pragma: no cover - unexpected
            errs.append(e)

    # -- Backend ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    @property
    def error(self) -> str | None:
        return self._comm.error

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

    def _call(self, fn, *args):
        try:
            fn(*args)
        except _native.NativeError as e:
            raise _translate(e) from None
        except ValueError as e:
            raise UsageError(str(e)) from None

    def allreduce(self, sendbuf, recvbuf, dtype, op, timeout):
        if op == "avg" and dtype not in FLOAT_DTYPES:
            raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
        self._call(self._comm.allreduce, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)

    def allgather(self, sendbuf, recvbuf, dtype, timeout):
        self._call(self._comm.allgather, sendbuf, recvbuf, DTYPE_CODES[dtype], timeout)

    def reduce_scatter(self, sendbuf, recvbuf, dtype, op, timeout):
        if op == "avg" and dtype not in FLOAT_DTYPES:
            raise UsageError(f"op 'avg' needs a floating-point dtype, got {dtype}")
        self._call(self._comm.reduce_scatter, sendbuf, recvbuf, DTYPE_CODES[dtype], OP_CODES[op], timeout)

    def broadcast(self, buf, root, dtype, timeout):
        self._call(self._comm.broadcast, buf, DTYPE_CODES[dtype], root, timeout)

    def alltoall(self, sendbuf, recvbuf, dtype, timeout):
        self._call(self._comm.alltoall, sendbuf, recvbuf, DTYPE_CODES[dtype], timeout)

    def barrier(self, timeout):
        self._call(self._comm.barrier, timeout)

    def close(self) -> None:
        self._comm.close()
