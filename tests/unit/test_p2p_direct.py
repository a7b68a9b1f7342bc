"""Point-to-point by direct reads within a host (native/p2p_direct.c, the offer exchange in
collectives/mailbox.py): the receiver copies an offered message out of the sender's memory with
process_vm_readv, then hands the token back.

The native tests join P2P queues of this process by socket pairs, each side told the other's pid
(this process: reading its own memory is allowed), or forge the peer's side on a raw socket to
see what the queue does with a bad offer, a lost token or a peer that never reads. The mailbox
tests run ring Communicators as threads of this process on one host name, so they meet over Unix
sockets and agree on direct reads through the real handshake."""
from __future__ import annotations

import gc
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from hpcring import _native
from hpcring.collectives import mailbox as M
from hpcring.errors import CollectiveError

HOSTS = ["node0", "node0", "node0"]
F_DIRECT = 1 << 63
OFFER = struct.Struct(">qQQQ")      # tag, length | F_DIRECT, address, token
PID = os.getpid()

from helpers.p2p_native import done, recv, send  # noqa: E402


def _boxes(n: int, direct_min: int = 1 << 10):
    bs = [_native.P2P(r, n, HOSTS[:n]) for r in range(n)]
    for b in bs:
        b.direct_min = direct_min
    return bs


def _join(bs, s, d, direct=True):
    """One-way connection s -> d; direct: d reads s's memory (the handshake's outcome)."""
    a, b = socket.socketpair()
    bs[s].set_fd(d, a.detach(), False, 1 if direct else 0)
    bs[d].set_fd(s, b.detach(), True, PID if direct else 0)


@pytest.fixture
def boxes():
    made = []

    def make(n: int, direct_min: int = 1 << 10, direct: bool = True):
        bs = _boxes(n, direct_min)
        for s in range(n):
            for d in range(n):
                if s != d:
                    _join(bs, s, d, direct)
        made.extend(bs)
        return bs
    yield make
    for b in made:
        b.close()


# ---- the native queue ----------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1 << 10, (1 << 20) + 3, 9 << 20])
def test_a_message_from_the_cut_is_read_directly_into_the_posted_receive(boxes, nbytes):
    a, b = boxes(2)
    x = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    y = np.zeros(nbytes, np.uint8)
    r = recv(b, y, 0, tag=3)
    s = send(a, x, 1, tag=3)
    assert done(r)[:2] == (False, 0) and done(s)[0] is False
    assert (y == x).all()
    assert a.direct_counts() == (1, 0) and b.direct_counts() == (0, 1)


def test_below_the_cut_or_without_the_agreement_the_stream_carries_it(boxes):
    a, b = boxes(2, direct_min=1 << 20)
    y = np.zeros(1 << 19, np.uint8)
    r = recv(b, y, 0)
    assert done(send(a, np.ones(1 << 19, np.uint8), 1))[0] is False
    assert done(r)[0] is False and y.all()
    c, d = boxes(2, direct=False)
    y = np.zeros(1 << 20, np.uint8)
    r = recv(d, y, 0)
    assert done(send(c, np.ones(1 << 20, np.uint8), 1))[0] is False
    assert done(r)[0] is False and y.all()
    assert [q.direct_counts() for q in (a, b, c, d)] == [(0, 0)] * 4


def test_an_offer_before_its_receive_completes_the_send_as_a_stream_message_would(boxes):
    """The receiver takes an offer nobody waits for into a buffer of its own: the send completes
    without the receive (no new deadlock for code that sends before it receives)."""
    a, b = boxes(2)
    x = np.arange(1 << 18, dtype=np.int32)
    assert done(send(a, x, 1, tag=1))[0] is False              # no receive posted yet
    x[:] = -1                                                   # the caller owns its buffer again
    y = np.empty_like(x)
    assert done(recv(b, y, 0, tag=1))[0] is False
    assert (y == np.arange(1 << 18, dtype=np.int32)).all()


def test_offers_and_stream_messages_keep_the_order_per_sender_and_tag(boxes):
    """Per tag one size: tags 1 and 2 go as offers, 0 and 3 on the stream, interleaved; the
    receives are posted tag by tag, backwards, some before the sends and some after."""
    a, b = boxes(2, direct_min=4096)
    size = {0: 64, 1: 8192, 2: 20000, 3: 16}
    early = {tag: [] for tag in size}
    for tag in (2, 0):                                          # posted before anything is sent
        y = np.zeros(size[tag], np.uint8)
        early[tag].append((y, recv(b, y, 0, tag=tag)))
    sends = [send(a, np.full(size[tag], 10 * k + tag, np.uint8), 1, tag=tag) for k in range(3) for tag in size]
    got = {tag: list(early[tag]) for tag in size}
    for tag in (3, 2, 1, 0):
        while len(got[tag]) < 3:
            y = np.zeros(size[tag], np.uint8)
            got[tag].append((y, recv(b, y, 0, tag=tag)))
    for tag in size:
        for k, (y, r) in enumerate(got[tag]):
            assert done(r)[0] is False
            assert (y == 10 * k + tag).all(), (tag, k, y[:4])
    assert all(done(s)[0] is False for s in sends)
    assert a.direct_counts() == (6, 0) and b.direct_counts() == (0, 6)


def test_many_offers_in_flight_both_ways_complete_with_every_byte(boxes):
    a, b = boxes(2, direct_min=1 << 12)
    n, k = 1 << 16, 40
    xs = [np.full(n, i % 250 + 1, np.uint8) for i in range(k)]
    ys = [[np.zeros(n, np.uint8) for _ in range(k)] for _ in range(2)]
    rs = [recv(b, ys[0][i], 0, tag=i) for i in range(k)] + [recv(a, ys[1][i], 1, tag=i) for i in range(k)]
    ss = [send(a, xs[i], 1, tag=i) for i in range(k)] + [send(b, xs[i], 0, tag=i) for i in range(k)]
    res = [done(q) for q in rs + ss]
    assert all(r[0] is False for r in res), sorted({r[2] for r in res if r[0]})
    assert all((ys[w][i] == xs[i]).all() for w in range(2) for i in range(k))
    assert a.direct_counts() == (k, k) and b.direct_counts() == (k, k)


def test_a_waiter_on_an_offer_reads_its_token_itself_and_the_progress_thread_otherwise(boxes):
    a, b = boxes(2)
    x = np.ones(1 << 16, np.uint8)
    y = np.zeros(1 << 16, np.uint8)
    for waited in (True, False, True):
        r = recv(b, y, 0)
        s = send(a, x, 1)
        if waited:
            assert done(s)[0] is False
        else:
            deadline = time.monotonic() + 10
            while s.result() is None and time.monotonic() < deadline:   # nobody waits in C
                time.sleep(0.001)
            assert s.result() is not None and s.result()[0] is False
        assert done(r)[0] is False


def test_an_offer_larger_than_its_receive_fails_the_receive_and_the_senders_send(boxes):
    a, b = boxes(2)
    r = recv(b, np.zeros(1 << 12, np.uint8), 0)
    s = send(a, np.ones(1 << 14, np.uint8), 1)
    failed, _, why, hint = done(r)
    assert failed and "16 KiB" in why and hint == 3
    failed, _, why, _ = done(s)
    assert failed and "rank 1 (node0)" in why


def test_a_dropped_send_handle_keeps_its_buffer_until_the_receiver_read_it():
    a, b = _boxes(2)
    try:
        want = []
        for k in range(4):
            x = np.full(1 << 20, k + 1, np.uint8)
            want.append(x.copy())
            send(a, x, 1, tag=k)
            del x                                   # the handle and the only array: parked
        gc.collect()
        junk = [np.full(1 << 20, 0xEE, np.uint8) for _ in range(16)]
        _join([a, b], 0, 1)
        for k in range(4):
            y = np.empty(1 << 20, np.uint8)
            assert done(recv(b, y, 0, tag=k))[0] is False
            assert (y == want[k]).all(), f"message {k}: got {np.unique(y)[:4]}"
        assert a.direct_counts()[0] == 4
        del junk
    finally:
        a.close()
        b.close()


# ---- a forged peer on a raw socket -------------------------------------------------------------
def _raw_receiver():
    """Box 0 sends to a raw socket that plays rank 1 (it reads offers and answers as told)."""
    (a,) = [_native.P2P(0, 2, HOSTS[:2])]
    a.direct_min = 1 << 10
    mine, theirs = socket.socketpair()
    a.set_fd(1, mine.detach(), False, 1)
    theirs.settimeout(10)
    return a, theirs


def _read_offer(sock):
    buf = b""
    while len(buf) < OFFER.size:
        buf += sock.recv(OFFER.size - len(buf))
    return OFFER.unpack(buf)


def test_a_send_whose_offer_is_never_read_fails_at_its_deadline_naming_the_peer():
    a, raw = _raw_receiver()
    try:
        t0 = time.monotonic()
        s = send(a, np.ones(1 << 12, np.uint8), 1, timeout=0.5)
        tag, n, addr, token = _read_offer(raw)
        assert n == (1 << 12) | F_DIRECT and addr and token
        failed, _, why, hint = done(s, 10)
        assert failed and "did not read a message offered to it within the 0.5 s deadline" in why
        assert hint == 4 and time.monotonic() - t0 < 5
    finally:
        a.close()
        raw.close()


def test_closing_while_a_thread_waits_for_a_token_fails_its_send_and_returns():
    a, raw = _raw_receiver()
    try:
        s = send(a, np.ones(1 << 12, np.uint8), 1, timeout=30)
        _read_offer(raw)
        out = []
        t = threading.Thread(target=lambda: out.append(done(s, 20)))
        t.start()
        time.sleep(0.3)                                         # parked in C, reading for its token
        t0 = time.monotonic()
        a.close()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - t0 < 5
        assert out and out[0][0] is True and "closed" in out[0][2]
    finally:
        a.close()
        raw.close()


def test_a_peer_that_closes_before_it_reads_an_offer_fails_the_send_at_once():
    a, raw = _raw_receiver()
    try:
        s = send(a, np.ones(1 << 12, np.uint8), 1, timeout=30)
        _read_offer(raw)
        raw.close()
        failed, _, why, hint = done(s, 10)
        assert failed and "closed its connection before it read a message" in why and hint == 2
    finally:
        a.close()


def test_a_token_that_was_never_offered_fails_the_pair():
    a, raw = _raw_receiver()
    try:
        s = send(a, np.ones(1 << 12, np.uint8), 1, timeout=30)
        _, _, _, token = _read_offer(raw)
        raw.sendall(struct.pack(">Q", token + 77))
        failed, _, why, _ = done(s, 10)
        assert failed and "never offered" in why
    finally:
        a.close()
        raw.close()


def test_tokens_split_across_reads_still_complete_their_sends():
    a, raw = _raw_receiver()
    try:
        ss = [send(a, np.ones(1 << 12, np.uint8), 1, tag=i, timeout=30) for i in range(3)]
        tokens = [_read_offer(raw)[3] for _ in range(3)]
        wire = b"".join(struct.pack(">Q", t) for t in reversed(tokens))
        for i in range(0, len(wire), 5):                        # 5-byte pieces: tokens split
            raw.sendall(wire[i:i + 5])
            time.sleep(0.01)
        assert [done(s)[0] for s in ss] == [False] * 3
    finally:
        a.close()
        raw.close()


def _raw_sender(direct_pid: int):
    """Box 1 receives from a raw socket that plays rank 0 and forges offers."""
    b = _native.P2P(1, 2, HOSTS[:2])
    mine, theirs = socket.socketpair()
    b.set_fd(0, mine.detach(), True, direct_pid)
    theirs.settimeout(10)
    return b, theirs


def test_an_offer_on_a_connection_without_the_agreement_fails_the_pair():
    b, raw = _raw_sender(0)
    try:
        src = np.ones(64, np.uint8)
        r = recv(b, np.zeros(64, np.uint8), 0)
        raw.sendall(OFFER.pack(0, 64 | F_DIRECT, src.ctypes.data, 1))
        failed, _, why, _ = done(r)
        assert failed and "cannot read its memory" in why
    finally:
        b.close()
        raw.close()


def test_an_offer_of_memory_that_is_gone_fails_the_receive_and_writes_no_token():
    b, raw = _raw_sender(PID)
    try:
        r = recv(b, np.zeros(4096, np.uint8), 0)
        raw.sendall(OFFER.pack(0, 4096 | F_DIRECT, 16, 1))    # address 16: never mapped
        failed, _, why, _ = done(r)
        assert failed and "process_vm_readv" in why and "rank 0 (node0)" in why
        raw.settimeout(0.2)
        assert raw.recv(8) == b""                                # the pair is shut: no token
    finally:
        b.close()
        raw.close()


def test_a_sender_that_gave_up_before_the_token_fails_the_receive_instead_of_completing_it():
    """The sender shuts its socket before its caller gets the buffer back (p2p_direct.c): a
    receiver that cannot hand the token back must not report the bytes as received."""
    b, raw = _raw_sender(PID)
    try:
        src = np.full(4096, 5, np.uint8)
        r = recv(b, np.zeros(4096, np.uint8), 0)
        raw.shutdown(socket.SHUT_RD)                              # gave up: reads no token
        raw.sendall(OFFER.pack(0, 4096 | F_DIRECT, src.ctypes.data, 9))
        failed, _, why, _ = done(r)
        assert failed and "gave up on a message" in why
    finally:
        b.close()
        raw.close()


def test_offers_forged_over_every_field_fail_cleanly_or_deliver_exactly():
    """Generated offers: tag, length, address (valid, unmapped, past the end) and token; each
    either completes with the source's bytes or fails the receive, never hangs."""
    rng = np.random.default_rng(7)
    src = np.arange(1 << 16, dtype=np.uint8)
    for case in range(24):
        b, raw = _raw_sender(PID)
        try:
            n = int(rng.choice([1, 4096, 1 << 16]))
            want_n = int(rng.choice([n, n + 1]))
            addr = int(rng.choice([src.ctypes.data, 0, 8, src.ctypes.data + (1 << 16) - n // 2 if n > 1 else 8,
                                   (1 << 47) + 4096]))
            tag = int(rng.integers(-5, 5))
            y = np.zeros(want_n, np.uint8)
            r = recv(b, y, 0, tag=tag)
            raw.sendall(OFFER.pack(tag, n | F_DIRECT, addr, int(rng.integers(0, 1 << 63))))
            failed, _, why, _ = done(r)
            ok = want_n == n and addr == src.ctypes.data
            assert failed is (not ok), (case, n, want_n, addr, why)
            if ok:
                assert (y == src[:n]).all()
        finally:
            b.close()
            raw.close()


# ---- the mailbox: the offer exchange on real Unix connections ------------------------------------
@pytest.fixture
def small_cut(monkeypatch):
    monkeypatch.setenv("HPCRING_P2P_DIRECT_MIN", "4096")


def _counts(comm):
    return comm.backend._mailbox.direct_counts()


def test_ranks_of_one_host_agree_on_direct_reads_and_use_them_from_the_cut(ranks, small_cut):
    a, b = ranks(2, hosts=("h0", "h0"))
    x = np.arange(1 << 16, dtype=np.float32)
    y = np.empty_like(x)
    t = threading.Thread(target=lambda: a.send(x, 1, tag=2))
    t.start()
    assert b.recv(y, 0, tag=2) == 0
    t.join(10)
    assert (y == x).all()
    small = np.empty(16, np.float32)
    a.send(np.ones(16, np.float32), 1, tag=3)
    b.recv(small, 0, tag=3)
    assert _counts(a) == (1, 0) and _counts(b) == (0, 1)


def test_ranks_on_different_hosts_never_offer(ranks, small_cut):
    a, b = ranks(2)
    y = np.empty(1 << 16, np.float32)
    a.isend(np.ones(1 << 16, np.float32), 1, tag=1)
    b.recv(y, 0, tag=1)
    assert y.all() and _counts(a) == (0, 0) and _counts(b) == (0, 0)


@pytest.mark.parametrize("how", ["unreadable", "wrong word", "turned off"])
def test_a_listener_that_cannot_read_the_connector_gets_the_stream(ranks, small_cut, monkeypatch, how):
    if how == "unreadable":
        def peek(pid, addr, n):
            raise PermissionError(1, "Operation not permitted")
        monkeypatch.setattr(M._native, "peek", peek)
    elif how == "wrong word":
        monkeypatch.setattr(M._native, "peek", lambda pid, addr, n: b"\0" * n)
    else:
        monkeypatch.setenv("HPCRING_P2P_DIRECT", "0")
    a, b = ranks(2, hosts=("h0", "h0"))
    y = np.empty(1 << 16, np.float32)
    a.isend(np.full(1 << 16, 3, np.float32), 1, tag=1)
    b.recv(y, 0, tag=1)
    assert (y == 3).all() and _counts(a) == (0, 0) and _counts(b) == (0, 0)


def test_a_mismatched_size_over_direct_reads_raises_the_named_error(ranks, small_cut):
    a, b = ranks(2, hosts=("h0", "h0"))
    a.isend(np.ones(1 << 14, np.float32), 1, tag=1)
    with pytest.raises(CollectiveError) as e:
        b.recv(np.empty(1 << 12, np.float32), 0, tag=1)
    assert "64 KiB" in str(e.value)


# ---- separate processes ----------------------------------------------------------------------
def test_ranks_in_separate_processes_read_each_others_messages_directly(monkeypatch):
    import helpers.ring as H
    monkeypatch.setenv("HPCRING_P2P_DIRECT_MIN", str(1 << 16))
    out = H.spawn_ranks(3, H.target_p2p_ring, 1 << 20, 6, hosts=("h",) * 3)
    assert sorted(out) == [0, 1, 2], out
    for rank, (status, value, _) in out.items():
        assert status == "ok", (rank, value)
        wrong, (offered, read) = value
        assert wrong == 0 and offered == 6 and read == 6, (rank, value)


def test_a_sender_that_dies_with_an_offer_out_fails_the_receive_naming_it_or_delivers(monkeypatch):
    import helpers.ring as H
    monkeypatch.setenv("HPCRING_P2P_DIRECT_MIN", str(1 << 16))
    t0 = time.monotonic()
    out = H.spawn_ranks(2, H.target_p2p_sender_dies, 64 << 20, timeout=20.0, hosts=("h",) * 2, wait=60.0)
    status, value, took = out[1]
    assert time.monotonic() - t0 < 50
    # the bytes (read before it was gone), or its death named well before the 20 s deadline
    assert (status, value) == ("ok", 0) or (status == "error" and "rank 0 (h)" in value and took < 10
                                            and "never connected" not in value), out
