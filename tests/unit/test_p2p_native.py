"""The native point-to-point queue (native/p2p_*.c, hpcring._native.P2P): matching order, receives
from any rank, unexpected messages, deadlines nobody waits for, closed peers. Ranks are P2P
objects of this process joined by socket pairs (what the mailbox hands over after its
handshake); the last tests go through the Communicator and its notifier."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from hpcring import _native
from hpcring.errors import CollectiveError

HOSTS = ["node0", "node1", "node2"]


@pytest.fixture
def boxes():
    """make(n) -> n P2P queues, every ordered pair joined by one one-way socket pair; the
    sockets are listed in make.socks[(src, dst)] (the sender's end)."""
    made = []

    def make(n: int):
        bs = [_native.P2P(r, n, HOSTS[:n]) for r in range(n)]
        make.socks = {}
        for s in range(n):
            for d in range(n):
                if s != d:
                    a, b = socket.socketpair()
                    bs[s].set_fd(d, a.detach(), False)
                    bs[d].set_fd(s, b.detach(), True)
        made.extend(bs)
        return bs
    yield make
    for b in made:
        b.close()


from helpers.p2p_native import done, recv, send  # noqa: E402


def test_messages_match_in_send_order_per_sender_and_tag_whatever_the_posting_order(boxes):
    a, b = boxes(2)
    ys = {tag: [np.zeros(2, np.int64) for _ in range(3)] for tag in (5, 6)}
    early = [recv(b, ys[6][0], 0, tag=6)]                         # posted before anything is sent
    sends = [send(a, np.full(2, i, np.int64), 1, tag=5 + i % 2) for i in range(6)]
    # post the rest in a scrambled order: tag 5's receives still get 0, 2, 4, tag 6's 1, 3, 5
    rest = [recv(b, ys[5][0], 0, tag=5), recv(b, ys[6][1], 0, tag=6), recv(b, ys[5][1], 0, tag=5),
            recv(b, ys[6][2], 0, tag=6), recv(b, ys[5][2], 0, tag=5)]
    for r in early + rest + sends:
        assert done(r)[0] is False
    assert [int(y[0]) for y in ys[5]] == [0, 2, 4]
    assert [int(y[0]) for y in ys[6]] == [1, 3, 5]


def test_a_receive_from_any_rank_names_the_source_and_takes_the_oldest_unexpected_first(boxes):
    a, b, c = boxes(3)
    for r, v in ((c, 2.0), (b, 1.0)):                              # c's message is queued first:
        done(send(r, np.array([v]), 0, tag=4))
        done(send(r, np.zeros(1), 0, tag=99))                      # a probe behind it on the same
        assert done(recv(a, np.zeros(1), 2 if r is c else 1, tag=99))[0] is False   # connection
    got = []
    for _ in range(2):
        y = np.zeros(1)
        failed, source, _, _ = done(recv(a, y, -1, tag=4))
        assert not failed
        got.append((source, float(y[0])))
    assert got == [(2, 2.0), (1, 1.0)]
    y = np.zeros(1)
    pending = recv(a, y, -1, tag=9)                                # posted before the data
    done(send(b, np.array([7.0]), 0, tag=9))
    assert done(pending)[:2] == (False, 1) and y[0] == 7.0


def test_an_unexpected_message_larger_than_the_receive_fails_only_that_receive(boxes):
    a, b = boxes(2)
    done(send(a, np.arange(1000, dtype=np.float32), 1, tag=3))    # 4000 B, before any receive
    done(send(a, np.zeros(1), 1, tag=99))                          # read once the probe behind it is
    assert done(recv(b, np.zeros(1), 0, tag=99))[0] is False
    failed, _, why, hint = done(recv(b, np.zeros(10, np.float32), 0, tag=3))
    assert failed and hint == 3
    assert why == "rank 0 (node0) sent 3.9 KiB (4000 bytes) but this receive takes 40 bytes", why
    y = np.zeros(4, np.float32)                                    # the pair goes on
    done(send(a, np.ones(4, np.float32), 1, tag=3))
    assert done(recv(b, y, 0, tag=3))[0] is False and (y == 1).all()


def test_a_posted_receive_of_the_wrong_size_fails_it_and_the_pair(boxes):
    a, b = boxes(2)
    r = recv(b, np.zeros(4, np.uint8), 0, tag=1)
    done(send(a, np.zeros(8, np.uint8), 1, tag=1))
    failed, _, why, hint = done(r)
    assert failed and hint == 3 and "sent 8 B (8 bytes) but this receive takes 4 bytes" in why
    failed, _, why, _ = done(recv(b, np.zeros(4, np.uint8), 0, tag=2))
    assert failed and why == "an earlier message from rank 0 (node0) did not match its receive"


def test_a_deadline_fails_the_receive_with_nobody_waiting_and_the_pair_stays_failed(boxes):
    a, b = boxes(2)
    r = recv(b, np.zeros(1 << 20, np.uint8), 0, tag=7, timeout=0.3)
    t0 = time.monotonic()
    ids = []
    while not ids and time.monotonic() - t0 < 5:                   # the notifier's view: no wait()
        ids = b.take_done(1.0)
    assert ids == [r.id] and 0.25 < time.monotonic() - t0 < 3.0
    failed, _, why, hint = r.result()
    assert failed and hint == 5
    assert why == "rank 0 (node0) did not send it within the 0.3 s deadline", why
    failed, _, why, _ = done(recv(b, np.zeros(1), 0, tag=7))
    assert failed and why == "an earlier recv from rank 0 (node0), tag 7, 1 MiB timed out"


def test_a_peer_that_closes_fails_pending_receives_and_sends_at_once(boxes):
    a, b = boxes(2)
    r = recv(b, np.zeros(1), 0, tag=1, timeout=30.0)
    t0 = time.monotonic()
    a.close()
    failed, _, why, hint = done(r, 10.0)
    assert time.monotonic() - t0 < 5                               # not the 30 s deadline
    assert failed and hint == 2 and why == "rank 0 (node0) closed its connection (it exited or failed)"
    failed, _, why, _ = done(send(b, np.zeros(1), 0))
    assert failed and "closed its connection" in why


def test_big_messages_both_ways_at_once_move_without_blocking_the_callers(boxes):
    a, b = boxes(2)
    n = 16 << 20                                                   # far beyond the socket buffers
    xa, xb = np.full(n, 1, np.uint8), np.full(n, 2, np.uint8)
    t0 = time.monotonic()
    sa, sb = send(a, xa, 1), send(b, xb, 0)
    assert time.monotonic() - t0 < 2                               # handed over, not written out
    ya, yb = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    ra, rb = recv(a, ya, 1), recv(b, yb, 0)
    for r in (sa, sb, ra, rb):
        assert done(r, 30.0)[0] is False
    assert (ya == 2).all() and (yb == 1).all()


def test_a_send_the_receiver_does_not_drain_fails_at_its_deadline():
    a = _native.P2P(0, 2, HOSTS[:2])
    x, y = socket.socketpair()                                     # y: a receiver that never reads
    try:
        a.set_fd(1, x.detach(), False)
        s = send(a, np.zeros(32 << 20, np.uint8), 1, timeout=0.5)
        queued = send(a, np.zeros(1, np.uint8), 1, timeout=30.0)
        failed, _, why, hint = done(s, 5.0)
        assert failed and hint == 4 and why == "the link with rank 1 (node1) stalled mid-message (deadline 0.5 s)"
        failed, _, why, _ = done(queued, 1.0)                      # the pair failed: the rest too
        assert failed and "stalled mid-message" in why
    finally:
        a.close()
        y.close()


def test_a_receive_posted_while_its_message_arrives_gets_every_byte_in_order():
    b = _native.P2P(1, 2, HOSTS[:2])
    x, y = socket.socketpair()                                     # x: rank 0 writing frames by hand
    try:
        b.set_fd(0, y.detach(), True)
        n = 1 << 20
        data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        head = struct.pack(">qQ", 5, n)                            # the wire: tag, bytes, big-endian
        x.sendall(head[:5])                                        # a header split across reads
        time.sleep(0.05)
        x.sendall(head[5:] + data[: n // 2].tobytes())
        time.sleep(0.2)                                            # half read, into a buffer of its own
        out = np.zeros(n, np.uint8)
        r = recv(b, out, 0, tag=5)
        assert r.result() is None
        x.sendall(data[n // 2:].tobytes() + struct.pack(">qQ", 6, 3) + b"abc")
        assert done(r)[0] is False and (out == data).all()
        small = np.zeros(3, np.uint8)
        assert done(recv(b, small, 0, tag=6))[0] is False and small.tobytes() == b"abc"
    finally:
        b.close()
        x.close()


def test_a_message_that_stalls_mid_way_fails_at_its_deadline_while_a_waiter_reads_the_connection():
    """A waiter on another receive (tag 1, 30 s) reads the connection, so the stalled message's
    bytes in flight (tag 2, 0.3 s, nobody waits on it) are that waiter's: the progress thread words
    the stall at tag 2's deadline, the waiter frees the bytes, and both receives fail at once,
    neither thread spinning on the other."""
    b = _native.P2P(1, 2, HOSTS[:2])
    x, y = socket.socketpair()                                     # x: rank 0 writing frames by hand
    try:
        b.set_fd(0, y.detach(), True)
        n = 1 << 20
        stalled = recv(b, np.zeros(n, np.uint8), 0, tag=2, timeout=0.3)
        waited = recv(b, np.zeros(4, np.uint8), 0, tag=1, timeout=30.0)
        th, out = _wait_in_thread(waited, 30.0)
        time.sleep(0.05)                                           # the waiter reads the connection
        t0 = time.monotonic()
        x.sendall(struct.pack(">qQ", 2, n) + bytes(n // 2))       # half the payload, then nothing
        th.join(10)
        assert out and out[0][0] and time.monotonic() - t0 < 3.0
        failed, _, why, hint = stalled.result()
        assert failed and hint == 4 and why == "the link with rank 0 (node0) stalled mid-message (deadline 0.3 s)", why
        failed, _, why, _ = waited.result()                        # the pair failed with it
        assert failed and "stalled mid-message" in why, why
    finally:
        b.close()
        x.close()


def test_a_frame_too_large_to_hold_fails_the_pair_instead_of_allocating():
    b = _native.P2P(1, 2, HOSTS[:2])
    x, y = socket.socketpair()
    try:
        b.set_fd(0, y.detach(), True)
        x.sendall(struct.pack(">qQ", 1, 1 << 62))                  # matches no receive: unexpected
        failed, _, why, _ = done(recv(b, np.zeros(1, np.uint8), 0, tag=2))   # fails with the pair
        assert failed and why == f"out of memory for a message of {1 << 62} bytes from rank 0 (node0)", why
    finally:
        b.close()
        x.close()


def _wait_in_thread(req, timeout=10.0):
    """req.wait(timeout) in a thread: (thread, out), out filled with (done, seconds) when it returns."""
    out = []
    t0 = time.monotonic()
    th = threading.Thread(target=lambda: out.append((req.wait(timeout), time.monotonic() - t0)), daemon=True)
    th.start()
    return th, out


def test_a_waiter_reads_its_peer_itself_and_messages_nobody_waits_for_still_complete(boxes):
    """A thread waiting on a receive reads the connection itself (the progress thread leaves the fd
    alone meanwhile): what it reads for receives nobody waits on reaches the notifier, and once
    the waiter has left, the progress thread reads the connection again."""
    a, b = boxes(2)
    y1, y2, y3 = np.zeros(4, np.int32), np.zeros(4, np.int32), np.zeros(4, np.int32)
    waited = recv(b, y1, 0, tag=1)
    th, out = _wait_in_thread(waited)
    time.sleep(0.3)                                                # parked in its own poll()
    unwatched = recv(b, y2, 0, tag=2)
    done(send(a, np.full(4, 2, np.int32), 1, tag=2))               # read by the parked waiter
    done(send(a, np.full(4, 1, np.int32), 1, tag=1))
    th.join(10)
    assert out and out[0][0] and waited.result()[0] is False and (y1 == 1).all()
    ids, t0 = [], time.monotonic()
    while unwatched.id not in ids and time.monotonic() - t0 < 5:   # the notifier's view
        ids += b.take_done(1.0)
    assert unwatched.id in ids and (y2 == 2).all()
    later = recv(b, y3, 0, tag=3)                                  # nobody waits: the progress thread
    done(send(a, np.full(4, 3, np.int32), 1, tag=3))
    ids, t0 = [], time.monotonic()
    while later.id not in ids and time.monotonic() - t0 < 5:
        ids += b.take_done(1.0)
    assert later.id in ids and (y3 == 3).all()


def test_two_waiters_on_one_peer_both_finish_whoever_reads(boxes):
    """One of them reads the connection, the other waits for it; messages come in the reverse
    order of the waits, many times over."""
    a, b = boxes(2)
    for i in range(50):
        ys = [np.zeros(8, np.int64) for _ in range(2)]
        rs = [recv(b, ys[k], 0, tag=10 + k) for k in range(2)]
        waits = [_wait_in_thread(r) for r in rs]
        for k in (1, 0):
            done(send(a, np.full(8, i * 10 + k, np.int64), 1, tag=10 + k))
        for th, out in waits:
            th.join(10)
            assert out and out[0][0], f"round {i}: a waiter was left waiting"
        assert [int(y[0]) for y in ys] == [i * 10, i * 10 + 1]


def test_a_parked_waiter_fails_at_the_receive_deadline_and_when_the_queue_closes(boxes):
    a, b = boxes(2)
    r = recv(b, np.zeros(1), 0, tag=1, timeout=0.3)
    t0 = time.monotonic()
    failed, _, why, hint = done(r, 10.0)                           # the wait's own bound is 10 s
    assert 0.25 < time.monotonic() - t0 < 3.0
    assert failed and hint == 5 and why == "rank 0 (node0) did not send it within the 0.3 s deadline", why
    c, d = boxes(2)
    r = recv(d, np.zeros(1), 0, tag=1, timeout=30.0)
    th, out = _wait_in_thread(r, 30.0)
    time.sleep(0.3)
    t0 = time.monotonic()
    d.close()
    th.join(10)
    assert out and out[0][0] and time.monotonic() - t0 < 3.0
    failed, _, why, _ = r.result()
    assert failed and why == "the communicator was closed"


def test_bad_handover_and_arguments_are_refused(boxes):
    a, b = boxes(2)
    x, y = socket.socketpair()
    with pytest.raises(ValueError, match="a second incoming connection with rank 1"):
        a.set_fd(1, x.fileno(), True)
    x.close()
    y.close()
    with pytest.raises(ValueError, match="peer rank 0 is not another rank"):
        a.isend(1, np.zeros(1, np.uint8), 0, 0, 1.0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        a.irecv(1, np.zeros(1, np.uint8), 1, 0, 0.0)
    with pytest.raises(BufferError, match="not writable"):         # a receive needs a writable buffer
        a.irecv(1, b"abc", 1, 0, 1.0)


def test_a_communicator_receive_nobody_waits_for_fails_its_callback_at_the_deadline(ranks):
    a, b = ranks(2, timeout=0.5)
    a.send(np.zeros(1), 1)                                         # connected: only the message is late
    b.recv(np.zeros(1), 0)
    seen = threading.Event()
    t0 = time.monotonic()
    when = []
    h = b.irecv(np.zeros(1), 0, tag=2)
    h.add_done_callback(lambda h_: (when.append(time.monotonic() - t0), seen.set()))
    assert seen.wait(5)                                            # nobody called wait()
    assert 0.4 < when[0] < 4.0, when
    with pytest.raises(CollectiveError, match=r"rank 0 \(node0\) did not send it within the 0.5 s deadline"):
        h.wait(0)


def test_a_communicator_round_trip_moves_every_byte(ranks):
    a, b = ranks(2)
    for n in (0, 1, 4097, 300_000):
        x = np.arange(n, dtype=np.uint8)
        y = np.zeros(n, np.uint8)
        h = b.irecv(y, 0, tag=n % 7)
        a.send(x, 1, tag=n % 7)
        assert h.wait(10) == 0 and (y == x).all()


def _unconnected(n: int = 2):
    """n P2P queues with no connection yet: sends queue until set_fd."""
    bs = [_native.P2P(r, n, HOSTS[:n]) for r in range(n)]
    return bs


def _connect(bs, s, d):
    a, b = socket.socketpair()
    bs[s].set_fd(d, a.detach(), False)
    bs[d].set_fd(s, b.detach(), True)


@pytest.mark.parametrize("nbytes", [8, 64 << 10, 4 << 20])
def test_a_dropped_send_handle_keeps_its_buffer_until_the_bytes_are_sent(nbytes):
    """A handle dropped before its send went out (here: no connection yet) must not let the
    buffer be freed and reused under the queue: the receiver gets what was sent."""
    import gc
    a, b = _unconnected()
    try:
        want = []
        for k in range(4):
            x = np.full(nbytes, k + 1, np.uint8)
            want.append(x.copy())
            send(a, x, 1, tag=k)
            del x                                   # the only reference to the buffer, and the handle
        gc.collect()
        junk = [np.full(nbytes, 0xEE, np.uint8) for _ in range(16)]   # reuse the freed memory
        _connect([a, b], 0, 1)
        for k in range(4):
            y = np.empty(nbytes, np.uint8)
            assert done(recv(b, y, 0, tag=k))[0] is False
            assert (y == want[k]).all(), f"message {k}: got {np.unique(y)[:4]}"
        del junk
    finally:
        a.close()
        b.close()


def test_a_dropped_receive_never_writes_into_memory_freed_meanwhile():
    """A receive whose handle and array are both dropped: the message lands in the buffer the
    queue still holds, never in memory that was freed and handed to another array."""
    import gc
    a, b = _unconnected()
    try:
        for k in range(4):
            recv(b, np.zeros(1 << 20, np.uint8), 0, tag=k)      # handle and array dropped at once
        gc.collect()
        junk = [np.zeros(1 << 20, np.uint8) for _ in range(16)]  # the freed memory, reused
        _connect([a, b], 0, 1)
        for k in range(4):
            assert done(send(a, np.full(1 << 20, 7, np.uint8), 1, tag=k))[0] is False
        y = np.empty(8, np.uint8)                   # a later message: every earlier one has landed
        assert done(send(a, np.ones(8, np.uint8), 1, tag=9))[0] is False
        assert done(recv(b, y, 0, tag=9))[0] is False
        assert all(not j.any() for j in junk)
    finally:
        a.close()
        b.close()


def test_closing_with_dropped_handles_in_flight_releases_them():
    a, b = _unconnected()
    for _ in range(3):
        send(a, np.ones(1 << 16, np.uint8), 1, tag=1)
        recv(a, np.empty(8, np.uint8), 1, tag=2)
    a.close()                                       # fails them; their buffers are released
    b.close()
    failed, _, why, _ = done(send(a, np.ones(8, np.uint8), 1), 1)
    assert failed and "closed" in why
