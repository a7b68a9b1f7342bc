"""The Communicator's point-to-point short path (ShortMessage straight on the ring's native
queue) against the general path (Request + DrivenHandle): same data, sources, records and
failures; a watched message and a torch MessageWork learn of a failure at the deadline with
nobody waiting. Ranks are threads of this process over loopback TCP (as test_p2p_transport)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest


from hpcring.errors import CollectiveError


def _kind(h) -> str:
    return type(h).__name__


def _records(comm) -> list[tuple]:
    return [(r.seq, r.op, r.dtype, r.count, r.group, r.state, r.error) for r in comm.p2p_log.records()]


def _exchange(a, b) -> tuple:
    """A fixed schedule of messages both ways, tags out of order, numpy and torch buffers."""
    torch = pytest.importorskip("torch")
    got = []
    hs = [a.isend(np.arange(5, dtype=np.float32) + i, 1, tag=i % 2) for i in range(4)]
    for tag in (1, 0, 1, 0):
        y = np.empty(5, np.float32)
        got.append((b.recv(y, 0, tag=tag), y.tolist()))
    got.append([h.wait(5) for h in hs])
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    out = torch.empty(2, 3, dtype=torch.int64)
    h = b.irecv(out, 0, tag=9)
    a.send(t, 1, tag=9)
    got.append((h.wait(5), out.tolist()))
    b.send(np.array([7.5]), 0, tag=3)
    y = np.empty(1)
    got.append((a.recv(y, 1, tag=3), y.tolist()))
    return got, _records(a), _records(b)


def test_the_short_path_is_taken_for_the_common_message_and_not_for_the_rest(ranks):
    torch = pytest.importorskip("torch")
    a, b = ranks(2)
    assert _kind(a.isend(np.zeros(3), 1)) == "ShortMessage"          # the first one sets up the mailbox
    assert _kind(b.irecv(np.empty(3), 0)) == "ShortMessage"
    assert _kind(a.isend(torch.zeros(3), 1, tag=1)) == "ShortMessage"
    assert _kind(b.irecv(np.empty(3), None, tag=1)) == "DrivenHandle"  # any source: the general path
    assert _kind(a.isend(np.zeros(6)[::2], 1, tag=2)) == "DrivenHandle"  # not contiguous
    assert _kind(a.isend(torch.zeros(3, dtype=torch.bfloat16), 1, tag=3)) == "DrivenHandle"
    a.short_path = False
    assert _kind(a.isend(np.zeros(3), 1, tag=4)) == "DrivenHandle"


def test_short_and_general_paths_give_the_same_data_sources_and_records(ranks):
    short = _exchange(*ranks(2, short=True))
    general = _exchange(*ranks(2, short=False))
    assert short[0] == general[0]
    assert short[1] == general[1] and short[2] == general[2]
    # the records: one channel per pair and tag, numbered by its own count, all done
    assert [r[:5] for r in short[2][:4]] == [
        (1, "p2p", "float32", 5, ("rank 0 -> rank 1, tag 1", (0, 1))),
        (1, "p2p", "float32", 5, ("rank 0 -> rank 1, tag 0", (0, 1))),
        (2, "p2p", "float32", 5, ("rank 0 -> rank 1, tag 1", (0, 1))),
        (2, "p2p", "float32", 5, ("rank 0 -> rank 1, tag 0", (0, 1)))]
    assert {r[5] for r in short[1] + short[2]} == {"done"}


@pytest.mark.parametrize("short", [True, False])
def test_a_size_mismatch_fails_alike_on_both_paths(ranks, short):
    a, b = ranks(2, short=short)
    a.send(np.zeros(1), 1)                               # mailboxes set up: the next ones are short
    b.recv(np.empty(1), 0)
    a.send(np.zeros(8, np.float32), 1, tag=3)
    with pytest.raises(CollectiveError) as e:
        b.recv(np.empty(4, np.float32), 0, tag=3)
    msg = str(e.value)
    assert msg.startswith("rank 1 (node1) waited for recv from rank 0 (node0), tag 3, 16 B: "), msg
    assert "sent 32 B (32 bytes) but this receive takes 16 bytes" in msg, msg
    rec = b.p2p_log.records()[-1]
    assert (rec.seq, rec.group[0], rec.state) == (1, "rank 0 -> rank 1, tag 3", "failed")
    assert rec.error == msg


def _deadline_failure(ranks, short: bool) -> tuple[str, float, object]:
    a, b = ranks(2, timeout=1.0, short=short)
    a.send(np.zeros(1), 1)
    b.recv(np.empty(1), 0)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as e:
        b.recv(np.empty(1 << 20, np.uint8), 0, tag=7)
    return str(e.value), time.monotonic() - t0, b.p2p_log.records()[-1]


def test_a_deadline_fails_alike_on_both_paths(ranks):
    (ms, ts, rs), (mg, tg, rg) = _deadline_failure(ranks, True), _deadline_failure(ranks, False)
    assert ms == mg, (ms, mg)
    assert ms.startswith("rank 1 (node1) waited for recv from rank 0 (node0), tag 7, 1 MiB: ")
    assert 0.9 < ts < 5 and 0.9 < tg < 5
    assert (rs.state, rs.error, rs.group) == (rg.state, rg.error, rg.group) == ("failed", ms, rg.group)


def test_a_watched_message_nobody_waits_for_fails_at_its_deadline(ranks):
    a, b = ranks(2, timeout=1.0)
    a.send(np.zeros(1), 1)
    b.recv(np.empty(1), 0)
    h = b.irecv(np.empty(4), 0, tag=5)
    assert _kind(h) == "ShortMessage" and not h.done()
    seen = threading.Event()
    got = []
    t0 = time.monotonic()
    h.add_done_callback(lambda m: (got.append((m.exception(), time.monotonic() - t0)), seen.set()))
    assert seen.wait(10), "the callback never ran"
    err, dt = got[0]
    assert isinstance(err, CollectiveError) and "waited for recv from rank 0 (node0), tag 5, 32 B" in str(err)
    assert 0.8 < dt < 5
    assert h.done() and b.p2p_log.records()[-1].state == "failed"


def test_a_callback_added_after_completion_runs_at_once_and_done_polls_the_queue(ranks):
    a, b = ranks(2)
    a.send(np.zeros(1), 1)
    b.recv(np.empty(1), 0)
    h = a.isend(np.arange(3.0), 1, tag=2)
    y = np.empty(3)
    r = b.irecv(y, 0, tag=2)
    end = time.monotonic() + 10
    while not r.done() and time.monotonic() < end:      # done() alone finishes it (no wait)
        time.sleep(0.001)
    assert r.done() and r.exception() is None and y.tolist() == [0.0, 1.0, 2.0]
    calls = []
    r.add_done_callback(lambda m: calls.append(m.result()))
    assert calls == [0] and h.wait(5) == 1
    assert [x.state for x in b.p2p_log.records()] == ["done", "done"]


def test_torch_message_work_future_learns_of_a_failure_with_nobody_waiting(ranks):
    torch = pytest.importorskip("torch")
    from hpcring.distributed.work import MessageWork
    a, b = ranks(2, timeout=1.0)
    a.send(np.zeros(1), 1)
    b.recv(np.empty(1), 0)
    y = torch.empty(4)
    w = MessageWork(b.irecv(y, 0, tag=8), [y])
    f = w.get_future()
    assert w.get_future() is f and not w.is_completed()
    end = time.monotonic() + 10
    while not f.done() and time.monotonic() < end:
        time.sleep(0.005)
    assert f.done() and w.is_completed() and not w.is_success()
    with pytest.raises(Exception, match="waited for recv from rank 0 \\(node0\\), tag 8, 16 B"):
        f.wait()
    with pytest.raises(CollectiveError, match="tag 8"):
        w.wait()
    assert isinstance(w.exception(), CollectiveError)


def test_torch_message_work_completes_in_the_waiting_thread_with_the_tensors(ranks):
    torch = pytest.importorskip("torch")
    from hpcring.distributed.work import MessageWork
    a, b = ranks(2)
    x, y = torch.arange(4.0), torch.empty(4)
    ws = MessageWork(a.isend(x, 1, tag=1), [x])
    wr = MessageWork(b.irecv(y, 0, tag=1), [y])
    assert wr.wait() is True and ws.wait() is True
    assert torch.equal(y, x) and wr.is_success() and wr.source_rank() == 0
    assert wr.get_future().value()[0] is y                # made after completion: done at once
