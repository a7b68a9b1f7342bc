"""Helpers for the ring collective tests: in-process meshes (threads over socketpairs) and real
multi-process runs over loopback TCP with the authenticated rendezvous store."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
import traceback

from hpcring import _native
from hpcring.bootstrap.topology import Topology
from hpcring.collectives import Communicator
from hpcring.collectives.ring import RingBackend, node_layout

JOIN_S = 300.0   # a thread rank still running past this fails its test (it would hold pytest at exit)

SECRET = b"0123456789abcdef" * 4


def hosts_for(n: int) -> tuple[str, ...]:
    return tuple(f"node{r}" for r in range(n))


def topology(rank: int, size: int, hosts: tuple[str, ...] | None = None) -> Topology:
    """hosts: the host of each rank (default: all different, so no shared memory); ranks with
    equal names share a shared-memory segment."""
    return Topology(rank=rank, size=size, local_rank=rank, local_size=size, node_rank=0, num_nodes=1,
                    hosts=hosts or hosts_for(size), launcher="local", address="127.0.0.1")


class ThreadGroup:
    """n communicators in this process over socketpairs; ranks run in threads (the native
    calls release the GIL)."""

    def __init__(self, n: int, timeout: float = 30.0, streams: int = 1, threads: int = 1,
                 stripe_min: int | None = None, hosts: tuple[str, ...] | None = None,
                 shm_piece: int = 4096, cma: int | None = None) -> None:
        """hosts: ranks with equal names share memory (as RingBackend.create sets it up);
        shm_piece: tiny by default so that the tests cross many pieces; cma: read peers' memory
        directly from reads of this many bytes on (as the ranks agree when every probe succeeds),
        None: the segment only."""
        fds = [[None] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                pairs = [socket.socketpair() for _ in range(streams)]
                fds[i][j] = [a.detach() for a, _ in pairs]
                fds[j][i] = [b.detach() for _, b in pairs]
        self.n = n
        names = tuple(hosts or hosts_for(n))
        natives = [_native.Comm(r, n, fds[r], list(names), timeout) for r in range(n)]
        if hosts:
            for h in dict.fromkeys(names):
                seg = f"/hpcring-test-{os.getpid()}-{id(self):x}-{h}"
                try:
                    for r in range(n):
                        local, column = node_layout(names, r)
                        if names[r] == h and len(local) > 1:
                            natives[r].shm_attach(seg, r == local[0], local, column, shm_piece)
                            natives[r].twolevel_min = 0      # two-level at every size
                finally:
                    _native.shm_unlink(seg)
            for c in natives:
                if cma is not None and c.shm is not None:
                    assert c.shm_cma_probe() == (True, 0)
                    c.shm_cma, c.cma_min, c.cma_gather_min, c.cma_allgather_min = True, cma, cma, cma
        for c in natives:
            c.threads = threads
            if stripe_min is not None:
                c.stripe_min = stripe_min
        self.comms = [Communicator(RingBackend(c, names), timeout=timeout) for c in natives]

    def run(self, fn, ranks=None):
        """fn(comm) on every rank (or the given ranks) at once; returns (results, errors)."""
        ranks = range(self.n) if ranks is None else ranks
        res: list = [None] * self.n
        errs: list = [None] * self.n

        def work(r):
            try:
                res[r] = fn(self.comms[r])
            except BaseException as e:  # noqa: BLE001
                errs[r] = e
        ts = [threading.Thread(target=work, args=(r,), daemon=True) for r in ranks]
        for t in ts:
            t.start()
        end = time.monotonic() + JOIN_S      # the collectives have deadlines far below this
        for r, t in zip(ranks, ts):
            t.join(max(0.0, end - time.monotonic()))
            assert not t.is_alive(), f"thread rank {r} still running after {JOIN_S:.0f} s"
        return res, errs

    def run_ok(self, fn):
        res, errs = self.run(fn)
        for e in errs:
            if e is not None:
                raise e
        return res

    def set_rd_threshold(self, value: int) -> None:
        for c in self.comms:
            c.backend.rd_threshold = value

    def set_algo(self, algo: str) -> None:
        """Force allreduce's algorithm for every size from 1 byte: "ring", "rd" (recursive
        doubling), "rh" (recursive halving/doubling) or "direct" (one round, at most
        DIRECT_MAX_RANKS ranks); "default" restores the measured cut-overs."""
        from hpcring import _native
        rd, rh, direct = {"ring": (0, 0, 0), "rd": (1 << 40, 0, 0), "rh": (0, 1 << 40, 0),
                          "direct": (0, 0, 1 << 40),
                          "default": (_native.RD_THRESHOLD_DEFAULT, _native.RH_CHUNK_DEFAULT,
                                      _native.DIRECT_MAX_DEFAULT)}[algo]
        for c in self.comms:
            c.backend.rd_threshold, c.backend.rh_chunk, c.backend.direct_max = rd, rh, direct

    def close(self) -> None:
        for c in self.comms:
            c.close()


# ---- multi-process runs ------------------------------------------------------------------------
def _child(rank, size, port, secret, target, args, q, timeout, hosts=None):
    try:
        from hpcring.bootstrap.store_client import StoreClient
        store = StoreClient("127.0.0.1", port, SECRET, timeout)
        try:
            comm = Communicator.create(topology(rank, size, hosts), store, secret, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            q.put((rank, "setup-error", f"{type(e).__name__}: {e}", 0.0))
            return
        t0 = time.monotonic()
        try:
            out = target(comm, *args)
            q.put((rank, "ok", out, time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001
            q.put((rank, "error", f"{type(e).__name__}: {e}", time.monotonic() - t0))
    except BaseException:  # noqa: BLE001
        q.put((rank, "crash", traceback.format_exc(), 0.0))


def spawn_ranks(size, target, *args, timeout=30.0, secrets=None, wait=120.0, hosts=None):
    """Run target(comm, *args) in `size` spawned processes over loopback TCP with a real store.
    Returns {rank: (status, value, seconds)}; ranks that died without reporting are missing."""
    from hpcring.bootstrap.store_server import StoreServer
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with StoreServer("127.0.0.1", 0, secret=SECRET) as server:
        procs = [ctx.Process(target=_child, args=(r, size, server.port,
                                                  (secrets or {}).get(r, SECRET), target, args, q, timeout,
                                                  hosts))
                 for r in range(size)]
        for p in procs:
            p.start()
        return collect(q, procs, size, wait)


def collect(q, procs, size: int, wait: float) -> dict:
    """{rank: the rest of its (rank, ...) message} from ``q`` until every rank reported, all
    died, or ``wait`` s passed; then every process is joined (killed past 5 s)."""
    out = {}
    deadline = time.monotonic() + wait
    while len(out) < size and time.monotonic() < deadline:
        try:
            rank, *rest = q.get(timeout=0.5)
            out[rank] = tuple(rest)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    return out


# ---- process targets (module level so that spawn can import them) ------------------------------
def target_matrix(comm, seed):
    """A few collectives of each kind; returns digests for the parent to compare."""
    import numpy as np
    rng = np.random.default_rng(seed + comm.rank)
    out = {}
    for count in (0, 1, 7, 1000, 1 << 18):
        x = rng.integers(-100, 100, count).astype(np.int64)
        out[f"allreduce{count}"] = comm.allreduce(x).tobytes()
        out[f"allgather{count}"] = comm.allgather(x).tobytes()
        out[f"reduce_scatter{count}"] = comm.reduce_scatter(x, op="max").tobytes()
        b = x.copy()
        comm.broadcast(b, root=comm.size - 1)
        out[f"broadcast{count}"] = b.tobytes()
        out[f"input{count}"] = x.tobytes()
    comm.barrier()
    return out


def target_kill(comm, victim, nbytes, delay):
    """Every rank joins a big allreduce; the victim exits abruptly while inside it."""
    import numpy as np
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    if comm.rank == victim:
        threading.Timer(delay, lambda: os._exit(17)).start()
    # Keep collectives going until the victim is gone, so it always dies mid-collective
    # however fast or loaded the machine is (two fixed calls could finish before the timer).
    for _ in range(100_000):
        comm.allreduce(x, out=y)
    return "finished"


def target_sigkill(comm, victim, nbytes, delay, op="allreduce"):
    """Like target_kill, but the victim is SIGKILLed (no exit handlers, no unlinking)."""
    import signal
    import numpy as np
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    if comm.rank == victim:
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    call = {"allreduce": lambda: comm.allreduce(x, out=y), "alltoall": lambda: comm.alltoall(x, out=y)}[op]
    for _ in range(100_000):
        call()
    return "finished"


def target_direct_reads(comm, count):
    """allgather, broadcast and alltoall of count int64 per peer: the results, whether the host's
    ranks agreed to read each other's memory directly and the shared-memory barriers each took."""
    import numpy as np
    native = comm.backend._comm
    x = np.arange(count, dtype=np.int64) * (comm.rank + 1)
    out, phases = {}, {}
    for name, call in (("allgather", lambda: comm.allgather(x)),
                       ("broadcast", lambda: (lambda b: (comm.broadcast(b, root=1), b)[1])(x.copy())),
                       ("alltoall", lambda: comm.alltoall(np.tile(x, comm.size)))):
        before = native.shm_phase
        out[name] = call().tobytes()
        phases[name] = native.shm_phase - before
    return {"cma": native.shm_cma, "phases": phases, "allgather_min": native.cma_allgather_min,
            "alltoall_min": native.cma_min, **out}


def target_p2p_ring(comm, nbytes, rounds):
    """Each rank sends nbytes to the next rank and receives from the previous, rounds times (the
    receive posted before or after the send by round): the bytes checked, and the mailbox's
    direct-read counts (offered, read)."""
    import numpy as np
    n, r = comm.size, comm.rank
    wrong = 0
    for k in range(rounds):
        x = np.full(nbytes, (r * 7 + k) % 251, np.uint8)
        y = np.zeros(nbytes, np.uint8)
        if k % 2:
            req = comm.irecv(y, (r - 1) % n, tag=k)
            comm.send(x, (r + 1) % n, tag=k)
            req.wait()
        else:
            req = comm.isend(x, (r + 1) % n, tag=k)
            comm.recv(y, (r - 1) % n, tag=k)
            req.wait()
        wrong += int((y != ((r - 1) % n * 7 + k) % 251).sum())
    return wrong, comm.backend._mailbox.direct_counts()


def target_p2p_sender_dies(comm, nbytes):
    """Rank 0 offers nbytes to rank 1 and exits at once; rank 1 receives: the bytes or an error,
    never a hang."""
    import numpy as np
    if comm.rank == 0:
        comm.send(np.zeros(8, np.uint8), 1, tag=0)      # the connection exists (and agreed)
        comm.isend(np.full(nbytes, 3, np.uint8), 1, tag=1)
        os._exit(0)
    comm.recv(np.zeros(8, np.uint8), 0, tag=0)
    y = np.zeros(nbytes, np.uint8)
    t0 = time.monotonic()
    try:
        comm.recv(y, 0, tag=1)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"after {time.monotonic() - t0:.1f} s: {e}") from None
    return int((y != 3).sum())


def target_allreduce_small(comm):
    import numpy as np
    return comm.allreduce(np.arange(10, dtype=np.float32)).tolist()
