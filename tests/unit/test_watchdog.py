"""The watchdog's protocol without a job: three "ranks" in one process (threads) around a real
store, abort off (no os._exit), so the decisions are visible: one trigger, one reporter, every
rank's snapshot in the report, an exited rank named as such, a lost side channel giving a
partial report instead of none."""
from __future__ import annotations

import threading
import types

import pytest

from hpcring.bootstrap.store_server import StoreServer
from hpcring.collectives.recorder import FlightRecorder
from hpcring.diagnostics.watchdog import Watchdog
from hpcring.errors import CollectiveError

SECRET = b"w" * 32
HOSTS = ("nodeA", "nodeB", "nodeC")


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("HPCRING_JOB_ID", "77")
    with StoreServer("127.0.0.1", 0, secret=SECRET) as srv:
        yield types.SimpleNamespace(port=srv.port, folder=tmp_path / "77")


class _Comm:
    """What the watchdog reads of a Communicator: its recorder and backend error."""

    def __init__(self, rank: int, done: int, stuck: bool) -> None:
        self.recorder = FlightRecorder(rank, len(HOSTS), "ring", capacity=64)
        self.backend = types.SimpleNamespace(error=None)
        for _ in range(done):
            rec = self.recorder.queue("allreduce", "float32", 1024, None, 5.0, site="train.py:10 in step")
            FlightRecorder.start(rec)
            FlightRecorder.finish(rec)
        self.stuck = None
        if stuck:
            self.stuck = self.recorder.queue("allreduce", "float32", 1024, None, 5.0, site="train.py:10 in step")
            FlightRecorder.start(self.stuck)


def _watchdog(job, rank: int, port: int | None = None) -> Watchdog:
    topo = types.SimpleNamespace(rank=rank, size=len(HOSTS), host=HOSTS[rank], hosts=HOSTS, interface="eth0")
    return Watchdog(topo, ("127.0.0.1", port or job.port), SECRET, grace=3.0, abort=False)


def test_one_trigger_one_report_every_rank_agrees(job):
    dogs = [_watchdog(job, r).start() for r in range(3)]
    comms = [_Comm(r, done=4, stuck=True) for r in range(3)]
    for d, c in zip(dogs, comms):
        d.register(c)
    err = CollectiveError("allreduce#5 on rank 1: no data from rank 2 (nodeC) for 5.0 s")
    results: dict[int, BaseException] = {}

    def fail(rank: int) -> None:       # ranks 1 and 2 both time out, at nearly the same time
        c = comms[rank]
        results[rank] = dogs[rank].on_failure(c, c.stuck, err)
    threads = [threading.Thread(target=fail, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for d in dogs:                          # rank 0 hears of it through its listener thread
        d._done.wait(10)
    reports = [d.report for d in dogs]
    assert all(r is not None for r in reports), "every rank gets the report, rank 0 (not failing) too"
    assert len({r.headline for r in reports}) == 1
    assert sorted(reports[0].where) == [0, 1, 2]            # every rank's snapshot reached the reporter
    assert reports[0].op["op"] == "allreduce" and reports[0].side_channel
    for rank in (1, 2):
        assert isinstance(results[rank], CollectiveError) and "COLLECTIVE FAILURE" in str(results[rank])
    assert (job.folder / "diag" / "hang-report.json").exists()
    assert {f"stacks-rank{r}.txt" for r in range(3)} <= {p.name for p in (job.folder / "diag").iterdir()}


def test_a_rank_that_exited_is_named_as_exited(job):
    dogs = [_watchdog(job, r).start() for r in range(3)]
    comms = [_Comm(r, done=4, stuck=r != 2) for r in range(3)]
    for d, c in zip(dogs, comms):
        d.register(c)
    dogs[2]._on_exit()                      # rank 2 left the job normally after 4 collectives
    dogs[0].on_failure(comms[0], comms[0].stuck, CollectiveError("allreduce#5: peer rank 2 closed"))
    rep = dogs[0].report
    assert rep is not None
    exited = [r for cat, ranks in rep.categories.items() if "exit" in cat for r in ranks]
    assert exited == [2], rep.categories
    assert "2" in rep.text() and "nodeC" in rep.text()


def test_without_the_side_channel_a_rank_reports_its_own_view(job):
    # nothing listens on this port: the store (rank 0) is gone
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    dog = _watchdog(job, 1, port=dead)
    comm = _Comm(1, done=2, stuck=True)
    dog.register(comm)
    dog.grace = 0.2                          # the wait for a report from others is grace + 5 s
    dog.on_failure(comm, comm.stuck, CollectiveError("allreduce#3: no data from rank 0"))
    rep = dog.report
    assert rep is not None and rep.side_channel is False
    assert list(rep.where) == [1]
