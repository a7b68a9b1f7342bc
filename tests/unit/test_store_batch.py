"""Batched store operations and the store at scale.

multi_set / multi_get / multi_check / exchange are one round trip each; a blocking read is
parked in the server (one wait group per key list, no thread) and answered when its last key
arrives or at its own deadline; authentication still comes before any parsing; 1024 concurrent
clients rendezvous (publish one key, read all 1024) in a few seconds on a 2-core machine.
"""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hpcring.bootstrap import auth
from hpcring.bootstrap import store_wire as st
from hpcring.netio import recv_exact
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.errors import BootstrapError
from hpcring.bootstrap.store_server import ensure_fd_limit

from helpers.store import SECRET, SRC, client, is_closed_by_server, raw_session, wait_for


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    yield srv
    srv.close()


def frames_seen(srv) -> int:
    return srv.stats["frames"]


def parked_state_is_empty(srv) -> bool:
    return not srv._ops.groups and not srv._ops.waiters


def raw_request(s, key, seq, op, args=b""):
    """Send one frame on a raw session and read its reply: (status, payload)."""
    s.sendall(st.encode_frame(key, b"C", seq, st.encode_request(op, "", args)))
    head = recv_exact(s, 36)
    body = recv_exact(s, struct.unpack(">I", head[:4])[0])
    assert head[4:] == st.frame_mac(key, b"S", seq, body)
    return body[0], body[1:]


# ------------------------------------------------------------------------------ wire encoding

def test_wire_lists_round_trip_and_reject_lies():
    keys = ["a", "", "ключ", "k" * 300]
    assert st.decode_keys(st.encode_keys(keys)) == keys
    items = [("a", b""), ("b", b"\x00\xff" * 100)]
    assert st.decode_items(st.encode_items(items)) == items
    values = [b"x", None, b"", b"\x00" * 5]
    assert st.decode_values(st.encode_values(values)) == values
    assert st.decode_indices(st.encode_indices([0, 7, 3])) == [0, 7, 3]
    for bad in (struct.pack(">I", 1 << 30), st.encode_keys(["abc"])[:-1], st.encode_keys(["a"]) + b"x"):
        with pytest.raises((ValueError, struct.error)):
            st.decode_keys(bad)
    with pytest.raises(ValueError):
        st.decode_values(struct.pack(">II", 1, 10) + b"short")
    with pytest.raises(ValueError):
        st.decode_items(struct.pack(">I", 1 << 30))


# ------------------------------------------------------------------------------ semantics

def test_multi_set_get_check_in_one_round_trip_each(server):
    c = client(server)
    before = frames_seen(server)
    c.multi_set({"a": b"1", "b": b"\x00bin", "e": b""})
    assert frames_seen(server) == before + 1
    assert c.multi_get(["e", "a", "b", "a"]) == [b"", b"1", b"\x00bin", b"1"]
    assert frames_seen(server) == before + 2
    assert c.multi_check(["a", "nope", "e"]) == [b"1", None, b""]
    assert frames_seen(server) == before + 3
    assert c.multi_get([]) == [] and c.multi_check([]) == []
    c.multi_set([("a", b"2")])   # pairs work too, and overwrite
    assert c.get("a") == b"2"
    with pytest.raises(TypeError):
        c.multi_set({"s": "not bytes"})


def test_exchange_publishes_and_reads_in_one_round_trip(server):
    c = client(server)
    c.set("peer", b"p")
    reads = []
    real = c._conn._read_reply
    c._conn._read_reply = lambda sock: reads.append(1) or real(sock)
    sent = []
    real_pipeline = c._pipeline
    c._pipeline = lambda reqs, wait, key, *rest: sent.append(len(reqs)) or real_pipeline(reqs, wait, key, *rest)
    assert c.exchange({"mine": b"m"}, ["mine", "peer"], timeout=5) == [b"m", b"p"]
    assert sent == [2] and len(reads) == 2   # both frames went out before the first reply was read


def test_gather_and_wait_are_batched_and_name_every_missing_key(server):
    c = client(server)
    c.multi_set({"a": b"a", "c": b"c"})
    before = frames_seen(server)
    assert c.gather(["c", "a"], timeout=1) == [b"c", b"a"]
    c.wait(["a", "c"], timeout=1)
    assert frames_seen(server) == before + 2
    t0 = time.monotonic()
    with pytest.raises(st.StoreTimeoutError) as ei:
        c.gather(["a", "b", "c", "d"], timeout=0.4)
    assert 0.35 < time.monotonic() - t0 < 2.0
    assert ei.value.missing == ["b", "d"] and "'b'" in ei.value.message and "2 of 4 keys" in ei.value.message
    assert wait_for(lambda: parked_state_is_empty(server))
    with pytest.raises(st.StoreTimeoutError):   # a deadline already passed: answered at once
        c.multi_get(["zz"], timeout=0)
    assert parked_state_is_empty(server)


def test_parked_multi_get_is_answered_when_the_last_key_arrives(server):
    waiters, setter = [client(server) for _ in range(16)], client(server)
    got, errors = [], []

    def wait(cl):
        try:
            got.append(cl.multi_get(["x", "y", "z"], timeout=10))
        except Exception as e:
            errors.append(e)
    ts = [threading.Thread(target=wait, args=(cl,)) for cl in waiters]
    [t.start() for t in ts]
    assert wait_for(lambda: sum(len(g.members) for g in server._ops.groups.values()) == 16)
    assert len(server._ops.groups) == 1   # one key list: one shared wait group
    setter.multi_set({"x": b"1", "y": b"2"})
    time.sleep(0.2)
    assert not got
    setter.set("z", b"3")
    [t.join(5) for t in ts]
    assert not errors and got == [[b"1", b"2", b"3"]] * 16
    assert parked_state_is_empty(server)


def test_a_key_deleted_before_the_last_one_arrives_is_waited_for_again(server):
    c, other = client(server), client(server)
    got = []
    t = threading.Thread(target=lambda: got.append(c.multi_get(["a", "b"], timeout=5)))
    t.start()
    assert wait_for(lambda: server._ops.groups)
    other.set("a", b"1")
    other.delete("a")
    other.set("b", b"2")
    time.sleep(0.2)
    assert not got
    other.set("a", b"again")
    t.join(5)
    assert got == [[b"again", b"2"]]


def test_parked_waits_honour_their_own_deadlines_without_threads(server):
    """60 clients park GETs and MGETs on one key with deadlines 0.3..1.5 s: each is answered at
    its own deadline by the server's one thread; a later set still reaches the longest ones."""
    threads_before = {t.name for t in threading.enumerate()}
    results, lock = {}, threading.Lock()

    def park(i):
        cl = client(server)
        deadline = 0.3 + 0.2 * (i % 7)
        t0 = time.monotonic()
        try:
            (cl.get("late", timeout=deadline) if i % 2 else cl.multi_get(["late", "never-" + str(i % 3)], timeout=deadline))
            outcome = "value"
        except st.StoreTimeoutError:
            outcome = "timeout"
        with lock:
            results[i] = (deadline, time.monotonic() - t0, outcome)
    ts = [threading.Thread(target=park, args=(i,)) for i in range(60)]
    [t.start() for t in ts]
    assert wait_for(lambda: server.stats["parked"] >= 60, timeout=5)
    store_threads = [t for t in threading.enumerate() if t.name.startswith("hpcring-store")
                     and t.name not in threads_before]
    assert len(store_threads) == 0   # the server's one thread existed before; none per client
    [t.join(10) for t in ts]
    assert len(results) == 60
    for deadline, took, outcome in results.values():
        assert outcome == "timeout"
        assert deadline - 0.05 <= took <= deadline + 1.0, (deadline, took)
    assert parked_state_is_empty(server)
    # a wait that is still parked when its key arrives gets the value
    c, other = client(server), client(server)
    got = []
    t = threading.Thread(target=lambda: got.append(c.get("late", timeout=5)))
    t.start()
    assert wait_for(lambda: server._ops.groups)
    other.set("late", b"v")
    t.join(5)
    assert got == [b"v"] and parked_state_is_empty(server)


def test_a_client_that_leaves_while_parked_is_forgotten(server):
    s, key = raw_session(server)
    s.sendall(st.encode_frame(key, b"C", 0, st.encode_request(
        st.OP_MGET, "", struct.pack(">d", 30.0) + bytes([st.MGET_VALUES]) + st.encode_keys(["p", "q"]))))
    assert wait_for(lambda: server._ops.groups)
    s.close()
    assert wait_for(lambda: parked_state_is_empty(server))
    client(server).multi_set({"p": b"1", "q": b"2"})   # nothing left to wake


def test_batched_requests_split_at_the_frame_cap():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    try:
        c = StoreClient("127.0.0.1", srv.port, SECRET, timeout=5, max_frame=4096)
        keys = [f"rank/{i:05d}/address" for i in range(600)]   # ~14 kB of keys: several frames
        c.multi_set({k: k.encode()[-8:] for k in keys})
        assert c.multi_get(keys) == [k.encode()[-8:] for k in keys]
        assert c.multi_check(keys + ["absent"])[-2:] == [keys[-1].encode()[-8:], None]
        with pytest.raises(st.StoreTimeoutError) as ei:
            c.multi_get(["absent0"] + keys + ["absent1"], timeout=0.2)
        assert ei.value.missing == ["absent0", "absent1"]   # every batch's missing keys are named
    finally:
        srv.close()


def test_a_reply_over_the_frame_cap_is_asked_for_in_halves():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET, max_frame=2048)
    try:
        c = StoreClient("127.0.0.1", srv.port, SECRET, timeout=5, max_frame=2048)
        big = {f"k{i}": bytes([65 + i]) * 700 for i in range(9)}   # 6.3 kB: four frames' worth
        c.multi_set(big)   # split by the client into frames under the cap
        big["edge"] = b"e" * 2040   # fits a SET frame and a GET reply, not an MGET reply
        c.set("edge", big["edge"])
        keys = list(big)
        assert c.multi_get(keys, timeout=1) == list(big.values())
        assert c.multi_check(keys + ["none"]) == list(big.values()) + [None]
        assert c.exchange({"mine": b"m"}, keys[:3] + ["mine"], timeout=1) == list(big.values())[:3] + [b"m"]
        assert c.get("k0") == big["k0"]   # the connection stays in step
        assert srv.stats["bad_request"] == 0
    finally:
        srv.close()


# ------------------------------------------------------------------------------ authentication

def test_unauthenticated_batched_frames_are_never_parsed(server):
    """A peer without the secret that sends a well-formed MSET gets nothing and is cut; nothing
    is stored. A frame with a wrong MAC on an authenticated session is dropped likewise."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    recv_exact(s, 36)   # the hello: all an unauthenticated peer ever receives
    bogus_key = b"\x00" * 32
    body = st.encode_request(st.OP_MSET, "", st.encode_items([("evil", b"1")]))
    s.sendall((st.encode_frame(bogus_key, b"C", 0, body) * 3)[:auth.STORE.proof_len + 40])
    assert is_closed_by_server(s)
    s2, key = raw_session(server)
    s2.sendall(st.encode_frame(b"\x01" * 32, b"C", 0, body))   # wrong session key
    assert is_closed_by_server(s2)
    assert server.stats["rejected_handshake"] >= 1 and server.stats["rejected_frame"] >= 1
    assert "evil" not in server.keys()


def test_malformed_batched_bodies_with_valid_macs_get_errors_and_change_nothing(server):
    s, key = raw_session(server)
    bad = [(st.OP_MSET, struct.pack(">I", 1 << 30)),                        # claims a billion items
           (st.OP_MSET, st.encode_items([("k", b"value")])[:-2]),            # value runs past the end
           (st.OP_MGET, struct.pack(">d", 1.0)),                              # no flags, no keys
           (st.OP_MGET, struct.pack(">d", float("nan")) + b"\x01" + st.encode_keys(["k"])),
           (st.OP_MCHECK, st.encode_keys(["k"]) + b"junk"),
           (st.OP_MCHECK, struct.pack(">IH", 1, 2) + b"\xff\xfe")]            # not UTF-8
    for seq, (op, args) in enumerate(bad):
        status, payload = raw_request(s, key, seq, op, args)
        assert status == st.ST_ERROR, (op, args, payload)
    assert server.keys() == [] and parked_state_is_empty(server)
    assert raw_request(s, key, len(bad), st.OP_MCHECK, st.encode_keys(["k"]))[0] == st.ST_OK


# ------------------------------------------------------------------------------ scale

def _rendezvous(srv, n: int, timeout: float = 30.0):
    """``n`` ranks (threads with their own StoreClient) each publish an address and read all n."""
    barrier = threading.Barrier(n + 1)
    errors, done = [], []

    def rank(r):
        try:
            cl = StoreClient("127.0.0.1", srv.port, SECRET, timeout=timeout)
            barrier.wait(timeout)   # every connection open before anyone publishes
            values = cl.exchange({f"addr/{r}": f"10.0.{r // 256}.{r % 256}:29500".encode()},
                                 [f"addr/{i}" for i in range(n)], timeout=timeout)
            assert len(values) == n and values[r] == f"10.0.{r // 256}.{r % 256}:29500".encode()
            done.append(r)
            cl.close()
        except Exception as e:   # reported below; a thread exception would vanish otherwise
            errors.append(e)
            barrier.abort()
    old = threading.stack_size(256 * 1024)
    try:
        ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    finally:
        threading.stack_size(old)
    [t.start() for t in ts]
    barrier.wait(timeout)
    t0 = time.monotonic()
    [t.join(timeout) for t in ts]
    return time.monotonic() - t0, errors, done


def test_1024_concurrent_clients_rendezvous_through_one_server_thread():
    n = 1024
    try:
        ensure_fd_limit(2 * n + 64)   # this process holds both ends of every connection
    except BootstrapError as e:
        pytest.skip(f"descriptor limit: {e.message}")
    srv = StoreServer("127.0.0.1", 0, secret=SECRET, clients=n)
    try:
        elapsed, errors, done = _rendezvous(srv, n)
        assert not errors, errors[:3]
        assert len(done) == n
        assert srv.stats["peak_connections"] >= n   # all were open at once
        assert elapsed < 20.0, elapsed
        assert parked_state_is_empty(srv)
    finally:
        srv.close()


# ------------------------------------------------------------------------------ descriptor limit

FD_CHILD = textwrap.dedent("""
    import logging, resource, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    soft, hard, clients = map(int, sys.argv[1:4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    from hpcring.bootstrap.store_server import StoreServer
    from hpcring.errors import BootstrapError
    try:
        srv = StoreServer("127.0.0.1", 0, secret=b"s" * 64, clients=clients, ranks=clients // 3)
    except BootstrapError as e:
        print("ERROR", e.message, "HINT", e.hint)
    else:
        print("OK", resource.getrlimit(resource.RLIMIT_NOFILE)[0], srv.max_connections)
        srv.close()
""")


def _fd_child(soft, hard, clients):
    hard_now = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[1]
    if hard_now != -1 and hard > hard_now:
        pytest.skip(f"this machine's hard descriptor limit is {hard_now}")
    out = subprocess.run([sys.executable, "-c", FD_CHILD, str(soft), str(hard), str(clients)],
                         capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr


def test_the_soft_descriptor_limit_is_raised_for_the_job():
    out, err = _fd_child(256, 8192, 3 * 1024)
    word, soft, cap = out.split()
    assert word == "OK" and 3 * 1024 < int(soft) <= 8192 and int(cap) >= 3 * 1024
    assert "raised the soft descriptor limit" in err


def test_a_hard_limit_too_low_is_a_clear_error():
    out, _ = _fd_child(256, 512, 3 * 1024)
    assert out.startswith("ERROR")
    for words in ("RLIMIT_NOFILE", "512", "1024 ranks", "ulimit -n"):
        assert words in out, (words, out)


def test_a_hard_limit_that_fits_the_rendezvous_but_not_the_watchdog_warns():
    out, err = _fd_child(256, 2048, 3 * 1024)
    word, soft, cap = out.split()
    assert word == "OK" and int(soft) == 2048 and int(cap) == 2048 - st.FD_RESERVE
    assert "RLIMIT_NOFILE" in err and "1024 ranks" in err and "ulimit -n" in err


# ------------------------------------------------------------------------------ key ranges

def test_every_ranks_key_travels_as_a_key_range():
    assert st.key_range([f"init/host/{r}" for r in range(4096)]) == ("init/host/", 0)
    assert st.key_range([f"a{r}" for r in range(3, 20)]) == ("a", 3)
    assert st.key_range([f"a{r}" for r in range(4)]) is None           # too few to bother
    assert st.key_range([f"a/{r}" for r in (0, 1, 2, 3, 4, 5, 6, 8)]) is None
    assert st.key_range([f"r/{r:03d}" for r in range(20)]) is None     # zero-padded past 9
    assert st.key_range(["x"] * 10) is None
    assert st.decode_key_range(st.encode_key_range("k/", 5, 3)) == ["k/5", "k/6", "k/7"]


def test_a_key_range_request_is_a_few_bytes_and_answers_like_the_list(server):
    c = client(server)
    keys = [f"rank/{r}" for r in range(2000)]
    sizes = []
    real = c._pipeline
    c._pipeline = lambda reqs, wait, key, *rest: sizes.append(sum(len(a) for _, _, a in reqs)) or real(reqs, wait, key, *rest)
    c.multi_set({k: k.encode() for k in keys[:1999]})
    with pytest.raises(st.StoreTimeoutError) as ei:
        c.multi_get(keys, timeout=0.2)
    assert ei.value.missing == ["rank/1999"]
    c.set("rank/1999", b"rank/1999")
    assert c.multi_get(keys) == [k.encode() for k in keys]
    assert sizes[-1] < 40   # not 2000 keys' worth of bytes


def test_malformed_or_huge_key_ranges_are_refused(server):
    s, key = raw_session(server)
    flags = bytes([st.MGET_VALUES | st.MGET_RANGE])
    for seq, rng in enumerate([st.encode_key_range("k/", 0, st.MAX_RANGE + 1),
                               st.encode_key_range("k/", 0, 5)[:-1],
                               struct.pack(">H", 2) + b"\xff\xfe" + struct.pack(">II", 0, 3)]):
        status, _ = raw_request(s, key, seq, st.OP_MGET, struct.pack(">d", 1.0) + flags + rng)
        assert status == st.ST_ERROR
    assert parked_state_is_empty(server)


# ------------------------------------------------------------------------------ own process

def test_the_store_in_its_own_process_serves_and_refuses_a_taken_port():
    from hpcring.bootstrap.store_server import StoreServerProcess
    with StoreServerProcess("127.0.0.1", 0, secret=SECRET, clients=30, ranks=10) as srv:
        c = StoreClient("127.0.0.1", srv.port, SECRET, timeout=5)
        c.multi_set({"a": b"1"})
        assert c.exchange({"b": b"2"}, ["a", "b"], timeout=5) == [b"1", b"2"]
        with pytest.raises(OSError):
            StoreServerProcess("127.0.0.1", srv.port, secret=SECRET)
        with pytest.raises(st.StoreAuthError):
            StoreClient("127.0.0.1", srv.port, b"another secret", timeout=5)
        child = srv._proc
    assert child.returncode == 0


PARENT = textwrap.dedent("""
    import sys, time
    from hpcring.bootstrap.store_server import StoreServerProcess
    srv = StoreServerProcess("127.0.0.1", 0, secret=b"s" * 64)
    print(srv.port, srv.pid, flush=True)
    time.sleep(60)
""")


def test_the_store_process_ends_with_rank_0():
    """Rank 0 killed outright (no atexit): its store process notices and exits, as the thread
    inside rank 0 used to."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": SRC})
    port, pid = map(int, parent.stdout.readline().split())
    StoreClient("127.0.0.1", port, b"s" * 64, timeout=5).set("k", b"v")
    parent.kill()
    parent.wait(10)
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}") or
                    open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", timeout=5)


def test_the_store_process_reports_a_descriptor_limit_too_low():
    code = textwrap.dedent("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
        from hpcring.bootstrap.store_server import StoreServerProcess
        from hpcring.errors import BootstrapError
        try:
            StoreServerProcess("127.0.0.1", 0, secret=b"s" * 64, clients=3072, ranks=1024)
        except BootstrapError as e:
            print("ERROR", e.message, "HINT", e.hint)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert out.stdout.startswith("ERROR") and "RLIMIT_NOFILE" in out.stdout and "ulimit -n" in out.stdout, out


def test_rank_0_serves_large_jobs_from_a_store_process_and_small_ones_in_process():
    from hpcring.bootstrap import init_store
    from hpcring.bootstrap.store_server import StoreServerProcess
    for ranks, kind in ((4, StoreServer), (init_store.OWN_PROCESS_MIN_RANKS, StoreServerProcess)):
        srv = init_store._start_server([0], SECRET, ranks=ranks)
        try:
            assert type(srv) is kind and srv.port
        finally:
            srv.close()
