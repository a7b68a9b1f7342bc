"""The Communicator's point-to-point (isend/irecv, send/recv, batches); mixed into
:class:`~hpcring.collectives.api.Communicator`."""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from hpcring.collectives.arrays import _DT2TAG, active_on, adapt, finish
from hpcring.collectives.engine import Handle
from hpcring.collectives.fastpath import _GENERAL
from hpcring.collectives.recorder import FlightRecorder
from hpcring.errors import CollectiveError, UsageError


class DrivenHandle(Handle):
    """The Communicator's handle of one message: waiting on it waits on the transport's request
    in the waiting thread (:meth:`hpcring.collectives.p2p.Request.drive`), so a receive that
    completes in C finishes here without a hand-off to another thread."""

    def __init__(self, name: str, req) -> None:
        super().__init__(name)
        self.request = req

    def drive(self, timeout: float | None = None) -> None:
        if not self.done():
            self.request.drive(timeout)

    def wait(self, timeout: float | None = None):
        self.drive(timeout)
        return super().wait(timeout)


_MAX_TAG = 2**31 - 1     # hpcring.collectives.p2p.MAX_TAG (that module loads with the first message)


class PointToPoint:
    """Messages between two ranks of the communicator (:mod:`hpcring.collectives.p2p`)."""

    def _p2p_short(self, kind: str, x, peer, tag, timeout: float | None):
        """The short path (ShortPath's rules, ``short_path = False`` turns it off): a message of one
        C-contiguous numpy array or CPU torch tensor to or from a named rank goes to the transport
        as a short message (the ring: the native queue's
        :class:`~hpcring.collectives.mailbox.ShortMessage`; MPI:
        :class:`~hpcring.collectives.mpi_p2p.MpiShortMessage`): the same checks, record (same
        channel and numbering), deadline and failure path as the general one, without its Request,
        DrivenHandle, callback and thread-safe events. Anything else: ``_GENERAL``."""
        if not self.short_path or self._ordered is not None:
            return _GENERAL
        if type(peer) is not int or peer == self.rank or not 0 <= peer < self.size:
            return _GENERAL                 # any source, or the general path's UsageError
        if type(tag) is not int or not 0 <= tag <= _MAX_TAG:
            return _GENERAL
        be = self.backend
        box = getattr(be, "_mailbox", _GENERAL)
        if box is _GENERAL:
            box = be if hasattr(be, "post_short") else _GENERAL   # MPI: the backend posts it
            if box is _GENERAL:
                return _GENERAL             # NCCL: stream-ordered, no short path
        if type(x) is np.ndarray:
            host = x
        else:
            host = self._tensor_view(x)
            if host is None:
                return _GENERAL
        dtag = _DT2TAG.get(host.dtype)
        flags = host.flags
        if dtag is None or not flags.c_contiguous or (kind == "recv" and not flags.writeable):
            return _GENERAL
        t = self.timeout if timeout is None else self._short_deadline(timeout)
        flat = host if host.ndim == 1 else host.reshape(-1)
        log = self.__dict__.get("_p2p_log") or self.p2p_log
        rec = log.queue(kind, peer, tag, dtag, flat.size, t, depth=3)
        try:
            if box is None:
                box = be._box()             # the first message sets the mailbox up
            return box.post_short(self, kind, flat.view(np.uint8), peer, tag, t, rec)
        except CollectiveError as e:
            raise self._failed(rec, e) from None
        except BaseException as e:
            FlightRecorder.finish(rec, e)
            raise

    @property
    def p2p_log(self):
        """This communicator's point-to-point records (:class:`hpcring.collectives.p2p.P2PLog`)."""
        log = self.__dict__.get("_p2p_log")
        if log is None:
            from hpcring.collectives.p2p import P2PLog  # deferred: point-to-point only (p2p ~2 ms)
            log = self.__dict__["_p2p_log"] = P2PLog(self.rank, self.backend.name, self.members)
        return log

    def _p2p(self, kind: str, x, peer, tag: int, timeout: float | None) -> Handle:
        return self._p2p_start([self._p2p_prepare(kind, x, peer, tag, timeout, depth=2)])[0]

    def _p2p_prepare(self, kind: str, x, peer, tag: int, timeout: float | None, depth: int) -> tuple:
        """Check the arguments (UsageError before anything moves) and record the message:
        (kind, Arr, peer, tag, deadline, record, CudaContext or None)."""
        from hpcring.collectives import p2p  # deferred: point-to-point only (p2p ~2 ms)
        what = "isend" if kind == p2p.SEND else "irecv"
        if kind not in (p2p.SEND, p2p.RECV):
            raise UsageError(f"batch_isend_irecv: op must be 'send' or 'recv', got {kind!r}")
        peer = p2p.check_peer(peer, self.rank, self.size, what, any_ok=kind == p2p.RECV)
        tag = p2p.check_tag(tag, what)
        if not hasattr(self.backend, "p2p_batch" if self._ordered is not None else f"p2p_{kind}"):
            raise UsageError(f"{what}: the {self.backend.name} backend has no point-to-point")
        if peer is None and self._ordered is not None:
            raise UsageError(f"{what}: the {self.backend.name} backend cannot receive from any rank "
                             "(NCCL has no wildcard receive)", hint="name the source rank")
        dev = self._cuda(x)
        with active_on(dev):
            a = adapt(x, None, f"{what} buffer", writable=kind == p2p.RECV, dev=dev)
        t = self._deadline(timeout)
        rec = self.p2p_log.queue(kind, peer, tag, a.tag, a.flat.size, t, depth=depth)
        return kind, a, peer, tag, t, rec, dev

    def _p2p_start(self, preps: list) -> list[Handle]:
        """Start prepared messages: on a host backend each at once (a transport request); on a
        stream-ordered one (NCCL) all as one group on the caller's stream."""
        if self._ordered is not None:
            return self._p2p_ordered(preps)
        handles = []
        for kind, a, peer, tag, t, rec, dev in preps:
            start = getattr(self.backend, f"p2p_{kind}")
            try:
                req = start(a.flat.view(np.uint8), peer, tag, t, rec)
            except CollectiveError as e:      # a lazy setup that failed: diagnosed like a collective
                raise self._failed(rec, e) from None
            h = DrivenHandle(req.name, req)
            req.add_done_callback(self._p2p_done(h, a, rec, dev))
            handles.append(h)
        return handles

    def _p2p_done(self, h: Handle, a, rec, dev):
        def done(r) -> None:
            err = r.exception()
            if err is None:
                if a.staged:
                    with active_on(dev):
                        finish(a, a)
                h._set(r.source)
                return
            # the failure path may wait for the job-wide report: never on a transport thread
            threading.Thread(target=lambda: h._set(error=self._failed(rec, err)), daemon=True,
                             name=f"hpcring-p2p-failure:{self.rank}").start()
        return done

    def _p2p_ordered(self, preps: list) -> list[Handle]:
        """NCCL: one group for all of ``preps``, completed like a device collective (its event
        recorded on the caller's stream; :class:`Completions` keeps the deadline)."""
        dev = preps[0][6]
        t = min(p[4] for p in preps)
        handles = [Handle(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}")
                   for kind, _, peer, *_ in preps]
        with active_on(dev):
            try:
                self.backend.p2p_batch([(kind, a.flat, peer) for kind, a, peer, *_ in preps], t,
                                       seq=preps[0][5].seq)
            except UsageError:
                raise
            except BaseException as e:  # noqa: BLE001 - every message of the group fails with it
                for h, p in zip(handles, preps):
                    h._set(error=self._failed(p[5], e) if h is handles[0] else e)
                return handles
        pending = self.backend.take_pending()
        for h, (kind, a, peer, tag, _, rec, _) in zip(handles, preps):
            if pending is None:
                FlightRecorder.finish(rec)
                h._set(peer)
                continue
            if dev is not None:
                pending.event.record(dev.stream)
            h.cuda_event = pending.event
            self._ordered.add(rec, pending, h, peer)
        return handles

    def isend(self, x, dst: int, tag: int = 0, *, timeout: float | None = None) -> Handle:
        """Send ``x`` to rank ``dst`` (of this communicator) with ``tag``; returns a
        :class:`Handle` at once (done when the bytes are handed to the transport; ``x`` must not
        change until then). The receiver must post a receive of the same byte size and tag."""
        m = self._p2p_short("send", x, dst, tag, timeout)
        return self._p2p("send", x, dst, tag, timeout) if m is _GENERAL else m

    def irecv(self, x, src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> Handle:
        """Receive into ``x`` (written in place) from rank ``src`` (None: any rank) with ``tag``;
        the :class:`Handle`'s result is the source rank. Messages of one sender and tag arrive in
        the order sent."""
        m = self._p2p_short("recv", x, src, tag, timeout)
        return self._p2p("recv", x, src, tag, timeout) if m is _GENERAL else m

    def send(self, x, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """:meth:`isend` and wait."""
        m = self._p2p_short("send", x, dst, tag, timeout)
        self._p2p_wait(self._p2p("send", x, dst, tag, timeout) if m is _GENERAL else m)

    def recv(self, x, src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> int:
        """:meth:`irecv` and wait; returns the source rank."""
        m = self._p2p_short("recv", x, src, tag, timeout)
        return self._p2p_wait(self._p2p("recv", x, src, tag, timeout) if m is _GENERAL else m)

    def batch_isend_irecv(self, ops: Sequence[tuple]) -> list[Handle]:
        """Start many sends and receives as one batch: ``ops`` are ``("send", x, peer[, tag])`` or
        ``("recv", x, peer[, tag])``; their order does not matter (nothing waits for another;
        on NCCL they are one group)."""
        preps = []
        for op in ops:
            kind, x, peer, *rest = op
            preps.append(self._p2p_prepare(kind, x, peer, rest[0] if rest else 0, None, depth=2))
        return self._p2p_start(preps) if preps else []

    @staticmethod
    def _p2p_wait(h: Handle):
        # the request's own deadline ends it (hpcring.collectives.p2p.KEEPER), the failure path
        # (watchdog report) adds its bounded wait
        return h.wait()
