"""Point-to-point on the ring backend: tagged messages over direct, authenticated TCP connections.

Why not the collectives' mesh: it carries raw chunks with no framing, and a message may arrive
while either rank is inside a collective. Point-to-point has its own connections, made on demand:

* the first send or receive of a rank opens its listener and publishes ``host:port`` under
  ``{base}/p2p/addr/{rank}``; where the rank has peers on its own host it also listens on a Unix
  socket (Linux's abstract namespace, a random name published beside the port), and a peer of
  the same host connects there: a stream like TCP's, without the TCP stack (a 4-byte round trip
  in about 60% of loopback TCP's time, 4 MiB in half: docs/collectives.md "Point-to-point").
  Another network namespace does not see the name; the connector then falls back to TCP;
* on a Unix connection the connector then offers direct reads: the address of a random word in
  its memory. The listener (the receiving side) reads it with process_vm_readv from the pid the
  kernel names for the socket (SO_PEERCRED) and answers whether it read the right word. Where it
  did, messages of at least ``HPCRING_P2P_DIRECT_MIN`` bytes are copied once, straight out of the
  sender's buffer (native/p2p_direct.c); elsewhere (ptrace rules, Yama, another pid namespace,
  ``HPCRING_P2P_DIRECT=0`` on either side) they go through the socket as before;
* a rank connects to a peer when it first sends to it, and sends to it only on that connection
  (so messages keep their order); the peer accepts it and reads from it. Connections are one-way
  for data, so a receive never waits for the receiver to act. The job secret is proven both ways
  before anything is parsed (hpcring.bootstrap.auth, the ring's handshake bound to
  ``{base}/p2p/{listener}``).

Once made and authenticated here, a connection is handed to the native queue (native/p2p.h):
framing, matching per (sender, tag) in send order, receives from any rank, unexpected messages,
deadlines and sticky per-pair failures run in C, on one progress thread per communicator. A
waiter blocks in C with the GIL released (:meth:`NativeRequest.drive`); a request nobody waits
for is settled by this mailbox's notifier thread, so a torch Work's future learns of a failure at
the deadline. docs/collectives.md "Point-to-point" has the wire format and the failure wording.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import secrets
import socket
import struct
import sys
import threading
import time

from hpcring import _native
from hpcring.collectives.handshake import authenticate_connector, authenticate_listener, handshake_timeout
from hpcring.collectives.p2p import RECV, SEND, SHORT_CLAIM, Request, ShortHandle, failure
from hpcring.collectives.recorder import FlightRecorder
from hpcring.config import envvars
from hpcring.errors import CollectiveError
from hpcring.netio import recv_exact

log = logging.getLogger("hpcring.collectives.mailbox")

_CONNECT_HINT = ("that rank has not reached its first send/recv with this rank (a different schedule?), "
                 "or it is hung or dead: look at its log (hpcring stacks JOB)")
# the native queue's hint codes (enum hr_p2p_hint in native/p2p.h)
_HINTS = {
    0: None,
    1: _CONNECT_HINT,
    2: "that rank died or ended early: look at its log (the first failing rank is the cause)",
    3: "send and receive tensors of the same size and dtype, in the same order per tag",
    4: "the peer froze or the network path stalls",
    5: "the sender is late, hung, or sends with another tag or to another rank: look at its log and stack "
       "(hpcring stacks JOB)",
}


class NativeRequest(Request):
    """A request whose bytes the native queue moves; :meth:`drive` waits for it in C."""

    def __init__(self, box: "Mailbox", *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._box = box
        self.id = 0
        self.native = None          # the hpcring._native.P2PReq, once posted

    def settle(self) -> bool:
        """Finish from the native state when it is done; True once finished."""
        if self._finished:
            return True
        n = self.native
        res = None if n is None else n.result()
        if res is None:
            return False
        failed, source, why, hint = res
        if failed:
            self.fail(why, _HINTS.get(hint))
        else:
            self.complete(source)
        self._box._pending.pop(self.id, None)
        return True

    def drive(self, timeout: float | None = None) -> None:
        """Block in C (GIL released) until done, or ``timeout`` s (None: the deadline, by which
        the progress thread has failed it), then finish in this thread: no thread hand-off."""
        if self._finished or self.native is None:
            return
        limit = self.deadline - time.monotonic() + 1.0 if timeout is None else timeout
        self.native.wait(max(0.0, limit))
        self.settle()

    def wait(self, timeout: float | None = None):
        self.drive(timeout)
        return super().wait(timeout)


class ShortMessage(ShortHandle):
    """A message of the Communicator's short path: the native request and its record, nothing
    more until asked. :meth:`wait` blocks in C and finishes the message in the waiting thread
    (record, result or the watchdog's failure path); the Handle's event, callbacks and the
    notifier's bookkeeping come only with :meth:`add_done_callback` (a torch future), so a
    message nobody watches costs no lock, event or dict entry. Same results, records and
    failures as the general path's DrivenHandle over a NativeRequest."""

    def __init__(self, comm, box: "Mailbox", native, nid: int, rec, kind: str, peer: int, tag: int,
                 nbytes: int, timeout: float) -> None:     # no Handle.__init__: see the docstring
        self._comm, self._mbox, self.native, self.id, self.record = comm, box, native, nid, rec
        self.kind, self.peer, self.tag, self.nbytes, self.timeout = kind, peer, tag, nbytes, timeout
        self.deadline = time.monotonic() + timeout
        self._state = 0                 # 0 pending, 1 being finished (claimed), 2 finished
        self._result = self._error = self._event = self._callbacks = None

    # -- finishing: the first thread to claim it (waiter, notifier, done()) ---------------------
    def _finish(self, res, here: bool) -> None:
        if not self._claim():
            return
        failed, source, why, hint = res
        if not failed:
            FlightRecorder.finish(self.record)
            self._set(source)
        elif here:
            self._set(error=self._failure(why, hint))
        else:   # the failure path may wait for the job-wide report: never on a transport thread
            threading.Thread(target=lambda: self._set(error=self._failure(why, hint)), daemon=True,
                             name=f"hpcring-p2p-failure:{self._mbox.rank}").start()

    def _failure(self, why: str, hint: int) -> BaseException:
        box = self._mbox
        err = failure(box.rank, box.hosts, self.kind, self.peer, self.tag, self.nbytes, why, _HINTS.get(hint))
        FlightRecorder.finish(self.record, err)
        return self._comm._failed(self.record, err)

    def _watchers_done(self) -> None:
        self._mbox._pending.pop(self.id, None)      # the notifier has nothing more to settle

    def settle(self) -> bool:
        """The notifier's (and close's) call for a watched message: finish it when done."""
        if self._state == 2:
            return True
        res = self.native.result()
        if res is None:
            return False
        self._finish(res, here=False)
        return True

    # -- the Handle API -------------------------------------------------------------------------
    def done(self) -> bool:
        if self._state == 2:
            return True
        res = self.native.result()
        if res is not None:
            self._finish(res, here=False)
        return self._state == 2

    def wait(self, timeout: float | None = None):
        if self._state != 2:
            n = self.native
            res = n.result()
            if res is None:
                n.wait(max(0.0, self.deadline - time.monotonic() + 1.0 if timeout is None else timeout))
                res = n.result()
                while res is None and timeout is None:   # the progress thread fails it at the deadline
                    n.wait(1.0)
                    res = n.result()
            if res is not None:
                self._finish(res, here=True)
            if self._state == 0:            # still pending after `timeout`
                raise CollectiveError(f"{self.name} did not finish within {timeout or 0:.1f} s (still running)",
                                      hint="the operation keeps its own deadline; wait again or raise it")
            self._wait_finished(timeout, timeout)   # another thread is finishing it
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn) -> None:
        with SHORT_CLAIM:
            if self._state != 2:
                if self._callbacks is None:
                    self._callbacks = []
                    if self._event is None:
                        self._event = threading.Event()
                    self._mbox._pending[self.id] = self     # the notifier settles it from now on
                self._callbacks.append(fn)
                fn = None
        if fn is None:
            self.settle()                   # done before the notifier knew of it: settle here
        else:
            self._call(fn)


class Mailbox:
    """Tagged point-to-point messages among the ranks of one communicator (module docstring)."""

    def __init__(self, rank: int, size: int, hosts, store, secret: bytes, base: str, address: str,
                 bind: str | None = None) -> None:
        self._auth_connector, self._auth_listener = authenticate_connector, authenticate_listener
        self.rank, self.size, self.hosts = rank, size, tuple(hosts)
        self.store, self.secret, self.base = store, secret, f"{base}/p2p"
        self._lock = threading.Lock()
        self._pending: dict[int, NativeRequest] = {}
        self._ids = itertools.count(1)
        self._connecting: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._box = _native.P2P(rank, size, [str(h) for h in self.hosts])
        self._box.direct_min = envvars.get("HPCRING_P2P_DIRECT_MIN")
        # the word a same-host peer must read out of this process to prove it can (direct reads)
        self._probe = ctypes.c_uint64(secrets.randbits(64) | 1)
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._usock: socket.socket | None = None
        try:
            self._lsock.bind((bind or "0.0.0.0", 0))
            self._lsock.listen(64)
            self._lsock.setblocking(False)
            port = self._lsock.getsockname()[1]
            where = f"{address}:{port}"
            if envvars.get("HPCRING_P2P_UNIX") and rank < len(self.hosts) and self.hosts.count(self.hosts[rank]) > 1:
                self._usock, name = _unix_listener()
                where += f" unix:{name}"
            self.store.set(f"{self.base}/addr/{rank}", where.encode())
        except BaseException:
            for sock in (self._lsock, self._usock):
                if sock is not None:
                    sock.close()
            self._box.close()
            raise
        self._notifier = threading.Thread(target=self._notify, name=f"hpcring-p2p-notify:{rank}", daemon=True)
        self._notifier.start()
        ACCEPTOR.register(self._lsock, self._on_accept)
        if self._usock is not None:
            ACCEPTOR.register(self._usock, self._on_accept)

    # -- the public side ----------------------------------------------------------------------
    def send(self, buf, dst: int, tag: int, timeout: float, record=None) -> Request:
        """Queue ``buf`` (1-D uint8) for rank ``dst``; the request completes once the bytes are
        written to the connection (small ones by this call, the rest by the progress thread)."""
        req = NativeRequest(self, SEND, buf, dst, tag, timeout, rank=self.rank, hosts=self.hosts, record=record)
        if dst not in self._connecting:
            self._start_connect(dst, req.deadline)
        return self._post(req, self._box.isend)

    def recv(self, buf, src: int | None, tag: int, timeout: float, record=None) -> Request:
        """Post a receive into ``buf`` (1-D uint8, writable) from rank ``src`` (None: any rank);
        the request's result is the source rank."""
        req = NativeRequest(self, RECV, buf, src, tag, timeout, rank=self.rank, hosts=self.hosts, record=record)
        return self._post(req, self._box.irecv)

    def post_short(self, comm, kind: str, buf, peer: int, tag: int, timeout: float, rec) -> ShortMessage:
        """The Communicator's short path (hpcring.collectives.p2p_api): post ``buf`` (1-D uint8)
        to the native queue with no Request; checked arguments, ``rec`` recorded already."""
        nid = next(self._ids)
        if kind == SEND:
            if peer not in self._connecting:
                self._start_connect(peer, time.monotonic() + timeout)
            n = self._box.isend(nid, buf, peer, tag, timeout)
        else:
            n = self._box.irecv(nid, buf, peer, tag, timeout)
        return ShortMessage(comm, self, n, nid, rec, kind, peer, tag, buf.nbytes, timeout)

    def _post(self, req: NativeRequest, post) -> NativeRequest:
        req.id = next(self._ids)
        self._pending[req.id] = req
        req.native = post(req.id, req.buf, -1 if req.peer is None else req.peer, req.tag, req.timeout)
        req.settle()        # done already: written inline, an unexpected message, or refused
        return req

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for sock in (self._lsock, self._usock):
            if sock is None:
                continue
            ACCEPTOR.unregister(sock)
            try:
                sock.close()
            except OSError:
                pass
        self._box.close()           # fails what is pending; the notifier settles it, then ends
        for t in [self._notifier] + self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        for r in list(self._pending.values()):
            r.settle()

    def _notify(self) -> None:
        """Settle the requests that completed while nobody waited (failures at their deadline
        included), so callbacks and torch futures learn of them on time."""
        box = self._box
        while True:
            ids = box.take_done(1.0)
            if ids is None:
                return
            for i in ids:
                r = self._pending.get(i)
                if r is not None:
                    r.settle()

    # -- connections ----------------------------------------------------------------------------
    def _who(self, r: int) -> str:
        return f"rank {r} ({self.hosts[r] if r < len(self.hosts) else '?'})"

    def _start_connect(self, r: int, deadline: float) -> None:
        with self._lock:
            if r in self._connecting or self._closed:
                return
            self._connecting.add(r)
            t = threading.Thread(target=self._connector, args=(r, deadline), name=f"hpcring-p2p-connect:{self.rank}>{r}",
                                 daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _connector(self, r: int, deadline: float) -> None:
        try:
            s = self._connect(r, deadline)
        except (OSError, ConnectionError, TimeoutError) as e:
            if not self._closed:
                self._box.fail_peer(r, f"no point-to-point connection to {self._who(r)}: {e}", 1)
            return
        try:
            direct = self._offer_direct(s) if s.family == socket.AF_UNIX else False
        except (OSError, ConnectionError) as e:
            s.close()
            if not self._closed:
                self._box.fail_peer(r, f"no point-to-point connection to {self._who(r)}: {e}", 1)
            return
        self._hand_over(s, r, incoming=False, direct=int(direct))

    def direct_counts(self) -> tuple[int, int]:
        """(messages this rank offered for a direct read, messages it read directly)."""
        return self._box.direct_counts()

    def _offer_direct(self, s: socket.socket) -> bool:
        """Connector, on a Unix connection after the handshake: offer the address of the probe
        word (0: no direct reads); True when the listener read it."""
        on = bool(envvars.get("HPCRING_P2P_DIRECT"))
        s.sendall(_OFFER.pack(ctypes.addressof(self._probe) if on else 0, self._probe.value if on else 0))
        return recv_exact(s, 1) == b"\x01" and on

    def _answer_direct(self, s: socket.socket) -> int:
        """Listener, on a Unix connection after the handshake: the connector's pid when this rank
        read its probe word there (direct reads from it), else 0; the answer goes back."""
        addr, value = _OFFER.unpack(recv_exact(s, _OFFER.size))
        pid = 0
        if addr and envvars.get("HPCRING_P2P_DIRECT"):
            pid = _PEERCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
            try:
                ok = pid > 0 and int.from_bytes(_native.peek(pid, addr, 8), sys.byteorder) == value
            except OSError as e:     # EPERM: ptrace rules (Yama, containers); ESRCH: another pid namespace
                log.info("p2p rank %d: cannot read the memory of pid %d (%s): messages from it go "
                         "through the socket", self.rank, pid, e.strerror or e)
                ok = False
            pid = pid if ok else 0
        s.sendall(b"\x01" if pid else b"\x00")
        return pid

    def _hand_over(self, s: socket.socket, r: int, incoming: bool, direct: int = 0) -> None:
        if s.family == socket.AF_UNIX:
            _unix_buffers(s)
        else:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._box.set_fd(r, s.fileno(), incoming, direct)
        except ValueError as e:
            if not self._closed:
                log.warning("p2p rank %d: refused a connection with rank %d: %s", self.rank, r, e)
            s.close()
            return
        s.detach()                  # the native queue owns the descriptor now

    def _connect(self, r: int, deadline: float) -> socket.socket:
        """Connect to rank ``r`` once its address is published, and authenticate."""
        delay = 0.002
        key = f"{self.base}/addr/{r}"
        while True:
            if self._closed:
                raise ConnectionError("closed")
            text = self.store.check(key)
            if text is not None:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._who(r)} never opened point-to-point (no address published)")
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        tcp, _, unix = text.decode().partition(" unix:")
        host, _, port = tcp.rpartition(":")
        wait = max(0.5, min(10.0, deadline - time.monotonic()))
        s = None
        if unix and max(r, self.rank) < len(self.hosts) and self.hosts[r] == self.hosts[self.rank] \
                and envvars.get("HPCRING_P2P_UNIX"):
            s = _unix_connect(unix, wait)
        if s is None:
            s = socket.create_connection((host, int(port)), timeout=wait)
        try:
            self._auth_connector(s, self.secret, f"{self.base}/{r}".encode(), self.rank, 0)
        except BaseException:
            s.close()
            raise
        return s

    def _on_accept(self, s: socket.socket, addr) -> None:
        """A new connection (from the shared acceptor): authenticate it on a thread of its own,
        so a slow or hostile connector delays nobody."""
        t = threading.Thread(target=self._handshake, args=(s, addr), name=f"hpcring-p2p-auth:{self.rank}", daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _handshake(self, s: socket.socket, addr) -> None:
        ctx = f"{self.base}/{self.rank}".encode()
        try:
            s.setblocking(True)
            s.settimeout(handshake_timeout())
            r, _ = self._auth_listener(s, self.secret, ctx, self.size, 1)
            if r == self.rank:
                raise ConnectionError("a connection from this very rank")
            direct = self._answer_direct(s) if s.family == socket.AF_UNIX else 0
        except (OSError, ConnectionError) as e:
            log.warning("p2p rank %d: refused connection from %s: %s", self.rank, _peer_name(addr), e)
            s.close()
            return
        if self._closed:
            s.close()
            return
        self._hand_over(s, r, incoming=True, direct=direct)


# AF_UNIX socket buffers: the default (net.core.wmem_default, often 208 KiB) splits a 256 KiB
# message into several wake-ups; 4 MiB (capped by the kernel at net.core.wmem_max) measured a
# 256 KiB round trip in Python at 86 us against 126 us with the default
UNIX_BUF = 4 << 20
_UNIX_PREFIX = "hpcring-p2p-"
_OFFER = struct.Struct(">QQ")           # direct reads: the probe word's address and value
_PEERCRED = struct.Struct("3i")         # struct ucred: pid, uid, gid


def _unix_listener() -> tuple[socket.socket, str]:
    """A listening Unix socket in the abstract namespace (no file to remove: the name goes with
    the socket) under a random name; (socket, name to publish)."""
    name = secrets.token_hex(12)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("\0" + _UNIX_PREFIX + name)
        s.listen(64)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s, name


def _unix_connect(name: str, timeout: float) -> socket.socket | None:
    """Connect to a same-host peer's Unix listener; None where this network namespace does not
    see it (another container or namespace on the same host: the caller uses TCP)."""
    if not name or len(name) > 64 or not all(c in "0123456789abcdef" for c in name):
        return None             # not what _unix_listener publishes: use TCP
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect("\0" + _UNIX_PREFIX + name)
    except OSError:
        s.close()
        return None
    return s


def _unix_buffers(s: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, UNIX_BUF)
        except OSError:
            pass


def _peer_name(addr) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return "a same-host Unix socket"


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
