"""Point-to-point between ranks of one host over Unix sockets (collectives/mailbox.py): the ranks
(threads of this process, a real store) are given one host name, so they connect through the
abstract-namespace listener; TCP where the variable says so, where the name is not reachable,
and between hosts."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from helpers.ring import SECRET  # noqa: E402

from hpcring.bootstrap.store_client import StoreClient  # noqa: E402
from hpcring.collectives import mailbox as M  # noqa: E402
from hpcring.errors import CollectiveError  # noqa: E402

ONE = ("h0", "h0", "h0")


@pytest.fixture
def spy(monkeypatch):
    """Records every Unix connect: (name, socket family or None when it fell back)."""
    seen = []
    real = M._unix_connect

    def wrapped(name, timeout):
        s = real(name, timeout)
        seen.append((name, None if s is None else s.family))
        return s
    monkeypatch.setattr(M, "_unix_connect", wrapped)
    return seen


def _addr(ranks, rank: int) -> str:
    v = StoreClient("127.0.0.1", ranks.port, SECRET, 5).check(f"hpcring/ring/1/p2p/addr/{rank}")
    return v.decode() if v else ""


def test_ranks_of_one_host_meet_over_a_unix_socket(ranks, spy):
    """(Order, tags, any source, big messages and closed peers over it: the "one host" cases of
    tests/unit/test_p2p_transport.py.)"""
    a, b = ranks(2, hosts=ONE[:2])
    a.send(np.arange(3.0), 1, tag=1)
    y = np.empty(3)
    assert b.recv(y, 0, tag=1) == 0 and list(y) == [0.0, 1.0, 2.0]
    assert " unix:" in _addr(ranks, 1)
    assert [f for _, f in spy] == [socket.AF_UNIX]


def test_every_pair_of_three_same_host_ranks_uses_unix(ranks, spy):
    comms = ranks(3, hosts=ONE)
    for r in range(3):
        for p in range(3):
            if p != r:
                comms[r].isend(np.array([float(r)]), p, tag=5)
    for r in range(3):
        got = set()
        for _ in range(2):
            y = np.empty(1)
            src = comms[r].recv(y, None, tag=5)
            assert float(y[0]) == src
            got.add(src)
        assert got == {0, 1, 2} - {r}
    assert len(spy) == 6 and all(f == socket.AF_UNIX for _, f in spy)


def test_an_unauthenticated_unix_connection_is_refused_and_the_real_peer_still_gets_through(ranks):
    a, b = ranks(2, hosts=ONE[:2])
    b.irecv(np.empty(1), 0, tag=9)                       # opens b's listeners
    name = _addr(ranks, 1).partition(" unix:")[2]
    assert name
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect("\0" + M._UNIX_PREFIX + name)
        s.recv(36)                                       # the greeting
        s.sendall(b"\0" * 72)                            # a wrong proof
        assert s.recv(100) == b""                        # cut without an answer
    h = b.irecv(y := np.empty(1), 0, tag=10)
    a.send(np.array([5.0]), 1, tag=10)
    assert h.wait(5) == 0 and y[0] == 5.0


def test_an_unreachable_unix_name_falls_back_to_tcp(ranks, monkeypatch):
    """Another network namespace on the same host does not see the abstract name."""
    tried, real = [], M._unix_connect

    def elsewhere(name, timeout):
        tried.append(name)
        return real("0" * 24, timeout)                  # nobody listens under that name
    monkeypatch.setattr(M, "_unix_connect", elsewhere)
    a, b = ranks(2, hosts=ONE[:2])
    a.send(np.array([7.0]), 1, tag=2)
    y = np.empty(1)
    assert b.recv(y, 0, tag=2) == 0 and y[0] == 7.0
    assert len(tried) == 1


def test_the_variable_turns_unix_off_and_other_hosts_never_use_it(ranks, spy, monkeypatch):
    monkeypatch.setenv("HPCRING_P2P_UNIX", "0")
    a, b = ranks(2, hosts=ONE[:2])
    a.send(np.array([1.0]), 1)
    b.recv(np.empty(1), 0)
    assert " unix:" not in _addr(ranks, 1) and spy == []
    monkeypatch.delenv("HPCRING_P2P_UNIX")
    c, d = ranks(2, hosts=("x", "y"))                   # (a second world under another prefix)
    c.send(np.array([1.0]), 1)
    d.recv(np.empty(1), 0)
    assert spy == []


@pytest.mark.parametrize("name", ["", "zz" * 12, "a" * 65, "../../x", "0" * 24 + "\0", "ABCDEF"])
def test_a_published_name_that_is_not_ours_is_not_connected_to(name):
    assert M._unix_connect(name, 1.0) is None


def test_a_listener_name_is_unique_and_goes_with_its_socket():
    s1, n1 = M._unix_listener()
    s2, n2 = M._unix_listener()
    assert n1 != n2 and len(n1) == 24
    c = M._unix_connect(n1, 1.0)
    assert c is not None and c.family == socket.AF_UNIX
    c.close()
    s1.close()
    assert M._unix_connect(n1, 1.0) is None              # no file left behind, nothing to clean
    s2.close()


def test_many_same_host_pairs_connect_at_once(ranks, spy):
    n = 6
    comms = ranks(n, hosts=("h",) * n)
    errors = []

    def run(r):
        try:
            hs = [comms[r].isend(np.full(64, r, np.int32), p, tag=1) for p in range(n) if p != r]
            for p in range(n):
                if p != r:
                    y = np.empty(64, np.int32)
                    comms[r].recv(y, p, tag=1)
                    assert (y == p).all()
            for h in hs:
                h.wait(10)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert len(spy) == n * (n - 1) and all(f == socket.AF_UNIX for _, f in spy)
