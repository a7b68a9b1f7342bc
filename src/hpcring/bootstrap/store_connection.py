"""One authenticated connection to the rendezvous store: connect with back-off, the handshake,
MAC-checked framed round trips under one lock. :class:`~hpcring.bootstrap.store_client.StoreClient`
holds one and puts the store's operations on it (see store_wire for the protocol)."""
from __future__ import annotations

import hmac
import socket
import threading
import time

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_wire import (HEADER, MAC_LEN, SECRET_HINT, _DIR_TO_CLIENT, _DIR_TO_SERVER,
                                          StoreAuthError, encode_frame, frame_mac, session_key)
from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact, time_left


class ClientBusy(BootstrapError):
    """Another thread held this client for longer than the call's ``timeout``: nothing was sent
    (the caller may use a connection of its own)."""


class _StoreBusy(ConnectionResetError):
    """The server closed a new connection before its hello: full, or pausing accepts (retryable)."""


_RETRYABLE_CONNECT = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
                      TimeoutError, socket.timeout)


class StoreConnection:
    """The socket, session key and frame sequence numbers of one client; safe to share between
    threads (one lock). Nothing but the handshake is read before the peer proved the job secret,
    and no reply body is parsed before its MAC checked."""

    def __init__(self, host: str, port: int, secret: bytes, max_frame: int) -> None:
        self.host, self.port = host, int(port)
        self.max_frame = max_frame
        self._secret = bytes(secret)
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self._key = b""
        self._send_seq = 0
        self._recv_seq = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self, deadline: float, timeout: float, retry: bool = True) -> None:
        """Connect and authenticate before ``deadline``; ``timeout`` (the client's) names the budget
        in the error. ``retry=False``: the first failure raises (the caller loops over ports)."""
        delay, last_error = 0.02, None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BootstrapError(
                    f"could not connect to the rendezvous store at {self.address} "
                    f"within {timeout:.0f}s (last error: {last_error})",
                    hint="check that rank 0 is running and reached init_bootstrap, that the master "
                         "address is reachable from this host (interface, firewall) and that "
                         "HPCRING_MASTER_ADDR/MASTER_ADDR point at rank 0's node")
            try:
                self.sock = self._open(min(remaining, 5.0))
                return
            except StoreAuthError:
                raise
            except (OSError, *_RETRYABLE_CONNECT) as e:
                last_error = f"{type(e).__name__}: {e}"
                if not retry:   # the caller runs its own loop over several ports
                    raise BootstrapError(f"could not connect to the rendezvous store at {self.address}: "
                                         f"{last_error}") from e
            time.sleep(min(delay, time_left(deadline)))
            delay = min(delay * 2, 1.0)

    def _open(self, budget: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=budget)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(budget, 1.0))
            self._handshake(sock)
            return sock
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket) -> None:
        try:
            ns = auth.STORE.read_hello(sock)
        except auth.NotAPeer as e:
            raise StoreAuthError(f"peer at {self.address} is not an hpcring store (bad hello)",
                                 hint=SECRET_HINT) from e
        except (EOFError, ConnectionResetError, TimeoutError, socket.timeout) as e:
            # An hpcring store under a flood drops (or is slow to greet) new connections: retry.
            raise _StoreBusy(f"the store closed the connection before its hello (busy, or not an "
                             f"hpcring store): {e or type(e).__name__}") from e
        except OSError as e:
            raise StoreAuthError(f"peer at {self.address} is not an hpcring store (no hello: {e})",
                                 hint=SECRET_HINT) from e
        try:
            nc = auth.STORE.prove(sock, self._secret, ns)
        except auth.BadProof as e:
            raise StoreAuthError(f"the server at {self.address} could not prove it knows this job's secret",
                                 hint=SECRET_HINT) from e
        except (EOFError, OSError) as e:
            raise StoreAuthError(f"the store at {self.address} rejected this rank's handshake",
                                 hint=SECRET_HINT) from e
        self._key = session_key(self._secret, ns, nc)
        self._send_seq = self._recv_seq = 0

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def round_trip(self, bodies: list[bytes], wait: float, key: str,
                   limit: float | None = None) -> list[tuple[int, bytes]]:
        """Send every request body as a frame, then read every reply: ``(status, payload)`` each.
        ``key`` names the request in errors; ``limit`` and ``wait`` as StoreClient._pipeline."""
        for body in bodies:
            if len(body) > self.max_frame:
                raise BootstrapError(f"request for key {key!r} is {len(body)} bytes, over the store's "
                                     f"frame cap of {self.max_frame}", hint="the store is for small metadata")
        end = None if limit is None else time.monotonic() + limit
        if not self.lock.acquire(timeout=-1 if limit is None else limit):
            raise ClientBusy(f"store client for {self.address} busy in another thread for {limit:g} s (key {key!r})")
        try:
            sock = self.sock
            if sock is None:
                raise BootstrapError(f"store client for {self.address} is closed (key {key!r})")
            frames = []
            for body in bodies:
                frames.append(encode_frame(self._key, _DIR_TO_SERVER, self._send_seq, body))
                self._send_seq += 1
            # The server answers a blocked GET at its own deadline; the slack covers the round trip.
            reply_wait = wait + 5.0 if end is None else max(0.05, end - time.monotonic())
            sock.settimeout(reply_wait)
            try:
                sock.sendall(b"".join(frames))
                return [self._read_reply(sock) for _ in bodies]
            except (EOFError, ConnectionError) as e:
                self.sock = None
                sock.close()
                raise BootstrapError(
                    f"the rendezvous store at {self.address} closed the connection while this rank "
                    f"was waiting for key {key!r} ({type(e).__name__})",
                    hint="rank 0 runs the store: check whether rank 0 exited or crashed (its log and exit "
                         "code), or was killed by the scheduler") from e
            except (TimeoutError, socket.timeout) as e:
                self.sock = None
                sock.close()
                raise BootstrapError(
                    f"no answer from the rendezvous store at {self.address} for key {key!r} "
                    f"within {reply_wait:.1f}s", hint="rank 0 may be hung or the network path dropped") from e
            except OSError as e:
                self.sock = None
                sock.close()
                raise BootstrapError(f"talking to the rendezvous store at {self.address} failed for "
                                     f"key {key!r}: {e}", hint="check rank 0 and the network path") from e
        finally:
            self.lock.release()

    def _read_reply(self, sock: socket.socket) -> tuple[int, bytes]:
        head = recv_exact(sock, HEADER.size + MAC_LEN)
        (length,) = HEADER.unpack_from(head, 0)
        if length > self.max_frame or length < 1:
            raise ConnectionAbortedError(f"reply frame length {length} out of range")
        body = recv_exact(sock, length)
        if not hmac.compare_digest(head[HEADER.size:], frame_mac(self._key, _DIR_TO_CLIENT, self._recv_seq, body)):
            raise ConnectionAbortedError("reply frame has a bad MAC")
        self._recv_seq += 1
        return body[0], body[1:]
