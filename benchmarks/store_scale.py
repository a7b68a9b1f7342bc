"""How the rendezvous store scales: N clients each publish one key and read all N.

For N in 64..8192, over real TCP on loopback: a store server in its own process, and N
clients, each its own authenticated connection, spread over several worker processes (each
drives its clients from one selector loop with the store's own wire code: thousands of Python
threads would measure the GIL, not the store). Every connection is open and authenticated
before the clock starts; then every client publishes ``addr/<r>`` and reads ``addr/0..N-1``:

* ``batched`` (this tree's server): what ``StoreClient.exchange()`` sends: an MSET and an MGET
  of the N keys together, one round trip; the server parks the MGET until the last key arrives.
  ``addr/0..N-1`` travels as a key range (``--key-list``: as the list of N keys).
* ``per-key`` (the old server, loaded from git ``--old-rev``): what the old ``set()`` and
  ``gather()`` sent: a SET, then one GET per key, each after the previous reply: N round trips
  per client, N^2 in all. Run only up to ``--old-max`` clients.

Printed per row: the rendezvous time (go to the last client's last reply, every reply's MAC
checked and its values decoded), the CPU seconds the server process and the client processes
spent in it (user + system), the connect phase (N handshakes) with the server's CPU for it,
and the server's peak open descriptors (sampled from /proc/<pid>/fd).

    python benchmarks/store_scale.py                      # 64..8192, old up to 1024
    python benchmarks/store_scale.py --sizes 64 1024 --old-max 256 --markdown

Bounded by the machine: server and clients share its cores (2 on the machine these figures
were taken on): the clients' CPU (N replies of N values to check and decode: the work a real
job spreads over N nodes) dominates the wall time at large N.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"b" * 64
OLD_REV_DEFAULT = "45ffe54"   # the last commit before batched operations (issue 21)


# ---------------------------------------------------------------------------------- modules

def _old_module(rev: str, name: str) -> types.ModuleType:
    """``src/hpcring/bootstrap/<name>.py`` as of git ``rev``, as a module of its own."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:src/hpcring/bootstrap/{name}.py"],
                          check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType(f"old_{name}")
    mod.__file__ = f"{rev}:{name}.py"
    sys.modules[mod.__name__] = mod
    exec(compile(text, mod.__file__, "exec"), mod.__dict__)
    return mod


def _server_class(kind: str, rev: str):
    if kind == "old":
        return _old_module(rev, "store_server").StoreServer
    from hpcring.bootstrap.store_server import StoreServer
    return StoreServer


# ---------------------------------------------------------------------------------- children

def serve(kind: str, rev: str, n: int, busy: int = 0) -> None:
    """Child: run a store server, print its port, serve until stdin closes. ``busy``: threads
    that run Python code meanwhile (rank 0's training loop holding the GIL)."""
    cls = _server_class(kind, rev)

    def spin():
        x = 0
        while True:
            x = (x * 31 + 7) % 1000003
    for _ in range(busy):
        threading.Thread(target=spin, daemon=True).start()
    srv = cls("127.0.0.1", 0, secret=SECRET, clients=n) if kind == "new" else cls("127.0.0.1", 0, secret=SECRET)
    print(srv.port, flush=True)
    sys.stdin.read()
    print(json.dumps(srv.stats), flush=True)
    srv.close()


class _Rank:
    """One client connection, driven by the worker's selector loop (the wire steps of
    StoreClient, non-blocking, so that thousands fit in one process without a thread each)."""

    __slots__ = ("r", "sock", "state", "inbuf", "out", "ns", "nc", "key", "send_seq", "recv_seq",
                 "next_get", "values", "t_done")

    def __init__(self, r: int, sock) -> None:
        self.r, self.sock, self.state = r, sock, "hello"
        self.inbuf, self.out = bytearray(), bytearray()
        self.key, self.send_seq, self.recv_seq, self.next_get = b"", 0, 0, 0
        self.values, self.t_done = None, 0.0


def work(kind: str, port: int, n: int, lo: int, hi: int, timeout: float, key_list: bool = False) -> None:
    """Child: clients ``lo..hi-1`` in one selector loop. Connect and authenticate all, say
    ready, wait for go, rendezvous, report the latest finish time (CLOCK_MONOTONIC is
    system-wide), this process's CPU seconds for the rendezvous and any errors.

    ``new``: MSET(addr/r) + MGET(addr/0..n-1) sent together (StoreClient.exchange).
    ``old``: SET(addr/r), then GET addr/0, addr/1, ... one at a time (the old StoreClient.gather).
    """
    import resource
    import secrets
    import selectors
    import socket
    import struct

    from hpcring.bootstrap import auth
    from hpcring.bootstrap import store_wire as w

    keys = [f"addr/{i}" for i in range(n)]
    mine = {r: f"10.{r >> 16 & 255}.{r >> 8 & 255}.{r & 255}:29500".encode() for r in range(lo, hi)}
    sel = selectors.DefaultSelector()
    errors: list[str] = []
    pending = list(range(lo, hi))[::-1]
    open_, ready, done = 0, 0, 0
    conns: list[_Rank] = []
    go_time = None

    def send(c: _Rank, data: bytes) -> None:
        c.out += data
        flush(c)

    def flush(c: _Rank) -> None:
        try:
            while c.out:
                del c.out[:c.sock.send(c.out)]
        except BlockingIOError:
            pass
        sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.out else 0), c)

    def request(c: _Rank, op: int, key: str, args: bytes) -> bytes:
        frame = w.encode_frame(c.key, w._DIR_TO_SERVER, c.send_seq, w.encode_request(op, key, args))
        c.send_seq += 1
        return frame

    # What StoreClient.exchange() sends for "every rank's key": a key range (a few bytes), or with
    # --key-list the full list (every client asks for the same list: encoded once per process, as
    # a real rank would encode its own on its own core, not on the server's 2 here).
    if key_list:
        mget_args = w.F64.pack(timeout) + bytes([w.MGET_VALUES]) + w.encode_keys(keys)
    else:
        mget_args = w.F64.pack(timeout) + bytes([w.MGET_VALUES | w.MGET_RANGE]) + w.encode_key_range("addr/", 0, n)

    def start(c: _Rank) -> None:
        if kind == "new":
            send(c, request(c, w.OP_MSET, "", w.encode_items([(keys[c.r], mine[c.r])]))
                 + request(c, w.OP_MGET, "", mget_args))
            c.state = "mset"
        else:
            send(c, request(c, w.OP_SET, keys[c.r], mine[c.r]))
            c.state = "set"

    def on_reply(c: _Rank, status: int, payload: bytes) -> None:
        nonlocal done
        if status != w.ST_OK:
            raise RuntimeError(f"status {status} in state {c.state}: {payload[:80]!r}")
        if c.state == "mset":
            c.state = "mget"
            return
        if c.state == "mget":
            c.values = w.decode_values(payload)
        elif c.state == "set":
            c.state, c.values = "get", []
        else:
            c.values.append(payload)
        if c.state == "get" and len(c.values) < n:
            send(c, request(c, w.OP_GET, keys[len(c.values)], w.F64.pack(timeout)))
            return
        if len(c.values) != n or c.values[c.r] != mine[c.r]:
            raise RuntimeError("wrong values")
        c.values, c.state, c.t_done = None, "done", time.monotonic()
        done += 1

    def on_readable(c: _Rank) -> None:
        nonlocal ready
        chunk = c.sock.recv(1 << 20)
        if not chunk:
            raise RuntimeError(f"closed by the server in state {c.state}")
        c.inbuf += chunk
        if c.state == "hello":
            if len(c.inbuf) < auth.STORE.hello_len:
                return
            c.ns = bytes(c.inbuf[len(auth.STORE.magic):auth.STORE.hello_len])
            del c.inbuf[:auth.STORE.hello_len]
            c.nc = secrets.token_bytes(auth.NONCE_LEN)
            send(c, c.nc + auth.STORE.client_proof(SECRET, c.ns, c.nc))
            c.state = "proof"
        if c.state == "proof":
            if len(c.inbuf) < w.MAC_LEN:
                return
            if bytes(c.inbuf[:w.MAC_LEN]) != auth.STORE.server_proof(SECRET, c.ns, c.nc):
                raise RuntimeError("bad server proof")
            del c.inbuf[:w.MAC_LEN]
            c.key, c.state = w.session_key(SECRET, c.ns, c.nc), "ready"
            ready += 1
            return
        while len(c.inbuf) >= 36:
            (length,) = struct.unpack_from(">I", c.inbuf, 0)
            if len(c.inbuf) < 36 + length:
                return
            body = bytes(c.inbuf[36:36 + length])
            if bytes(c.inbuf[4:36]) != w.frame_mac(c.key, w._DIR_TO_CLIENT, c.recv_seq, body):
                raise RuntimeError("bad reply MAC")
            del c.inbuf[:36 + length]
            c.recv_seq += 1
            on_reply(c, body[0], body[1:])

    def loop(until, deadline: float) -> None:
        nonlocal open_
        while not until() and time.monotonic() < deadline:
            while pending and open_ - ready < 128:   # at most 128 handshakes in flight per process
                r = pending.pop()
                sock = socket.socket()
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.connect_ex(("127.0.0.1", port))
                c = _Rank(r, sock)
                conns.append(c)
                sel.register(sock, selectors.EVENT_READ, c)
                open_ += 1
            for k, ev in sel.select(1.0):
                c = k.data
                try:
                    if ev & selectors.EVENT_WRITE:
                        flush(c)
                    if ev & selectors.EVENT_READ:
                        on_readable(c)
                except Exception as e:   # noqa: BLE001 - a benchmark reports, it does not stop
                    errors.append(f"rank {c.r}: {type(e).__name__}: {e}")
                    sel.unregister(c.sock)
                    c.sock.close()
                    c.state = "failed"

    t0 = time.monotonic()
    loop(lambda: ready + len(errors) >= hi - lo, t0 + timeout)
    print(json.dumps({"ready": ready, "errors": errors[:3], "connect_s": time.monotonic() - t0}), flush=True)
    sys.stdin.readline()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for c in conns:
        if c.state == "ready":
            start(c)
    loop(lambda: done + len(errors) >= hi - lo, time.monotonic() + timeout)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"finish": max((c.t_done for c in conns), default=0.0), "done": done,
                      "first": min((c.t_done for c in conns if c.t_done), default=0.0),
                      "cpu": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                      "errors": errors[:3], "nerrors": len(errors)}), flush=True)
    for c in conns:
        c.sock.close()


# ---------------------------------------------------------------------------------- parent

def _cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _child(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def run(kind: str, n: int, *, rev: str, procs: int, timeout: float, key_list: bool = False,
        busy: int = 0) -> dict:
    server = _child(["--serve", kind, rev, str(n), str(busy)])
    workers: list[subprocess.Popen] = []
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _fds(server.pid))
            stop.wait(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    try:
        port = int(server.stdout.readline())
        sampler.start()
        cpu0 = _cpu(server.pid)
        per = -(-n // procs)
        workers = [_child(["--work", kind, str(port), str(n), str(lo), str(min(n, lo + per)), str(timeout),
                           "list" if key_list else "range"])
                   for lo in range(0, n, per)]
        ready = [json.loads(w.stdout.readline()) for w in workers]
        connect_s = max(r["connect_s"] for r in ready)   # the workers' own: without their start-up
        peak[0] = max(peak[0], _fds(server.pid))          # every connection is open now
        cpu1 = _cpu(server.pid)
        errors = [e for r in ready for e in r["errors"]]
        if sum(r["ready"] for r in ready) != n:
            return {"kind": kind, "n": n, "error": f"only {sum(r['ready'] for r in ready)} connected: {errors}"}
        start = time.monotonic()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        results = [json.loads(w.stdout.readline()) for w in workers]
        elapsed = max(r["finish"] for r in results) - start
        print(f"    first reply after {min(r['first'] for r in results) - start:.2f}s", file=sys.stderr)
        cpu2 = _cpu(server.pid)
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], _fds(server.pid))
        errors = [e for r in results for e in r["errors"]]
        return {"kind": kind, "n": n, "connect_s": connect_s, "rendezvous_s": elapsed,
                "server_cpu_connect_s": cpu1 - cpu0, "server_cpu_rendezvous_s": cpu2 - cpu1,
                "peak_fds": peak[0], "done": sum(r["done"] for r in results),
                "client_cpu_rendezvous_s": sum(r["cpu"] for r in results),
                "errors": sum(r["nerrors"] for r in results), "first_errors": errors[:3]}
    finally:
        stop.set()
        for w in workers:
            try:
                w.stdin.close()
            except OSError:
                pass
            try:
                w.wait(timeout + 30)
            except subprocess.TimeoutExpired:
                w.kill()
        try:
            server.stdin.close()
        except OSError:
            pass
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def _row(r: dict) -> list[str]:
    if "error" in r:
        return [r["kind"], str(r["n"]), "failed: " + r["error"][:60]] + [""] * (len(HEAD) - 3)
    return [r["kind"], str(r["n"]), f"{r['rendezvous_s']:.2f}", f"{r['server_cpu_rendezvous_s']:.2f}",
            f"{r['client_cpu_rendezvous_s']:.2f}", f"{r['connect_s']:.2f}", f"{r['server_cpu_connect_s']:.2f}",
            str(r["peak_fds"]),
            "ok" if r["errors"] == 0 and r["done"] == r["n"] else f"{r['errors']} errors: {r['first_errors'][:1]}"]


HEAD = ["server", "clients", "rendezvous s", "server CPU s", "clients' CPU s", "connect s",
        "server CPU s (connect)", "peak fds", "result"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 2048, 4096, 8192])
    ap.add_argument("--old-max", type=int, default=1024, help="largest N for the per-key (old) runs")
    ap.add_argument("--old-rev", default=OLD_REV_DEFAULT, help="git revision of the old store")
    ap.add_argument("--procs", type=int, default=4, help="client processes")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--key-list", action="store_true",
                    help="batched runs send the N keys as a list, not as a key range")
    ap.add_argument("--busy", type=int, default=0,
                    help="threads running Python code in the server's process (rank 0 training)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per batched row; the fastest is shown")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    rows = []
    for n in a.sizes:
        for kind in ("new", "old"):
            if kind == "old" and n > a.old_max:
                continue
            runs = [run(kind, n, rev=a.old_rev, procs=min(a.procs, n), timeout=a.timeout, key_list=a.key_list,
                        busy=a.busy)
                    for _ in range(a.repeat if kind == "new" else 1)]
            r = min(runs, key=lambda x: x.get("rendezvous_s", float("inf")))
            r["kind"] = (f"batched ({'key list' if a.key_list else 'key range'})" if kind == "new"
                         else f"per-key (old, {a.old_rev})")
            rows.append(r)
            print("  " + " | ".join(_row(r)), file=sys.stderr, flush=True)
    table = [HEAD] + [_row(r) for r in rows]
    if a.markdown:
        print("| " + " | ".join(HEAD) + " |")
        print("|" + "|".join("---" for _ in HEAD) + "|")
        for row in table[1:]:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(row[i]) for row in table) for i in range(len(HEAD))]
        for row in table:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--work":
        work(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]),
             sys.argv[8] == "list")
    else:
        main()
