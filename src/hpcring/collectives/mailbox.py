"""Point-to-point on the ring backend: tagged messages over direct, authenticated TCP connections.

Why not the collectives' mesh: it carries raw chunks with no framing, and a message may arrive
while either rank is inside a collective. Point-to-point has its own connections, made on demand:

* the first send or receive of a rank opens its listener and publishes ``host:port`` under
  ``{base}/p2p/addr/{rank}``;
* a rank connects to a peer when it first sends to it, and sends to it only on that connection
  (so messages keep their order); the peer accepts it and reads from it. Connections are one-way
  for data, so a receive never waits for the receiver to act (a rank that only receives from a
  peer needs no connection of its own to it). The job secret is proven both ways before anything
  is parsed (hpcring.bootstrap.auth, the ring's handshake bound to ``{base}/p2p/{listener}``). A
  pipeline stage holds 4 connections (to and from each neighbour); pairs that never talk hold none.

Wire: a frame is a 16-byte header (tag int64, payload bytes uint64, big-endian) and the payload.
One reader thread per incoming connection matches each frame to the oldest posted receive for (that
peer or any, that tag) and reads the payload straight into its buffer; with none posted, into a
buffer of its own (an *unexpected* message, taken by the next matching receive). Messages of one
pair and tag arrive in send order (MPI's non-overtaking rule). One sender thread per outgoing connection
writes the sends in order, so ``isend`` returns at once and two ranks sending to each other
never block (each side's reader drains).

Failures (each names both ranks, the tag and the size):
* deadline: :data:`hpcring.collectives.p2p.KEEPER` fails the request, naming what was missing
  (the peer never connected: it has sent nothing to this rank; connected: the message never
  came; partly moved: the link stalled);
* a closed or reset connection fails every request with that peer at once;
* a message whose size differs from the posted receive fails that receive (the sender's size,
  the receiver's);
Any failure with a peer is sticky for that peer (a late message could otherwise match the wrong
receive); other peers go on.

Payload bytes are not MACed (as the collectives: peers are authenticated, the path is trusted).
"""
from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time

import numpy as np

from hpcring.collectives.handshake import authenticate_connector, authenticate_listener, handshake_timeout
from hpcring.collectives.p2p import KEEPER, RECV, SEND, Request, size_text

log = logging.getLogger("hpcring.collectives.mailbox")

_HEADER = struct.Struct(">qQ")
INLINE_MAX = 64 << 10      # sends up to this size are written by the caller when nothing is queued
_CONNECT_HINT = ("that rank has not reached its first send/recv with this rank (a different schedule?), "
                 "or it is hung or dead: look at its log (hpcring stacks JOB)")


class _Peer:
    """One peer: the connection this rank sends on (``out``, made by its sender thread) and the one
    it reads from (``inc``, accepted), the sender queue, the threads, the sticky error."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.out: socket.socket | None = None
        self.inc: socket.socket | None = None
        self.sends: queue.SimpleQueue | None = None   # created with the sender thread
        self.lock = threading.Lock()                  # one frame at a time on ``out``
        self.queued = 0                               # sends queued and not written yet
        self.error: str | None = None
        self.reading: Request | None = None       # the receive the reader is filling
        self.sending: Request | None = None
        self.threads: list[threading.Thread] = []


class Mailbox:
    """Tagged point-to-point messages among the ranks of one communicator (module docstring)."""

    def __init__(self, rank: int, size: int, hosts, store, secret: bytes, base: str, address: str,
                 bind: str | None = None) -> None:
        self._auth_connector, self._auth_listener = authenticate_connector, authenticate_listener
        self.rank, self.size, self.hosts = rank, size, tuple(hosts)
        self.store, self.secret, self.base = store, secret, f"{base}/p2p"
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._posted: list[Request] = []                       # receives waiting, oldest first
        self._unexpected: list[tuple[int, int, bytearray]] = []  # (source, tag, payload), arrival order
        self._closed = False
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._lsock.bind((bind or "0.0.0.0", 0))
            self._lsock.listen(64)
            self._lsock.setblocking(False)
            port = self._lsock.getsockname()[1]
            self.store.set(f"{self.base}/addr/{rank}", f"{address}:{port}".encode())
        except BaseException:
            self._lsock.close()
            raise
        self._handshakes: list[threading.Thread] = []
        ACCEPTOR.register(self._lsock, self._on_accept)

    # -- the public side ----------------------------------------------------------------------
    def send(self, buf, dst: int, tag: int, timeout: float, record=None) -> Request:
        """Queue ``buf`` (1-D uint8) for rank ``dst``; the request completes once the bytes are
        written to the connection (the receiver's reader drains it)."""
        req = Request(SEND, buf, dst, tag, timeout, rank=self.rank, hosts=self.hosts, record=record)
        peer = self._peer(dst, req)
        if peer is None:
            return req
        with peer.lock:
            # a small message with nothing queued before it is written here: no thread hop
            # (measured: the hop was about half of a 4-byte round trip on 2 busy cores)
            if req.nbytes <= INLINE_MAX and peer.out is not None and peer.queued == 0 and peer.error is None:
                self._write(peer, req)
                return req
            peer.queued += 1
        KEEPER.watch(req, self._expire)
        peer.sends.put(req)
        return req

    def recv(self, buf, src: int | None, tag: int, timeout: float, record=None) -> Request:
        """Post a receive into ``buf`` (1-D uint8, writable) from rank ``src`` (None: any rank);
        the request's result is the source rank."""
        req = Request(RECV, buf, src, tag, timeout, rank=self.rank, hosts=self.hosts, record=record)
        if src is not None and self._peer(src, req) is None:
            return req
        with self._lock:
            if self._closed:
                req.fail("the communicator is closed")
                return req
            for i, (source, t, data) in enumerate(self._unexpected):
                if t == tag and (src is None or source == src):
                    del self._unexpected[i]
                    break
            else:
                self._posted.append(req)
                data = None
        if data is not None:
            self._deliver(req, source, data)
        else:
            KEEPER.watch(req, self._expire)
        return req

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, posted = list(self._peers.values()), list(self._posted)
            self._posted.clear()
        ACCEPTOR.unregister(self._lsock)
        try:
            self._lsock.close()
        except OSError:
            pass
        for p in peers:
            if p.sends is not None:
                p.sends.put(None)
            _shutdown(p.out, p.inc)
        for t in [t for p in peers for t in p.threads] + self._handshakes:
            if t is not threading.current_thread():
                t.join(2.0)
        for p in peers:
            for sock in (p.out, p.inc):
                if sock is not None:
                    sock.close()
        for r in posted:
            r.fail("the communicator was closed")

    # -- peers ----------------------------------------------------------------------------------
    def _who(self, r: int) -> str:
        return f"rank {r} ({self.hosts[r] if r < len(self.hosts) else '?'})"

    def _peer(self, r: int, req: Request) -> _Peer | None:
        """The peer ``r`` (for a send: with its sender thread, which connects), or None after
        failing ``req`` with the peer's sticky error."""
        with self._lock:
            p = self._peers.get(r)
            if p is None:
                p = self._peers[r] = _Peer(r)
            start = req.kind == SEND and p.sends is None
            if start:
                p.sends = queue.SimpleQueue()
        if start:
            t = threading.Thread(target=self._sender, args=(p, req.deadline), name=f"hpcring-p2p-send:{self.rank}>{r}",
                                 daemon=True)
            p.threads.append(t)
            t.start()
        if p.error is not None:
            req.fail(p.error)
            return None
        return p

    def _connect(self, p: _Peer, deadline: float) -> socket.socket:
        """Connect to ``p`` once its address is published, and authenticate."""
        delay = 0.002
        key = f"{self.base}/addr/{p.rank}"
        while True:
            if self._closed:
                raise ConnectionError("closed")
            text = self.store.check(key)
            if text is not None:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._who(p.rank)} never opened point-to-point (no address published)")
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        host, _, port = text.decode().rpartition(":")
        s = socket.create_connection((host, int(port)), timeout=max(0.5, min(10.0, deadline - time.monotonic())))
        try:
            self._auth_connector(s, self.secret, f"{self.base}/{p.rank}".encode(), self.rank, 0)
        except BaseException:
            s.close()
            raise
        return s

    def _on_accept(self, s: socket.socket, addr) -> None:
        """A new connection (from the shared acceptor): authenticate it on a thread of its own,
        so a slow or hostile connector delays nobody."""
        t = threading.Thread(target=self._handshake, args=(s, addr), name=f"hpcring-p2p-auth:{self.rank}", daemon=True)
        self._handshakes = [x for x in self._handshakes if x.is_alive()] + [t]
        t.start()

    def _handshake(self, s: socket.socket, addr) -> None:
        ctx = f"{self.base}/{self.rank}".encode()
        try:
            s.setblocking(True)
            s.settimeout(handshake_timeout())
            r, _ = self._auth_listener(s, self.secret, ctx, self.size, 1)
            if r == self.rank:
                raise ConnectionError("a connection from this very rank")
        except (OSError, ConnectionError) as e:
            log.warning("p2p rank %d: refused connection from %s:%s: %s", self.rank, addr[0], addr[1], e)
            s.close()
            return
        with self._lock:
            if self._closed:
                s.close()
                return
            p = self._peers.get(r)
            if p is None:
                p = self._peers[r] = _Peer(r)
            if p.inc is not None:
                log.warning("p2p rank %d: refused a second connection from rank %d", self.rank, r)
                s.close()
                return
            p.inc = s
        s.settimeout(None)
        t = threading.Thread(target=self._reader, args=(p, s), name=f"hpcring-p2p-read:{self.rank}<{r}", daemon=True)
        p.threads.append(t)
        t.start()

    def _fail_peer(self, p: _Peer, why: str, hint: str | None = None) -> None:
        """Sticky: fail every request with ``p`` and every later one."""
        with self._lock:
            if p.error is None:
                p.error = why
            posted = [r for r in self._posted if r.peer == p.rank]
            self._posted = [r for r in self._posted if r.peer != p.rank]
        for r in posted + [x for x in (p.reading, p.sending) if x is not None]:
            r.fail(why, hint)
        while p.sends is not None:
            try:
                r = p.sends.get_nowait()
            except queue.Empty:
                break
            if r is not None:
                r.fail(why, hint)
        _shutdown(p.out, p.inc)

    # -- threads --------------------------------------------------------------------------------
    def _sender(self, p: _Peer, deadline: float) -> None:
        try:
            s = self._connect(p, deadline)
        except (OSError, ConnectionError, TimeoutError) as e:
            if not self._closed:
                self._fail_peer(p, f"no point-to-point connection to {self._who(p.rank)}: {e}", _CONNECT_HINT)
            return
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with p.lock:
            p.out = s
        while True:
            req = p.sends.get()
            if req is None or self._closed:
                return
            with p.lock:
                p.queued -= 1
                if req.finished or p.error is not None:
                    if not req.finished:
                        req.fail(p.error)
                    continue
                self._write(p, req)

    def _write(self, p: _Peer, req: Request) -> None:
        """Write one frame (``p.lock`` held: frames never interleave, and keep their order),
        bounded by the request's deadline."""
        p.sending = req
        req.state = "active"
        try:
            p.out.settimeout(max(0.001, req.deadline - time.monotonic()))
            p.out.sendall(_HEADER.pack(req.tag, req.nbytes))
            if req.nbytes:
                p.out.sendall(req.buf)
        except OSError as e:
            why = ("the receiver stopped reading (deadline)" if isinstance(e, socket.timeout)
                   else f"the connection broke: {e}")
            self._fail_peer(p, f"sending to {self._who(p.rank)} failed: {why}")   # req too (p.sending)
            p.sending = None
            return
        p.sending = None
        req.complete()

    def _reader(self, p: _Peer, sock: socket.socket) -> None:
        hdr = bytearray(_HEADER.size)
        try:
            while True:
                if not _read_into(sock, memoryview(hdr)):
                    raise EOFError
                tag, n = _HEADER.unpack(hdr)
                with self._lock:
                    req = next((r for r in self._posted if r.tag == tag and r.peer in (None, p.rank)), None)
                    if req is not None:
                        self._posted.remove(req)
                        p.reading = req
                if req is None or req.nbytes != n:
                    data = bytearray(n)
                    if n and not _read_into(sock, memoryview(data)):
                        raise EOFError
                    if req is not None:
                        p.reading = None
                        req.fail(f"{self._who(p.rank)} sent {size_text(n)} ({n} bytes) but this receive "
                                 f"takes {req.nbytes} bytes", hint="send and receive tensors of the same size "
                                                                   "and dtype, in the same order per tag")
                        self._fail_peer(p, f"an earlier message from {self._who(p.rank)} did not match its receive")
                        return
                    with self._lock:       # a receive may have been posted meanwhile
                        req = next((r for r in self._posted if r.tag == tag and r.peer in (None, p.rank)), None)
                        if req is not None:
                            self._posted.remove(req)
                        else:
                            self._unexpected.append((p.rank, tag, data))
                    if req is not None:
                        self._deliver(req, p.rank, data)
                    continue
                req.state = "active"
                if n and not _read_into(sock, memoryview(req.buf)):
                    raise EOFError
                p.reading = None
                req.complete(p.rank)
        except (EOFError, OSError) as e:
            if self._closed:
                return
            why = ("closed its connection (it exited or failed)" if isinstance(e, EOFError)
                   else f"connection error: {e}")
            self._fail_peer(p, f"{self._who(p.rank)} {why}",
                            "that rank died or ended early: look at its log (the first failing rank is the cause)")

    def _deliver(self, req: Request, source: int, data: bytearray) -> None:
        if len(data) != req.nbytes:
            req.fail(f"{self._who(source)} sent {size_text(len(data))} ({len(data)} bytes) but this receive "
                     f"takes {req.nbytes} bytes", hint="send and receive tensors of the same size and dtype, "
                                                      "in the same order per tag")
            return
        if data:
            req.buf[:] = np.frombuffer(data, dtype=np.uint8)
        req.complete(source)

    def _expire(self, req: Request) -> None:
        """The deadline passed (called by the keeper): word why, and fail the peer if bytes of
        the message were moving (the stream cannot be resynchronised)."""
        with self._lock:
            if req in self._posted:
                self._posted.remove(req)
        p = self._peers.get(req.peer) if req.peer is not None else None
        waited = f"within the {req.timeout:g} s deadline"
        if p is not None and req.kind == RECV and p.inc is None:
            req.fail(f"{self._who(req.peer)} never connected {waited}: it has sent nothing to this rank",
                     _CONNECT_HINT)
            self._fail_peer(p, f"an earlier {req.describe()} timed out")
            return
        if p is not None and req.kind == SEND and p.out is None:
            why = f"no connection to {self._who(req.peer)} {waited}: it never opened point-to-point"
            req.fail(why, _CONNECT_HINT)
            self._fail_peer(p, f"point-to-point with {self._who(req.peer)} failed earlier: " + why)
            return
        if req.state == "active" and p is not None:
            self._fail_peer(p, f"the link with {self._who(req.peer)} stalled mid-message (deadline "
                               f"{req.timeout:g} s)", "the peer froze or the network path stalls")
            return
        if req.kind == RECV:
            who = "no rank sent it" if req.peer is None else f"{self._who(req.peer)} did not send it"
            req.fail(f"{who} {waited}",
                     hint="the sender is late, hung, or sends with another tag or to another rank: look at "
                          "its log and stack (hpcring stacks JOB)")
        else:
            req.fail(f"not written to the connection {waited} (the receiver does not drain)")
        if p is not None:
            self._fail_peer(p, f"an earlier {req.describe()} timed out")


class _Acceptor:
    """One thread for the whole process accepts on every mailbox's listener (a selector), so a
    communicator costs a listening socket, not a thread, until a peer connects."""

    def __init__(self) -> None:
        import selectors
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, 1, None)

    def register(self, lsock: socket.socket, on_accept) -> None:
        with self._lock:
            self._sel.register(lsock, 1, on_accept)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hpcring-p2p-acceptor", daemon=True)
                self._thread.start()
        self._wake_w.send(b"x")

    def unregister(self, lsock: socket.socket) -> None:
        with self._lock:
            try:
                self._sel.unregister(lsock)
            except (KeyError, ValueError):
                pass
        self._wake_w.send(b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._sel.get_map() or len(self._sel.get_map()) == 1:
                    self._thread = None
                    return
            for key, _ in self._sel.select(1.0):
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    continue
                try:
                    s, addr = key.fileobj.accept()
                except OSError:          # nothing after all, or closed meanwhile
                    continue
                key.data(s, addr)


ACCEPTOR = _Acceptor()


def _shutdown(*socks) -> None:
    for sock in socks:
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _read_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on EOF."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True

