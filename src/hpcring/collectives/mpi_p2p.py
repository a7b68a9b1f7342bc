"""The MPI backend's point-to-point: MPI_Isend / MPI_Irecv, tested by the thread that waits on
one (no hand-off), else completed by a poller thread."""
from __future__ import annotations

import threading
import time

from hpcring.errors import UsageError
from hpcring.collectives.mpi_check import CHECK_SPIN_S
from hpcring.collectives.p2p import KEEPER, SEND, SHORT_CLAIM, Request, ShortHandle, failure
from hpcring.collectives.recorder import FlightRecorder

POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3      # the sleeps between tests while nothing completes


class MpiRequest(Request):
    """A Request whose waiting thread tests its MPI request itself: it takes the request from the
    poller (MPI forbids two threads testing one request at once), tests it without sleeping for
    ``CHECK_SPIN_S`` (a reply a network round trip away: the poller, backed off to 2 ms sleeps
    between messages, measured 2-3.6x Gloo's round trip across two dev cluster nodes), then with
    the poller's back-off, until it completes, fails at its deadline, or the wait's own timeout
    hands it back to the poller."""

    poller: "_Poller | None" = None
    on_abandon = None              # the backend's: what becomes of an MPI request past its deadline

    def drive(self, timeout: float | None = None) -> None:
        p = self.poller
        if self.finished or p is None:
            return
        mreq = p.forget(self)
        if mreq is None:               # finished, expired, or another waiter holds it
            return
        MPI = p.MPI
        t0 = time.monotonic()
        spin_end, delay = t0 + CHECK_SPIN_S, POLL_MIN_S
        end = None if timeout is None else t0 + timeout
        status = MPI.Status()
        while True:
            if self.finished:          # the keeper failed it at its deadline while this thread held it
                if self.on_abandon is not None:
                    self.on_abandon(self, mreq)
                return
            if p.test(self, mreq, status):
                return
            now = time.monotonic()
            if end is not None and now >= end:
                p.add(self, mreq)      # the caller's own bound: the poller goes on with it
                return
            if now > spin_end:
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)


class MpiPointToPoint:
    """Mixed into :class:`~hpcring.collectives.mpi.MpiBackend`."""

    # -- point-to-point -----------------------------------------------------------------------
    # MPI_Isend / MPI_Irecv on the communicator (its tags and matching: MPI's non-overtaking rule),
    # completed by one poller thread per communicator; the deadline is the keeper's
    # (hpcring.collectives.p2p). Needs MPI_THREAD_MULTIPLE: the poller tests while collectives run.
    def p2p_send(self, buf, peer: int, tag: int, timeout: float, record=None):
        return self._p2p("send", buf, peer, tag, timeout, record)

    def p2p_recv(self, buf, peer, tag: int, timeout: float, record=None):
        return self._p2p("recv", buf, peer, tag, timeout, record)

    def _p2p_ready(self, kind: str, tag: int, timeout: float) -> float:
        """The lazy setup (if due), MPI_THREAD_MULTIPLE and the tag's range (MPI_TAG_UB, asked once);
        the time left of ``timeout``."""
        if self._comm is None:
            timeout = self._setup("p2p", timeout)       # collective, as MPI_Comm_dup is
        ub = self.__dict__.get("_tag_ub", False)
        if ub is False:
            MPI = self._MPI
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise UsageError("point-to-point on the MPI backend needs MPI_THREAD_MULTIPLE",
                                 hint="use an MPI built with thread support (Open MPI is), or the ring backend")
            ub = self._tag_ub = self._comm.Get_attr(MPI.TAG_UB)
        if ub is not None and tag > ub:
            raise UsageError(f"{kind}: tag {tag} is above this MPI's MPI_TAG_UB ({ub})")
        return timeout

    def post_short(self, comm, kind: str, buf, peer: int, tag: int, timeout: float, rec) -> "MpiShortMessage":
        """The Communicator's short path (hpcring.collectives.p2p_api): MPI_Isend / MPI_Irecv of
        ``buf`` (1-D uint8) with no Request; checked arguments, ``rec`` recorded already."""
        timeout = self._p2p_ready(kind, tag, timeout)
        MPI = self._MPI
        try:
            mreq = (self._comm.Isend if kind == SEND else self._comm.Irecv)([buf, MPI.BYTE], peer, tag)
        except MPI.Exception as e:
            mreq = None
            err = e
        msg = MpiShortMessage(comm, self, mreq, rec, kind, peer, tag, buf, timeout)
        if mreq is None:                    # in the caller's thread: its failure path is safe here
            msg.fail(f"MPI error {err.Get_error_class()}: {err.Get_error_string()}", here=True)
        return msg

    def _p2p(self, kind: str, buf, peer, tag: int, timeout: float, record):
        timeout = self._p2p_ready(kind, tag, timeout)
        MPI = self._MPI
        req = MpiRequest(kind, buf, peer, tag, timeout, rank=self._rank, hosts=self._hosts, record=record)
        req.poller, req.on_abandon = self._p2p_poller(), self._p2p_abandon
        B = MPI.BYTE
        try:
            if kind == "send":
                mreq = self._comm.Isend([buf, B], peer, tag)
            else:
                mreq = self._comm.Irecv([buf, B], MPI.ANY_SOURCE if peer is None else peer, tag)
        except MPI.Exception as e:
            req.fail(f"MPI error {e.Get_error_class()}: {e.Get_error_string()}")
            return req
        KEEPER.watch(req, self._p2p_expired)
        self._p2p_poller().add(req, mreq)
        return req

    def _p2p_poller(self):
        p = getattr(self, "_poller", None)
        if p is None:
            p = self._poller = _Poller(self._MPI, f"hpcring-mpi-p2p:{self._rank}")
        return p

    def _p2p_expired(self, req) -> None:
        """The deadline passed: MPI cannot take back a started send; a receive is cancelled."""
        mreq = self._p2p_poller().forget(req)
        if mreq is not None:               # else its waiter holds it, and abandons it when it sees this
            self._p2p_abandon(req, mreq)
        req.fail(*self._p2p_late(req))

    def _p2p_late(self, req) -> tuple[str, str]:
        """(why, hint) of a message past its deadline: one wording for both paths."""
        who = f"rank {req.peer} ({self._host_of(req.peer)})"
        if req.kind == "recv":
            return (f"{'no rank sent it' if req.peer is None else who + ' did not send it'} within the "
                    f"{req.timeout:g} s deadline",
                    "the sender is late, hung, or sends with another tag or to another rank: look at its "
                    "log and stack (hpcring stacks JOB)")
        return (f"{who} did not receive it within the {req.timeout:g} s deadline",
                "the receiver is late, hung, or receives with another tag: look at its log")

    def _p2p_abandon(self, req, mreq) -> None:
        """MPI cannot take back a started send: it is kept (with its buffer) as stuck; a receive is
        cancelled."""
        self._stuck.append((mreq, (req.buf,)))
        if req.kind == "recv":
            try:
                mreq.Cancel()
            except self._MPI.Exception:
                pass

    def _host_of(self, r: int) -> str:
        return self._hosts[r] if self._hosts and r < len(self._hosts) else "?"


class MpiShortMessage(ShortHandle):
    """A message of the Communicator's short path on the MPI backend (as
    :class:`hpcring.collectives.mailbox.ShortMessage` is on the ring): the MPI request and its
    record, nothing more until asked. :meth:`wait` tests the request in the waiting thread
    (without sleeping for ``CHECK_SPIN_S``, then with the poller's back-off) and keeps the
    deadline itself; no Request, poller entry, deadline-keeper entry, event or lock per message.
    :meth:`add_done_callback` (a torch future) hands it to the poller and the keeper, as the
    general path's requests are, from then on. Same results, records and failures."""

    def __init__(self, comm, backend, mreq, rec, kind: str, peer: int, tag: int, buf, timeout: float) -> None:
        # no Handle.__init__: see ShortHandle
        self._comm, self._be, self._mreq, self.record = comm, backend, mreq, rec
        self.kind, self.peer, self.tag, self.buf, self.nbytes = kind, peer, tag, buf, buf.nbytes
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self._tlock = threading.Lock()      # MPI: one thread tests a request at a time
        self._watched = False               # in the poller and the keeper (add_done_callback)
        self._state = 0                     # 0 pending, 1 being finished, 2 finished
        self._result = self._error = self._event = self._callbacks = None

    @property
    def finished(self) -> bool:            # the keeper's and the poller's question
        return self._state != 0

    # -- finishing (Request's API, as the poller and the keeper call it) -----------------------
    def complete(self, source: int | None = None, error: BaseException | None = None, here: bool = False) -> bool:
        if not self._claim():
            return False
        if error is None:
            FlightRecorder.finish(self.record)
            self._set(self.peer if source is None else source)
        elif here:
            self._set(error=self._failure(error))
        else:   # the failure path may wait for the job-wide report: never on a transport thread
            threading.Thread(target=lambda: self._set(error=self._failure(error)), daemon=True,
                             name=f"hpcring-p2p-failure:{self._be._rank}").start()
        return True

    def fail(self, why: str, hint: str | None = None, here: bool = False) -> bool:
        be = self._be
        return self.complete(error=failure(be._rank, be._hosts or (), self.kind, self.peer, self.tag,
                                           self.nbytes, why, hint), here=here)

    def _failure(self, err: BaseException) -> BaseException:
        FlightRecorder.finish(self.record, err)
        return self._comm._failed(self.record, err)

    def _test_here(self, status, here: bool) -> bool:
        """Test once in this thread (never while the poller owns it); True once finished."""
        if self._state == 2:
            return True
        with self._tlock:
            if self._watched or self._state:
                return self._state == 2
            done, err = self._be._p2p_poller()._test(self._mreq, status)
        if done:
            self._finish(status, err, here)
        return self._state == 2

    def _finish(self, status, err, here: bool) -> None:
        MPI = self._be._MPI
        if err is not None:
            self.fail(f"MPI error {err.Get_error_class()}: {err.Get_error_string()}",
                      "a message larger than the receive (MPI_ERR_TRUNCATE) means the sizes differ", here=here)
        elif self.kind == "recv" and status.Get_count(MPI.BYTE) != self.nbytes:
            self.fail(f"rank {status.Get_source()} sent {status.Get_count(MPI.BYTE)} bytes but this receive "
                      f"takes {self.nbytes}", "send and receive tensors of the same size and dtype", here=here)
        else:
            self.complete(status.Get_source() if self.kind == "recv" else None)

    def _expire(self) -> None:
        """Past the deadline with nobody else testing it: abandoned (MPI cannot take back a started
        send; a receive is cancelled) and failed in the general path's words."""
        with self._tlock:
            if self._watched or self._state:
                return
            self._be._p2p_abandon(self, self._mreq)
        self.fail(*self._be._p2p_late(self), here=True)

    # -- the Handle API -------------------------------------------------------------------------
    def done(self) -> bool:
        if self._state != 2 and not self._watched and self._mreq is not None:
            self._test_here(self._be._MPI.Status(), here=False)
        return self._state == 2

    def wait(self, timeout: float | None = None):
        t0 = time.monotonic()
        end = None if timeout is None else t0 + timeout
        if self._state != 2 and not self._watched and self._mreq is not None:
            status = self._be._MPI.Status()
            spin_end, delay = t0 + CHECK_SPIN_S, POLL_MIN_S
            while not self._test_here(status, here=True) and not self._watched and not self._state:
                now = time.monotonic()
                if now >= self.deadline:
                    self._expire()
                    break
                if end is not None and now >= end:
                    break
                if now > spin_end:
                    time.sleep(min(delay, max(0.0, self.deadline - now), *(() if end is None else (end - now,))))
                    delay = min(delay * 2, POLL_MAX_S)
        if self._state != 2:                # watched (the poller finishes it), being finished, or `timeout`
            now = time.monotonic()
            self._wait_finished(max(0.0, end - now) if end is not None else max(0.0, self.deadline - now) + 5.0,
                                timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn) -> None:
        hand_over = False
        with self._tlock:                   # no waiter tests it meanwhile
            with SHORT_CLAIM:
                if self._state != 2:
                    if self._callbacks is None:
                        self._callbacks = []
                    self._callbacks.append(fn)
                    fn = None
                    hand_over = not self._watched and not self._state
                    self._watched = self._watched or hand_over
        if hand_over:                       # from now on as the general path's requests
            self._be._p2p_poller().add(self, self._mreq)
            KEEPER.watch(self, self._be._p2p_expired)
        if fn is not None:
            self._call(fn)


class _Poller:
    """Completes the point-to-point requests nobody is testing in its own wait: tests each pending
    MPI request, backing off while none completes (50 us to 2 ms), and sleeps while there are
    none. A request is tested under the lock, so a waiter that takes it (``forget``) never tests
    it at the same time, and only once it is ``CLAIM_S`` old: the thread that posted it usually
    waits on it at once, and a test beside that waiter only contends for MPI's lock and the GIL.
    Nor does a post wake the poller, unless it slept for lack of work for a second: between
    messages it naps ``POLL_MAX_S`` (a wake-up per message took the GIL from the waiting thread:
    115 us a round trip on the dev cluster where raw mpi4py took 15)."""

    CLAIM_S = 1e-3
    IDLE_S = 1.0

    def __init__(self, MPI, name: str) -> None:
        self.MPI = MPI
        self._lock = threading.Lock()
        self._pending: dict = {}          # Request -> (MPI request, when added)
        self._wake = threading.Event()
        self._asleep = False              # in the long idle wait: a post must wake it
        self._last_add = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, req, mreq) -> None:
        now = time.monotonic()
        with self._lock:
            self._pending[req] = (mreq, now)
            self._last_add = now
            wake = self._asleep
        if wake:
            self._wake.set()

    def forget(self, req):
        with self._lock:
            got = self._pending.pop(req, None)
        return None if got is None else got[0]

    def test(self, req, mreq, status) -> bool:
        """Test ``mreq`` once (the caller holds it: taken from the poller) and finish ``req`` when
        it completed. True when ``req`` is finished."""
        done, err = self._test(mreq, status)
        if done:
            self._finish(req, status, err)
        return done

    def _test(self, mreq, status):
        try:
            return bool(mreq.Test(status)), None
        except self.MPI.Exception as e:
            return True, e

    def _finish(self, req, status, err) -> None:
        """Finish ``req`` from its completed MPI request (callbacks run here: never under the lock)."""
        if err is not None:
            req.fail(f"MPI error {err.Get_error_class()}: {err.Get_error_string()}",
                     hint="a message larger than the receive (MPI_ERR_TRUNCATE) means the sizes differ")
        elif req.kind == "recv":
            n = status.Get_count(self.MPI.BYTE)
            if n != req.nbytes:
                req.fail(f"rank {status.Get_source()} sent {n} bytes but this receive takes {req.nbytes}",
                         hint="send and receive tensors of the same size and dtype")
            else:
                req.complete(status.Get_source())
        else:
            req.complete()

    def _run(self) -> None:
        MPI = self.MPI
        delay = POLL_MIN_S
        while True:
            now = time.monotonic()
            with self._lock:
                items = [(r, m) for r, (m, t) in self._pending.items() if now - t >= self.CLAIM_S]
                young = len(items) < len(self._pending)
                self._asleep = not self._pending and now - self._last_add > self.IDLE_S
                asleep = self._asleep
            if asleep:
                self._wake.wait(self.IDLE_S)
                self._wake.clear()
                continue
            progressed = False
            for req, mreq in items:
                status = MPI.Status()
                with self._lock:          # tested under the lock: a waiter taking it waits for this test
                    got = self._pending.get(req)
                    if got is None or got[0] is not mreq:
                        continue          # taken by its waiter, or expired, meanwhile
                    done, err = self._test(mreq, status)
                    if done:
                        del self._pending[req]
                if done:
                    self._finish(req, status, err)
                    progressed = True
            if progressed:
                delay = POLL_MIN_S
            else:
                time.sleep(min(delay, self.CLAIM_S) if young else delay)
                delay = min(delay * 2, POLL_MAX_S)
