"""A rank's trigger listener: the receiving end of :mod:`hpcring.diagnostics.watchdog.wire`'s
exchange. Every rank listens on a TCP port of its own (published once as ``diag/addr/<rank>``),
from one thread and one ``poll()`` loop (:class:`Listener`)."""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from hpcring.bootstrap import auth
from hpcring.diagnostics.watchdog import wire

log = logging.getLogger("hpcring.diagnostics.fanout")     # its name before the move (a logging config may name it)

MAX_PENDING = 1024            # connections a listener reads at once (a root has up to 7 log8 n children)
PARSED = -1                  # _In.step: the message is in, the reply is the caller's to give


class _In:
    """One connection a :class:`Listener` reads: a non-blocking socket stepping through the
    listener's side of :func:`wire.send`'s exchange (greeting, proof, body, acknowledgement)."""

    __slots__ = ("sock", "state", "out", "buf", "want", "ns", "nc", "extra", "digest", "msg", "deadline", "reply")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.msg, self.reply = sock, deadline, None, b""
        self.ns, greeting = auth.DIAG.hello()
        self.state, self.out, self.buf, self.want = "hello", greeting, bytearray(), auth.DIAG.proof_len
        self.nc = self.extra = self.digest = b""

    def step(self, secret: bytes) -> int | None:
        """Move on after the socket became ready; the events to wait for next, :data:`PARSED`
        when ``msg`` holds the message (answer it: :meth:`answer`), or None when the exchange
        is over. Raises on anything unauthenticated,
        over the cap or malformed: nothing is parsed before its MAC and digest are checked.
        Each step does what it can without waiting (the sender sends its proof and body
        together, so they are usually read in one call): on a loaded node every system call
        and wake-up of this thread costs a hand-over of the interpreter."""
        s = self.sock
        if self.out:                           # states "hello" and "answer": writing
            self.out = self.out[s.send(self.out):]
            if self.out:
                return selectors.EVENT_WRITE
            if self.state == "answer":
                return None
            self.state = "proof"
            return selectors.EVENT_READ        # the sender needs a round trip to answer
        chunk = s.recv(max(self.want - len(self.buf), 1 << 16) if self.state == "proof" else
                       min(self.want - len(self.buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed by the sender ({self.state})")
        self.buf += chunk
        if self.state == "proof":              # the MAC first: nothing else is looked at before it
            if len(self.buf) < self.want:
                return selectors.EVENT_READ
            proof_len = auth.DIAG.proof_len
            self.nc, self.extra = auth.DIAG.check(secret, self.ns, bytes(self.buf[:proof_len]))
            length, self.digest = wire._EXTRA.unpack(self.extra)
            if length > wire.MAX_BODY:
                raise ConnectionError(f"message of {length} bytes is over the {wire.MAX_BODY}-byte cap")
            self.state, self.buf, self.want = "body", self.buf[proof_len:], length
        if len(self.buf) < self.want:
            return selectors.EVENT_READ
        if len(self.buf) > self.want:
            raise ConnectionError(f"{len(self.buf) - self.want} bytes past the message's authenticated length")
        self.msg = wire.unpack(wire._digested(bytes(self.buf), self.digest, "message body"))
        self.state = "parsed"
        return PARSED

    def answer(self, secret: bytes, reply: bytes) -> int | None:
        """Acknowledge the message with ``reply`` (may be empty); the events to wait for, or
        None when it went out whole (a few bytes into an empty send buffer: at once)."""
        self.state, self.reply = "answer", reply
        self.out = wire._answer(secret, self.ns, self.nc, self.extra, reply)
        try:
            self.out = self.out[self.sock.send(self.out):]
        except BlockingIOError:
            pass
        return selectors.EVENT_WRITE if self.out else None


class Listener:
    """A rank's trigger listener: one thread and one selector over the listening socket and every
    connection being read (non-blocking, each stepping through the handshake on its own:
    :class:`_In`). A parent hears its children's subtrees in parallel and a slow or silent peer
    delays only its own message (each connection has :func:`wire.step` to finish), with no thread per
    connection or message: on a node running many ranks every thread start and GIL hand-over
    counts (docs/scale.md). ``on_message(dict)`` is called in that thread for every authenticated
    message, before it is acknowledged; it must not block, and what it returns (bytes) goes back
    to the sender with the acknowledgement (:func:`wire.send`'s value). ``on_unsent(msg)`` is called
    when a non-empty reply could not be sent whole (the sender left or timed out)."""

    def __init__(self, bind: str, secret: bytes, on_message: Callable[[dict], bytes | None],
                 on_unsent: Callable[[dict], None] | None = None) -> None:
        self._secret, self._on_message, self._on_unsent = secret, on_message, on_unsent
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind, 0))
            self._sock.listen(128)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._closing = False
        self._conns: dict[socket.socket, _In] = {}
        self._paused = False                                   # not accepting: MAX_PENDING being read
        self._thread = threading.Thread(target=self._serve, name="hpcring-watchdog-listen", daemon=True)

    def start(self) -> "Listener":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)    # wakes the loop's poll() (Linux)
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        if not self._thread.is_alive():
            self._release()

    def _release(self) -> None:
        for s in [self._sock, *self._conns]:
            try:
                s.close()
            except OSError:
                pass
        self._conns.clear()

    def _serve(self) -> None:
        # Blocked in poll() until a connection, a byte, a connection's deadline or close(): no
        # periodic wake-up, which thousands of idle ranks per node would pay for. poll(2), not
        # epoll: no descriptor of its own, and a rank's listener watches a handful at most.
        sel = selectors.PollSelector()
        try:
            sel.register(self._sock, selectors.EVENT_READ, None)
            while not self._closing:
                first = min((c.deadline for c in self._conns.values()), default=None)
                timeout = None if first is None else max(0.0, first - time.monotonic())
                for key, _ in sel.select(timeout):
                    if self._closing:
                        return
                    if key.data is None:
                        self._accept(sel)
                    else:
                        self._step(sel, key.data)
                now = time.monotonic()
                for c in [c for c in self._conns.values() if c.deadline <= now]:
                    self._drop(sel, c, TimeoutError(f"no message within {wire.step():g} s ({c.state})"))
        except (OSError, ValueError) as e:
            if not self._closing:
                log.warning("watchdog listener stopped: %s", e)
        finally:
            sel.close()
            if self._closing:
                self._release()

    def _accept(self, sel) -> None:
        while True:
            if len(self._conns) >= MAX_PENDING:   # full: the backlog waits until one is done
                sel.unregister(self._sock)        # (a readable socket left in the set would spin)
                self._paused = True
                return
            try:
                conn, _peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:           # out of descriptors: the pending ones finish first
                if self._closing:
                    return
                log.warning("watchdog listener: accept failed: %s", e)
                time.sleep(0.1)            # the socket stays readable: not a busy loop
                return
            conn.setblocking(False)
            c = _In(conn, time.monotonic() + wire.step())
            self._conns[conn] = c
            sel.register(conn, selectors.EVENT_WRITE, c)
            self._step(sel, c)                 # the greeting, at once: a new socket can take it

    def _step(self, sel, c: _In) -> None:
        try:
            events = c.step(self._secret)
            if c.state in ("body", "answer"):      # authenticated: time runs per step, as a
                c.deadline = time.monotonic() + wire.step()   # blocking read's timeout would
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ConnectionError, ValueError, EOFError) as e:
            self._drop(sel, c, e)
            return
        if events == PARSED:
            reply = None
            if not self._closing:
                try:
                    reply = self._on_message(c.msg)
                except Exception:  # noqa: BLE001 - the listener outlives a bad handler call
                    log.exception("watchdog trigger handler failed")
            try:
                events = c.answer(self._secret, bytes(reply) if isinstance(reply, (bytes, bytearray)) else b"")
            except OSError as e:
                self._drop(sel, c, e)
                return
        if events is not None:
            sel.modify(c.sock, events, c)
            return
        self._drop(sel, c, None)

    def _drop(self, sel, c: _In, error: BaseException | None) -> None:
        if error is not None:
            log.warning("watchdog listener: dropped a connection: %s", error)
        sel.unregister(c.sock)
        del self._conns[c.sock]
        c.sock.close()
        if self._paused and not self._closing:
            sel.register(self._sock, selectors.EVENT_READ, None)
            self._paused = False
        if error is not None and c.state == "answer" and c.reply and self._on_unsent is not None:
            try:
                self._on_unsent(c.msg)
            except Exception:  # noqa: BLE001
                log.exception("watchdog reply fallback failed")

