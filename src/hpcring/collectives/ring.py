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
               prefix: str = "hpcring/ring", conns_per_peer: int = 1, sockbuf: int | None = None,
               rd_threshold: int | None = None) -> "RingBackend":
        """Exchange addresses through ``store`` and build the authenticated full mesh.

        ``timeout`` bounds the whole setup and is the default deadline of every collective
        (None: HPCRING_TIMEOUT or 300 s). ``sockbuf`` sets SO_SNDBUF/SO_RCVBUF (None: env
        HPCRING_SOCKBUF or the kernel's autotuning). ``rd_threshold``: allreduce messages below
        this many bytes use recursive doubling (None: env HPCRING_RD_THRESHOLD or the measured
        default). Raises BootstrapError when peers cannot be reached or authenticated in time.
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
        return cls(comm, hosts)

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
