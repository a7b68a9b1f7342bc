"""The MPI backend's point-to-point waits (collectives/mpi_p2p.py): the waiting thread tests its own
MPI request, never at the same time as the poller (MPI forbids two threads testing one request),
and the deadline, a wait's own timeout and MPI errors end it as the poller would.

MPI here is a fake with mpi4py's names and call shapes (``Request.Test(status)``, ``Cancel()``,
``Status.Get_count(datatype)``/``Get_source()``, ``Exception.Get_error_class/string``); the real
library is exercised by tests/integration/test_torch_p2p.py and test_mpi_backend.py under mpirun."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpcring.collectives import mpi_p2p
from hpcring.collectives.p2p import KEEPER
from hpcring.errors import CollectiveError


class FakeMPI:
    BYTE = "byte"

    class Exception(Exception):  # noqa: A001 - mpi4py's name
        def Get_error_class(self):
            return 15

        def Get_error_string(self):
            return "MPI_ERR_TRUNCATE: message truncated"

    class Status:
        def __init__(self):
            self.count, self.source = 0, -1

        def Get_count(self, datatype):
            return self.count

        def Get_source(self):
            return self.source


class FakeRequest:
    """Completes on its ``after``-th Test (None: never); records who tested it, and fails the test
    if two threads test it at once."""

    def __init__(self, after, count=4, source=1, error=False):
        self.after, self.count, self.source, self.error = after, count, source, error
        self.tests, self.threads, self.cancelled, self.overlap = 0, set(), False, False
        self._in = threading.Lock()

    def Test(self, status):
        if not self._in.acquire(blocking=False):
            self.overlap = True
            return False
        try:
            time.sleep(20e-6)              # a window for an overlapping test to show
            self.tests += 1
            self.threads.add(threading.current_thread().name)
            if self.error:
                raise FakeMPI.Exception()
            if self.after is not None and self.tests >= self.after:
                status.count, status.source = self.count, self.source
                return True
            return False
        finally:
            self._in.release()

    def Cancel(self):
        self.cancelled = True


@pytest.fixture
def poller():
    return mpi_p2p._Poller(FakeMPI, "test-mpi-p2p")


def request(poller, mreq, kind="recv", nbytes=4, timeout=10.0, abandoned=None):
    req = mpi_p2p.MpiRequest(kind, np.zeros(nbytes, np.uint8), 1, 7, timeout, rank=0, hosts=["n0", "n1"])
    req.poller = poller
    req.on_abandon = (lambda r, m: abandoned.append((r, m))) if abandoned is not None else None
    poller.add(req, mreq)
    return req


def test_the_waiter_tests_its_own_request_and_never_beside_the_poller(poller):
    for after in (1, 5, 200):
        mreq = FakeRequest(after)
        req = request(poller, mreq)
        req.drive()
        assert req.finished and req.source == 1
        assert not mreq.overlap
    # most tests of a request someone waits on are the waiter's (the poller may have had one go)
    assert threading.current_thread().name in mreq.threads


def test_the_poller_completes_what_nobody_waits_on(poller):
    mreq = FakeRequest(3)
    req = request(poller, mreq)
    t0 = time.monotonic()
    while not req.finished and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert req.finished and mreq.threads == {"test-mpi-p2p"}


def test_a_wait_timeout_hands_the_request_back_to_the_poller(poller):
    mreq = FakeRequest(None)
    req = request(poller, mreq)
    t0 = time.monotonic()
    req.drive(0.05)
    assert 0.04 < time.monotonic() - t0 < 2.0 and not req.finished
    mreq.after = mreq.tests + 2            # now it completes: the poller must be the one to see it
    t0 = time.monotonic()
    while not req.finished and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert req.finished and not mreq.overlap


def test_a_deadline_while_the_waiter_holds_it_fails_it_and_abandons_the_mpi_request(poller):
    mreq, abandoned = FakeRequest(None), []
    req = request(poller, mreq, timeout=0.3, abandoned=abandoned)

    def expired(r):                        # what MpiPointToPoint._p2p_expired does, in short
        m = poller.forget(r)
        if m is not None:
            abandoned.append((r, m))
        r.fail("rank 1 (n1) did not send it within the 0.3 s deadline")
    KEEPER.watch(req, expired)
    t0 = time.monotonic()
    req.drive()                            # no timeout of its own: the deadline ends it
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert abandoned == [(req, mreq)]      # once, by whoever held it
    with pytest.raises(CollectiveError, match=r"waited for recv from rank 1 \(n1\), tag 7, 4 B: rank 1 \(n1\) "
                                              r"did not send it within the 0.3 s deadline"):
        req.wait(0)


def test_mpi_errors_and_size_mismatches_fail_the_request_with_their_wording(poller):
    req = request(poller, FakeRequest(1, error=True))
    req.drive()
    with pytest.raises(CollectiveError, match="MPI error 15: MPI_ERR_TRUNCATE"):
        req.wait(0)
    req = request(poller, FakeRequest(1, count=8), nbytes=4)
    req.drive()
    with pytest.raises(CollectiveError, match="rank 1 sent 8 bytes but this receive takes 4"):
        req.wait(0)


# ---- the Communicator's short path on MPI (MpiShortMessage) ------------------------------------
class FakeComm:
    """What MpiShortMessage asks of the Communicator: the failure path (the watchdog's report)."""

    def __init__(self):
        self.failed = []

    def _failed(self, rec, err):
        self.failed.append(rec)
        return err


class FakeBackend(mpi_p2p.MpiPointToPoint):
    """The MPI backend's point-to-point over FakeMPI: each post takes the next FakeRequest."""

    def __init__(self, *mreqs):
        self._MPI, self._rank, self._hosts, self._stuck = FakeMPI, 0, ("n0", "n1"), []
        self._tag_ub = None                     # asked once of MPI: nothing to ask here
        self._comm = self
        self.mreqs = list(mreqs)

    def Isend(self, spec, peer, tag):
        return self.mreqs.pop(0)

    Irecv = Isend


def short(be, kind="recv", nbytes=4, timeout=10.0, comm=None):
    from hpcring.collectives.p2p import P2PLog
    rec = P2PLog(0, "mpi").queue(kind, 1, 7, "uint8", nbytes, timeout)
    return be.post_short(comm or FakeComm(), kind, np.zeros(nbytes, np.uint8), 1, 7, timeout, rec), rec


def test_a_short_message_is_tested_by_its_waiter_alone_and_finishes_its_record():
    from hpcring.collectives.recorder import DONE
    for after in (1, 5, 300):
        mreq = FakeRequest(after)
        be = FakeBackend(mreq)
        msg, rec = short(be)
        assert msg.wait() == 1 and msg.done() and msg.exception() is None
        assert mreq.threads == {threading.current_thread().name} and not mreq.overlap
        assert rec.state == DONE
    assert be._p2p_poller()._pending == {}      # never handed to the poller


def test_a_short_message_past_its_deadline_fails_in_the_general_paths_words_and_is_abandoned():
    mreq = FakeRequest(None)
    be, comm = FakeBackend(mreq), FakeComm()
    msg, rec = short(be, timeout=0.3, comm=comm)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match=r"waited for recv from rank 1 \(n1\), tag 7, 4 B: rank 1 \(n1\) "
                                              r"did not send it within the 0.3 s deadline") as e:
        msg.wait()
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert mreq.cancelled and be._stuck and be._stuck[0][0] is mreq
    assert comm.failed == [rec] and "hung" in e.value.hint


def test_a_short_wait_with_a_timeout_leaves_it_pending_and_a_later_wait_finishes_it():
    mreq = FakeRequest(None)
    msg, _ = short(FakeBackend(mreq))
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="did not finish within 0.1 s"):
        msg.wait(0.1)
    assert time.monotonic() - t0 < 2.0 and not msg.done()
    mreq.after = mreq.tests + 3
    assert msg.wait() == 1


def test_a_callback_hands_it_to_the_poller_which_completes_it_without_two_testers():
    mreq = FakeRequest(None)
    be = FakeBackend(mreq)
    msg, _ = short(be, kind="send")
    seen = []
    msg.add_done_callback(lambda m: seen.append(m.exception()))
    waiter = threading.Thread(target=lambda: seen.append(("waited", msg.wait())))
    waiter.start()
    time.sleep(0.05)
    mreq.after = mreq.tests + 2                 # now the poller sees it complete
    waiter.join(5)
    assert not waiter.is_alive() and seen[0] is None and seen[1] == ("waited", 1)
    assert "test-mpi-p2p" not in mreq.threads and not mreq.overlap
    assert all(name.startswith("hpcring-mpi-p2p") for name in mreq.threads)


def test_a_callback_added_after_it_finished_runs_at_once():
    msg, _ = short(FakeBackend(FakeRequest(1)))
    msg.wait()
    seen = []
    msg.add_done_callback(seen.append)
    assert seen == [msg]


def test_short_messages_report_mpi_errors_and_size_mismatches_in_the_general_paths_words():
    msg, _ = short(FakeBackend(FakeRequest(1, error=True)))
    with pytest.raises(CollectiveError, match="MPI error 15: MPI_ERR_TRUNCATE"):
        msg.wait()
    msg, _ = short(FakeBackend(FakeRequest(1, count=8)), nbytes=4)
    with pytest.raises(CollectiveError, match="rank 1 sent 8 bytes but this receive takes 4"):
        msg.wait()
    be = FakeBackend()
    be.Isend = lambda *a: (_ for _ in ()).throw(FakeMPI.Exception())   # the post itself fails
    msg, _ = short(be, kind="send")
    assert msg.done() and "MPI error 15" in str(msg.exception())
