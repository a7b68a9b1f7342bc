"""The MPI backend's point-to-point: MPI_Isend / MPI_Irecv completed by a poller thread."""
from __future__ import annotations

import threading
import time

from hpcring.errors import UsageError
from hpcring.collectives.p2p import KEEPER, Request


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

    def _p2p(self, kind: str, buf, peer, tag: int, timeout: float, record):
        if self._comm is None:
            timeout = self._setup("p2p", timeout)       # collective, as MPI_Comm_dup is
        MPI = self._MPI
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise UsageError("point-to-point on the MPI backend needs MPI_THREAD_MULTIPLE",
                             hint="use an MPI built with thread support (Open MPI is), or the ring backend")
        ub = self._comm.Get_attr(MPI.TAG_UB)
        if ub is not None and tag > ub:
            raise UsageError(f"{kind}: tag {tag} is above this MPI's MPI_TAG_UB ({ub})")
        req = Request(kind, buf, peer, tag, timeout, rank=self._rank, hosts=self._hosts, record=record)
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
        if mreq is not None:
            self._stuck.append((mreq, (req.buf,)))
            if req.kind == "recv":
                try:
                    mreq.Cancel()
                except self._MPI.Exception:
                    pass
        who = f"rank {req.peer} ({self._host_of(req.peer)})"
        if req.kind == "recv":
            req.fail(f"{'no rank sent it' if req.peer is None else who + ' did not send it'} within the "
                     f"{req.timeout:g} s deadline",
                     hint="the sender is late, hung, or sends with another tag or to another rank: look at its "
                          "log and stack (hpcring stacks JOB)")
        else:
            req.fail(f"{who} did not receive it within the {req.timeout:g} s deadline",
                     hint="the receiver is late, hung, or receives with another tag: look at its log")

    def _host_of(self, r: int) -> str:
        return self._hosts[r] if self._hosts and r < len(self._hosts) else "?"


class _Poller:
    """Completes point-to-point requests: tests each pending MPI request, backing off while none
    completes (50 us to 2 ms), and sleeps while there are none."""

    def __init__(self, MPI, name: str) -> None:
        self._MPI = MPI
        self._lock = threading.Lock()
        self._pending: dict = {}          # Request -> MPI request
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, req, mreq) -> None:
        with self._lock:
            self._pending[req] = mreq
        self._wake.set()

    def forget(self, req):
        with self._lock:
            return self._pending.pop(req, None)

    def _run(self) -> None:
        MPI = self._MPI
        delay = 50e-6
        while True:
            with self._lock:
                items = list(self._pending.items())
            if not items:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            progressed = False
            for req, mreq in items:
                status = MPI.Status()
                try:
                    done = mreq.Test(status)
                except MPI.Exception as e:
                    self.forget(req)
                    req.fail(f"MPI error {e.Get_error_class()}: {e.Get_error_string()}",
                             hint="a message larger than the receive (MPI_ERR_TRUNCATE) means the sizes differ")
                    progressed = True
                    continue
                if not done:
                    continue
                progressed = True
                if self.forget(req) is None:
                    continue                      # expired meanwhile
                if req.kind == "recv":
                    n = status.Get_count(MPI.BYTE)
                    if n != req.nbytes:
                        req.fail(f"rank {status.Get_source()} sent {n} bytes but this receive takes {req.nbytes}",
                                 hint="send and receive tensors of the same size and dtype")
                        continue
                    req.complete(status.Get_source())
                else:
                    req.complete()
            if progressed:
                delay = 50e-6
            else:
                time.sleep(delay)
                delay = min(delay * 2, 2e-3)
