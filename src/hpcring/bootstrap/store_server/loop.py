"""The store's selector loop and its connections' I/O: handshake first, then MAC-checked frames."""
from __future__ import annotations

import collections
import heapq
import hmac
import itertools
import logging
import selectors
import socket
import time

from hpcring.bootstrap import auth
from hpcring.bootstrap.store_server.conn import _Conn
from hpcring.bootstrap.store_server.listener import Listener
from hpcring.bootstrap.store_server.ops import Ops
from hpcring.bootstrap.store_server.ratelog import _RateLog
from hpcring.bootstrap.store_wire import (HEADER, MAC_LEN, _DIR_TO_CLIENT, _DIR_TO_SERVER, encode_frame,
                                          frame_mac, session_key)

log = logging.getLogger("hpcring.bootstrap.store")


class Loop:
    """One selector loop over the listener, the wake-up socket and every connection (run by
    StoreServer's thread until :meth:`stop`). A connection's bytes reach the op table only after
    its handshake, one frame at a time, each frame's MAC checked first; ``timers`` holds the
    deadlines of handshakes, partly received frames and parked requests."""

    def __init__(self, lsock: socket.socket, secret: bytes, *, address: str, stats: dict[str, int],
                 max_frame: int, max_connections: int, frame_timeout: float, handshake_timeout: float) -> None:
        self.address = address
        self.stats = stats
        self.max_frame = max_frame
        self.frame_timeout = frame_timeout
        self.handshake_timeout = handshake_timeout
        self._secret = secret
        self.rlog = _RateLog(log)
        self.conns: dict[_Conn, None] = {}       # open connections, oldest first
        self.runnable: collections.deque[_Conn] = collections.deque()   # answered, frames may be queued
        self.timers: list[tuple[float, int, _Conn]] = []   # (deadline, tie, conn) for hellos and GETs
        self._tie = itertools.count()
        self.listener = Listener(self, lsock, max_connections, handshake_timeout)
        self.ops = Ops(self, stats, max_frame)
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self.sel.register(lsock, selectors.EVENT_READ, "accept")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.stopping = False

    def stop(self) -> bool:
        """Ask :meth:`run` to end (from another thread); False if it was asked already."""
        if self.stopping:
            return False
        self.stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        return True

    def schedule(self, deadline: float, conn: _Conn) -> None:
        heapq.heappush(self.timers, (deadline, next(self._tie), conn))

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self.stopping:
                for sel_key, events in self.sel.select(self._next_timeout()):
                    self._dispatch(sel_key, events)
                    self._run_queued()
                now = time.monotonic()
                self._expire(now)
                self._run_queued()
                if self.listener.paused_until is not None and now >= self.listener.paused_until:
                    self.listener.resume()
        except Exception:   # a bug here would silently hang every rank; make it loud
            log.exception("store server %s crashed", self.address)
        finally:
            self._shutdown()

    def _dispatch(self, sel_key: selectors.SelectorKey, events: int) -> None:
        if sel_key.data == "accept":
            self.listener.accept()
        elif sel_key.data == "wake":
            try:
                self._wake_r.recv(64)
            except OSError:
                pass
        else:
            conn: _Conn = sel_key.data
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and not conn.closed:
                self._on_readable(conn)

    def _run_queued(self) -> None:
        """Serve the frames queued behind requests that were just answered (iteratively: a woken
        client's next SET may wake others; recursion could run arbitrarily deep)."""
        while self.runnable:
            conn = self.runnable.popleft()
            if not conn.closed and conn.pending is None:
                self._process(conn)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        t = 1.0
        if self.timers:
            t = min(t, self.timers[0][0] - now)
        if self.listener.paused_until is not None:
            t = min(t, self.listener.paused_until - now)
        return max(0.0, t)

    def _expire(self, now: float) -> None:
        while self.timers and self.timers[0][0] <= now:
            deadline, _, conn = heapq.heappop(self.timers)
            if conn.closed:
                continue
            if not conn.ready and conn.hello_deadline == deadline:
                self.drop(conn, "no handshake within %gs" % self.handshake_timeout, counter="rejected_handshake")
            elif conn.frame_deadline == deadline:
                self.drop(conn, f"a frame was not completed within {self.frame_timeout:g}s "
                                f"({len(conn.inbuf)} bytes of it received; slow or stalled peer)",
                          counter="slow_frame")
            elif conn.pending is not None and conn.wait_deadline == deadline:
                self.ops.time_out(conn)
                self.runnable.append(conn)   # the client may have queued nothing else, but be uniform

    def _shutdown(self) -> None:
        for sel_key in list(self.sel.get_map().values()):
            if isinstance(sel_key.data, _Conn):
                sel_key.data.closed = True
            try:
                sel_key.fileobj.close()
            except OSError:
                pass
        self.sel.close()
        self.listener.lsock.close()   # unregistered while accepting is paused, so not closed above
        self._wake_w.close()

    # -- connections ------------------------------------------------------------------------
    def drop(self, conn: _Conn, why: str, *, counter: str | None = None, level=logging.WARNING) -> None:
        if conn.closed:
            return
        if counter:
            self.stats[counter] += 1
        self.rlog(level, "store %s: dropped peer %s: %s", self.address, conn.peer, why)
        self.conns.pop(conn, None)
        conn.closed = True
        if conn.pending is not None:
            self.ops.leave(conn)
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _on_readable(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(262144)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.drop(conn, f"receive failed: {e}", level=logging.INFO)
            return
        if not chunk:
            self.drop(conn, "closed by peer", level=logging.DEBUG)
            return
        conn.inbuf += chunk
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        if not conn.ready and not self._handshake(conn):
            return
        while not conn.closed and conn.pending is None:
            body = self._next_body(conn)
            if body is None:
                break
            self.stats["frames"] += 1
            self.ops.handle(conn, body)
        if conn.closed or not conn.ready:
            return
        if len(conn.inbuf) > 2 * (self.max_frame + HEADER.size + MAC_LEN):
            self.drop(conn, f"{len(conn.inbuf)} bytes queued while a request is pending",
                      counter="rejected_frame")
        elif conn.inbuf and conn.pending is None:
            if conn.frame_deadline is None:   # a frame has started: it gets frame_timeout to finish
                conn.frame_deadline = time.monotonic() + self.frame_timeout
                self.schedule(conn.frame_deadline, conn)
        else:
            conn.frame_deadline = None

    def _handshake(self, conn: _Conn) -> bool:
        need = auth.STORE.proof_len
        if len(conn.inbuf) < need:
            return False
        frame = bytes(conn.inbuf[:need])
        del conn.inbuf[:need]
        try:
            nc, _ = auth.STORE.check(self._secret, conn.ns, frame)
        except auth.BadProof:
            self.drop(conn, "handshake MAC does not match this job's secret (unauthenticated peer)",
                      counter="rejected_handshake")
            return False
        conn.key = session_key(self._secret, conn.ns, nc)
        conn.ready = True
        self.stats["authenticated"] += 1
        self.send_raw(conn, auth.STORE.server_proof(self._secret, conn.ns, nc))
        return True

    def _next_body(self, conn: _Conn) -> bytes | None:
        """The next authenticated frame body, or None (incomplete, or the peer was dropped)."""
        buf = conn.inbuf
        if len(buf) < HEADER.size + MAC_LEN:
            return None
        (length,) = HEADER.unpack_from(buf, 0)
        if length > self.max_frame:
            self.drop(conn, f"frame of {length} bytes exceeds the cap of {self.max_frame}",
                      counter="rejected_frame")
            return None
        end = HEADER.size + MAC_LEN + length
        if len(buf) < end:
            return None
        mac = bytes(buf[HEADER.size:HEADER.size + MAC_LEN])
        body = bytes(buf[HEADER.size + MAC_LEN:end])
        if not hmac.compare_digest(mac, frame_mac(conn.key, _DIR_TO_SERVER, conn.recv_seq, body)):
            self.drop(conn, f"frame #{conn.recv_seq} has a bad MAC (forged, replayed or corrupted)",
                      counter="rejected_frame")
            return None
        del buf[:end]
        conn.recv_seq += 1
        conn.frame_deadline = None
        return body

    # -- output -----------------------------------------------------------------------------
    def reply(self, conn: _Conn, status: int, payload: bytes = b"") -> None:
        body = bytes([status]) + payload
        self.send_raw(conn, encode_frame(conn.key, _DIR_TO_CLIENT, conn.send_seq, body))
        conn.send_seq += 1

    def send_raw(self, conn: _Conn, data: bytes) -> None:
        if conn.closed:
            return
        conn.outbuf += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if len(conn.outbuf) > 4 * (self.max_frame + HEADER.size + MAC_LEN):
            self.drop(conn, f"{len(conn.outbuf)} reply bytes unread (peer does not read)", counter="rejected_frame")
            return
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self.drop(conn, f"send failed: {e}", level=logging.INFO)
            return
        want = bool(conn.outbuf)
        if want != conn.want_write:
            conn.want_write = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self.sel.modify(conn.sock, events, conn)
