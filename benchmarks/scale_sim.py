"""Scale harness: N ranks on one machine, each running the real bootstrap, store, ring and watchdog.

For each N (64..4096) the ranks are threads, many per process (``--per-proc``, fewer when the
ring's descriptors would not fit a process's RLIMIT_NOFILE), and every one of them runs:

1. ``init_bootstrap`` (the real store client rendezvous; rank 0 serves the store from its own
   process at every N here, so its CPU can be read), ``verify="none"`` (one interface: loopback);
2. a watchdog (the real one: tree listener, raise mode instead of exiting) and a ring
   communicator (the real C transport over loopback TCP, connecting on its first collective);
   shared memory is OFF (``shm=False``): every byte goes through TCP, as between hosts;
3. a 4-byte and a 1 MiB float32 allreduce, every result compared with the exact sum;
4. a frozen rank: the last rank sits in ``load_batch`` instead of the next allreduce; the others
   time out at ``--deadline`` and the watchdog's report must name it.

Three settings make threads a closer stand-in for one rank per core (all in the printed header):
the store process runs at ``--store-nice`` (-20, as root: a real job's store has a core; here its
one thread would get 1/(runnable threads) of the machine), the workers set CPython's GIL
switch interval to ``--switch-interval`` (50 ms: every thread waiting for the GIL wakes once per
interval, 800 000 wake-ups a second at 4096 rank threads with the 5 ms default), and
``--handshake-timeout`` (HPCRING_HANDSHAKE_TIMEOUT, 120 s: a rank thread can wait longer than
the 10 s default for the CPU between accepting a connection and authenticating it; at 4096 ranks
the store and the ring dropped such starved peers, which retried, which starved them more).

Simulated hosts: ``--per-host`` consecutive ranks share a host name (``node1``, ``node2``, ...),
which the ring uses for its layout and the report for its host names. Printed per N:

* ``rendezvous s``: "go" (every process started and imported) to the last rank out of init;
* ``connect s``: a store barrier's release to the last rank done with its first collective (a
  4-byte allreduce; the ring builds its connections there);
* ``fds/rank``: descriptors the rank's hpcring stack holds after connecting (store client,
  watchdog listener, ring), from /proc/self/fd, per process / ranks in it; ``ring fds/rank``: what
  connecting added (the ring's connections);
* ``store CPU s``: user+system of the store process, for the rendezvous and for the whole run;
* ``peak RSS MiB``: the sum over all processes (workers and store) of their peak resident set;
* ``4 B us`` / ``1 MiB ms``: mean allreduce latency of the slowest rank;
* ``frozen->report s``: the frozen rank's skipped collective starting to every rank holding the
  report (includes the deadline); ``#wrong``: results that differ from the exact one (must be 0).

Below each row: each rank thread's CPU in init, connecting and the failure (``cpu_fail``: from
the frozen collective's start to its report, in the rank's own thread, which does the tree's
work when its collective failed), when the ranks reached each step of the watchdog's failure,
and the machine's busy cores per second from the frozen collective's start (2.0 on this VM:
the phase waited for the CPU, not for a timeout).

With today's full mesh a rank holds N-1 ring connections: the run stops at the first N whose
predicted descriptors (from the previous N's measurement) pass ``--max-fds`` in all (kernel
socket memory on a shared machine) and says so. Connections on demand lower that prediction.

    python benchmarks/scale_sim.py --ranks 64,128,256,512 --markdown
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROC_RESERVE = 512                 # descriptors a worker process needs besides its ranks'


# =============================================================================== worker side

def _fds() -> tuple[int, int]:
    """(descriptors, sockets) of this process."""
    n = s = 0
    for fd in os.listdir("/proc/self/fd"):
        n += 1
        try:
            s += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n, s


def _cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hwm_kib(pid: int | str = "self") -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _big_data(n: int, count: int):
    """Rank r's 1 MiB vector is row r % 17 of these (element i: (31 r + i) % 17), and the exact
    sum over n ranks (integers below 2^24: exact in float32)."""
    import numpy as np
    i = np.arange(count)
    rows = np.stack([((31 * c + i) % 17).astype(np.float32) for c in range(17)])
    counts = np.bincount(np.arange(n) % 17, minlength=17)
    return rows, (counts.astype(np.float64) @ rows.astype(np.float64)).astype(np.float32)


def load_batch(wd, limit: float) -> None:
    """The frozen rank's "data loader": sits here until its watchdog holds the report (polling:
    one rank, and its report must say it is in load_batch, not in an hpcring call)."""
    end = time.monotonic() + limit
    while wd.report is None and time.monotonic() < end:
        time.sleep(0.05)


class _NoRing:
    """``--no-ring``: what the watchdog reads of a communicator (a flight recorder, a backend
    error), with no transport: the side channel alone, at sizes the ring cannot reach here."""

    def __init__(self, rank: int, n: int) -> None:
        from hpcring.collectives.recorder import FlightRecorder
        self.recorder = FlightRecorder(rank, n, "ring", capacity=16)
        self.backend = type("B", (), {"error": None})()
        done = self.recorder.queue("allreduce", "float32", 1, None, 10.0, site="scale_sim.py in rank_main")
        FlightRecorder.start(done)
        FlightRecorder.finish(done)

    def close(self) -> None:
        pass


def _side_channel_only(rank, n, a, wd, comm, client, rec) -> None:
    """Every rank but the last "enters" allreduce#2 and, at the deadline, fails it as the ring
    would (the watchdog's trigger); the last sits in load_batch."""
    from hpcring.collectives.recorder import FlightRecorder
    from hpcring.errors import CollectiveError
    client.barrier("sim/freeze", n, timeout=a.timeout)
    rec["t_freeze"], rec["pcpu_freeze"], rec["tcpu_freeze"] = time.time(), time.process_time(), time.thread_time()
    if rank == n - 1:
        load_batch(wd, a.deadline + 90)
        return
    stuck = comm.recorder.queue("allreduce", "float32", 1, None, a.deadline, site="scale_sim.py in rank_main")
    FlightRecorder.start(stuck)
    time.sleep(a.deadline)
    wd.on_failure(comm, stuck, CollectiveError(f"allreduce#2 recv from rank {n - 1} timed out after {a.deadline:g} s"))


def rank_main(rank: int, a: argparse.Namespace, env: dict, shared: dict, out: dict) -> None:
    import numpy as np

    from hpcring.bootstrap import init as binit
    from hpcring.bootstrap.topology import Topology
    from hpcring.collectives.api import Communicator
    from hpcring.collectives.recorder import locate
    from hpcring.diagnostics.watchdog import Watchdog
    from hpcring.errors import CollectiveError

    n, per_host = a.n, a.per_host
    hosts = tuple(f"node{r // per_host + 1}" for r in range(n))
    topo = Topology(rank=rank, size=n, local_rank=rank % per_host, local_size=min(per_host, n),
                    node_rank=rank // per_host, num_nodes=math.ceil(n / per_host), hosts=hosts,
                    launcher="local", job_id=env["HPCRING_JOB_ID"], address="127.0.0.1", interface="lo")
    wait = shared["barrier"]
    rec = out.setdefault(rank, {"wrong": 0})
    t0, c0 = time.time(), time.thread_time()
    done, client = binit.init_bootstrap(timeout=a.timeout, environ=env, topology=topo, verify="none")
    rec["t_init"], rec["cpu_init"] = time.time(), time.thread_time() - c0
    ident = threading.get_ident()
    wd = Watchdog(done, (done.master_addr or "127.0.0.1", client.port), client.secret, grace=a.grace,
                  abort=False, store=client)
    wd.where = lambda: locate(sys._current_frames().get(ident))
    wd.dump = lambda reason: None                     # no per-rank stack files (4096 of them)
    wd.start()
    if a.no_ring:
        comm = _NoRing(rank, n)
        wd.register(comm)
    else:
        comm = Communicator.create(done, client, client.secret, timeout=a.deadline * 6, backend="ring",
                                   watchdog=wd, shm=False)
    if rank == 0 and hasattr(client.server, "pid"):
        shared["store_pid"] = client.server.pid
    wait()                                            # this process: every rank bootstrapped
    if rank == rank0_of(shared):
        shared["fd1"] = _fds()
    client.barrier("sim/rendezvous", n, timeout=a.timeout)
    if rank == 0 and "store_pid" in shared:
        shared["store_cpu_rdv"] = _cpu(shared["store_pid"])
    small = np.array([rank + 1], np.float32)
    if a.no_ring:
        if rank == rank0_of(shared):
            shared["fd2"] = shared["fd1"]             # nothing connects later: what init + watchdog hold
        _side_channel_only(rank, n, a, wd, comm, client, rec)
        _finish(rank, n, a, wd, comm, client, rec, shared, t0)
        return
    client.barrier("sim/connect", n, timeout=a.timeout)
    rec["t_conn0"], c0 = time.time(), time.thread_time()
    want_small = np.float32(n * (n + 1) // 2)
    got = comm.allreduce(small)
    rec["t_conn"], rec["cpu_conn"] = time.time(), time.thread_time() - c0
    rec["wrong"] += int(got[0] != want_small)
    wait()
    if rank == rank0_of(shared):
        shared["fd2"] = _fds()
    client.barrier("sim/small", n, timeout=a.timeout)
    t = time.perf_counter()
    for _ in range(a.iters_small):
        got = comm.allreduce(small)
        rec["wrong"] += int(got[0] != want_small)
    rec["small_s"] = (time.perf_counter() - t) / a.iters_small
    if a.big:
        # In place (out=big), refilled from the process's 17 template rows: one buffer per rank,
        # so that 4096 ranks of 1 MiB fit a shared machine's memory.
        rows, want_big = shared["big_rows"], shared["want_big"]
        big = rows[rank % 17].copy()
        client.barrier("sim/big", n, timeout=a.timeout)
        t = time.perf_counter()
        for _ in range(a.iters_big):
            comm.allreduce(big, out=big)
            rec["wrong"] += int(not np.array_equal(big, want_big))
            np.copyto(big, rows[rank % 17])
        rec["big_s"] = (time.perf_counter() - t) / a.iters_big
        del big
    if a.straggler_ops:
        _straggler_phase(rank, n, a, comm, client, hosts, rec)
    client.barrier("sim/freeze", n, timeout=a.timeout)
    rec["t_freeze"], rec["pcpu_freeze"], rec["tcpu_freeze"] = time.time(), time.process_time(), time.thread_time()
    if rank == n - 1:
        load_batch(wd, a.deadline + 90)
    else:
        try:
            comm.allreduce(small, timeout=a.deadline)
            rec["wrong"] += 1                         # it cannot complete without the frozen rank
        except CollectiveError:
            pass
    _finish(rank, n, a, wd, comm, client, rec, shared, t0)


def _straggler_phase(rank, n, a, comm, client, hosts, rec) -> None:
    """``--straggler-ops`` 4-byte allreduces after a 5 ms sleep each, rank n-2's sleep
    ``--straggler-ms`` longer, with the real straggler watcher on every rank: rank 0 notes after
    how many of them it first held a verdict, and the verdict's line."""
    import io

    import numpy as np

    from hpcring.diagnostics.straggler_watch import StragglerWatch
    watch = StragglerWatch(comm, client, hosts, name="sim", out=io.StringIO()).start()
    small = np.array([1], np.float32)
    client.barrier("sim/straggler", n, timeout=a.timeout)
    pause = 0.005 + (a.straggler_ms / 1e3 if rank == n - 2 else 0.0)
    for i in range(a.straggler_ops):
        time.sleep(pause)
        comm.allreduce(small)
        if rank == 0 and "straggler_at" not in rec and watch.history:
            rec["straggler_at"] = i + 1
    if rank == 0:
        rec["straggler_line"] = watch.history[0]["line"] if watch.history else None
        rec["straggler_windows"] = watch.windows
    watch.stop()


def _finish(rank, n, a, wd, comm, client, rec, shared, t0) -> None:
    wd.wait_report(60)
    rec["t_report"], rec["pcpu_report"] = time.time(), time.process_time()
    rec["cpu_fail"] = time.thread_time() - rec.get("tcpu_freeze", time.thread_time())   # this rank's thread
    to_wall = time.time() - time.monotonic()
    rec["steps"] = {k: v + to_wall for k, v in wd.timings.items()}     # the watchdog's steps, wall clock
    rep = wd.report
    rec["headline"] = rep.headline if rep is not None else None
    if rank == 0 and rep is not None:
        rec["report"] = rep.text()
    rec["t_start"] = t0
    try:
        # Every rank holds its report before any closes its listener: first this process's ranks
        # (a thread barrier), then one store round trip per process, not per rank (4096 ranks
        # entering a store barrier while the last reports travel took CPU from them)
        wait = shared["barrier"]
        wait()
        if rank == rank0_of(shared):
            if client.add("sim/end", a.count) == n:
                client.set("sim/end-done", b"1")
            client.get("sim/end-done", timeout=a.timeout)
        wait()
        # rank 0 closes the store below: not before every process is past the barrier
        if rank == rank0_of(shared) and client.add("sim/left", a.count) == n:
            client.set("sim/all-left", b"1")
        if rank == 0:
            client.get("sim/all-left", timeout=a.timeout)
    finally:
        wd.close()
        comm.close()
        if rank == 0:
            shared["store_cpu_end"] = _cpu(shared["store_pid"]) if "store_pid" in shared else None
            shared["store_hwm"] = _hwm_kib(shared["store_pid"]) if "store_pid" in shared else 0
            if getattr(client, "server", None) is not None:
                client.server.close()
        client.close()


def rank0_of(shared: dict) -> int:
    return shared["first"]


def worker(a: argparse.Namespace) -> None:
    """One process of ``a.count`` ranks from ``a.first``: 'ready', wait for 'go', run, one JSON line."""
    import numpy as np  # noqa: F401 - imported before "ready": the clock measures hpcring, not imports

    from hpcring.bootstrap import init_store
    init_store.OWN_PROCESS_MIN_RANKS = 1                  # the store in its own process: its CPU is readable
    sys.setswitchinterval(a.switch_interval)          # one rank per process in a real job: no GIL to share
    env = dict(os.environ)
    shared = {"first": a.first}
    if a.big:
        shared["big_rows"], shared["want_big"] = _big_data(a.n, a.big // 4)
    bar = threading.Barrier(a.count, timeout=a.timeout)
    shared["barrier"] = bar.wait
    shared["fd0"] = _fds()
    out: dict = {}
    errors: list[str] = []

    def run(r: int) -> None:
        try:
            rank_main(r, a, env, shared, out)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            import traceback
            errors.append(f"rank {r}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            bar.abort()
    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(a.first, a.first + a.count)]
    print("@ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.timeout * 3)
    result = {"ranks": out, "errors": errors, "fd0": shared["fd0"], "fd1": shared.get("fd1"),
              "fd2": shared.get("fd2"), "hwm_kib": _hwm_kib(), "count": a.count,
              "store_cpu_rdv": shared.get("store_cpu_rdv"), "store_cpu_end": shared.get("store_cpu_end"),
              "store_hwm_kib": shared.get("store_hwm", 0)}
    print("@result " + json.dumps(result), flush=True)
    os._exit(0)    # threads of a failed run may still be parked; the result is out


# =============================================================================== parent side

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hard_fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def predict_ring_fds(n: int, seen: tuple[int, float] | None) -> float:
    """Ring descriptors per rank at ``n`` from the last measurement ``(n0, fds0)``: the full mesh
    (about n-1) when that is what was seen, else log-like growth; the full mesh before any."""
    if seen is None:
        return n - 1 + 4
    n0, f0 = seen
    if f0 >= 0.5 * (n0 - 1):
        return f0 + (n - n0)
    return f0 * math.log2(max(n, 2)) / math.log2(max(n0, 2)) + 2


def _proc_stat() -> tuple[float, float]:
    """(busy, all) jiffies of the whole machine, from /proc/stat's first line."""
    f = [float(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)         # idle and iowait are not busy


def _sample_cpu(samples: list, stop: threading.Event, every: float = 0.5) -> None:
    """The machine's busy cores over time (what the failure's figures are bound by here)."""
    while not stop.wait(every):
        samples.append((time.time(), *_proc_stat()))


def _renice_store(parent: subprocess.Popen, nice: int, stop: threading.Event) -> None:
    """Give the store process (rank 0's child ``hpcring.bootstrap.store_server``) priority ``nice``
    as soon as it appears: on a real job it has a core to itself; here its one thread would get
    1/(runnable threads) of 2 cores against thousands of rank threads."""
    while not stop.wait(0.02):
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
                if int(stat[1]) == parent.pid and b"store_server" in open(f"/proc/{d}/cmdline", "rb").read():
                    os.setpriority(os.PRIO_PROCESS, int(d), nice)
                    return
            except (OSError, ValueError, IndexError):
                continue


def run_one(n: int, *, per_proc: int = 64, per_host: int = 8, deadline: float = 10.0, grace: float = 5.0,
            timeout: float = 600.0, iters_small: int = 20, iters_big: int = 3, big: int = 1 << 20,
            ring_fds: float | None = None, no_ring: bool = False,
            log_dir: str | None = None, store_nice: int | None = None, switch_interval: float = 0.005,
            handshake_timeout: float | None = None, straggler_ops: int = 0, straggler_ms: float = 10.0) -> dict:
    """Run N ranks; returns the row (see the module doc) plus ``errors`` and the report text."""
    per_rank = ring_fds if ring_fds is not None else n + 3
    fit = max(1, int((_hard_fd_limit() - PROC_RESERVE) // (per_rank + 8)))
    k = max(1, min(per_proc, fit, n))
    starts = list(range(0, n, k))
    tmp = tempfile.mkdtemp(prefix=f"hpcring-scale-sim-{n}-")
    logs = Path(log_dir or tmp)
    from hpcring.bootstrap.auth import new_secret
    env = dict(os.environ, HPCRING_SECRET=new_secret(), HPCRING_STORE_PORT=str(_free_port()),
               HPCRING_MASTER_ADDR="127.0.0.1", HPCRING_JOB_ID=f"scale-sim-{n}-{os.getpid()}",
               HPCRING_JOB_DIR=tmp, HPCRING_RING_SHM="0", HPCRING_WATCHDOG="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HPCRING_SECRET_FILE", None)
    if handshake_timeout is not None:
        env["HPCRING_HANDSHAKE_TIMEOUT"] = f"{handshake_timeout:g}"
    procs = []
    stop_renice = threading.Event()
    cpu_samples: list = []
    threading.Thread(target=_sample_cpu, args=(cpu_samples, stop_renice), daemon=True).start()
    t_spawn = time.time()
    try:
        for first in starts:
            count = min(k, n - first)
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--n", str(n), "--first", str(first),
                    "--count", str(count), "--per-host", str(per_host), "--deadline", str(deadline),
                    "--grace", str(grace), "--timeout", str(timeout), "--iters-small", str(iters_small),
                    "--iters-big", str(iters_big), "--big", str(big), "--switch-interval", str(switch_interval),
                    "--straggler-ops", str(straggler_ops), "--straggler-ms", str(straggler_ms)] \
                + (["--no-ring"] if no_ring else [])
            err = open(logs / f"worker-{first}.log", "w")
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                          text=True, env=env, cwd=tmp))
            err.close()
            if first == 0 and store_nice is not None:
                threading.Thread(target=_renice_store, args=(procs[0], store_nice, stop_renice), daemon=True).start()
        end = time.monotonic() + timeout
        for p in procs:                       # every process imported and holds its threads
            line = ""
            while not line.startswith("@ready"):
                line = p.stdout.readline()
                if not line or time.monotonic() > end:
                    raise RuntimeError(f"worker {p.pid} did not start (see {logs})")
        t_go = time.time()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            line = ""
            while not line.startswith("@result "):
                line = p.stdout.readline()
                if not line:
                    break
            results.append(json.loads(line[len("@result "):]) if line.startswith("@result ") else None)
            p.wait(max(1.0, end - time.monotonic()))
    finally:
        stop_renice.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    row = _row(n, k, per_host, results, t_go, t_spawn, logs, deadline)
    row["busy_cores"] = _busy_from(cpu_samples, row.pop("_t_freeze", None), row.get("frozen_to_report_s"))
    if not row["n_errors"] and log_dir is None:
        shutil.rmtree(tmp, ignore_errors=True)        # logs are kept only when something failed
        row["logs"] = None
    return row


def _busy_from(samples: list, t0: float | None, span: float | None) -> list[float] | None:
    """Busy cores (machine-wide) per second from ``t0`` (the frozen collective's start) for
    ``span`` + 1 s: whether a phase of the failure waited for the CPU or for something else."""
    if t0 is None or span is None or len(samples) < 2:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    out = []
    for i in range(int(span) + 2):
        pts = [x for x in samples if t0 + i <= x[0] <= t0 + i + 1.0]
        if len(pts) >= 2:
            (ta, ba, _), (tb, bb, _) = pts[0], pts[-1]
            out.append(round((bb - ba) / hz / max(tb - ta, 1e-3), 1))
    return out


def _row(n, k, per_host, results, t_go, t_spawn, logs, deadline) -> dict:
    errors = [f"worker {i}: no result (see {logs})" for i, r in enumerate(results) if r is None]
    results = [r for r in results if r is not None]
    ranks = {int(r): v for res in results for r, v in res["ranks"].items()}
    errors += [e for res in results for e in res["errors"]]
    row = {"N": n, "ranks/proc": k, "procs": math.ceil(n / k), "hosts": math.ceil(n / per_host),
           "ok_ranks": len(ranks), "errors": errors[:5], "n_errors": len(errors), "logs": str(logs),
           "startup_s": t_go - t_spawn}

    def span(key, frm=None):
        vals = [v[key] for v in ranks.values() if key in v]
        if not vals or len(vals) < n:
            return None
        return max(vals) - (frm if frm is not None else min(v[key] for v in ranks.values()))
    row["rendezvous_s"] = span("t_init", t_go)
    conn0 = [v["t_conn0"] for v in ranks.values() if "t_conn0" in v]
    row["connect_s"] = span("t_conn", min(conn0)) if conn0 else None
    with_fds = [r for r in results if r.get("fd2") and r.get("fd1")]
    if with_fds:
        row["fds_per_rank"] = sum(r["fd2"][0] - r["fd0"][0] for r in with_fds) / sum(r["count"] for r in with_fds)
        row["ring_fds_per_rank"] = sum(r["fd2"][0] - r["fd1"][0] for r in with_fds) / sum(r["count"] for r in with_fds)
        row["sockets_per_rank"] = sum(r["fd2"][1] - r["fd0"][1] for r in with_fds) / sum(r["count"] for r in with_fds)
    store = next((r for r in results if r.get("store_cpu_end") is not None), None)
    row["store_cpu_rdv_s"] = store["store_cpu_rdv"] if store else None
    row["store_cpu_s"] = store["store_cpu_end"] if store else None
    row["peak_rss_mib"] = (sum(r["hwm_kib"] for r in results) + (store["store_hwm_kib"] if store else 0)) / 1024
    smalls = [v["small_s"] for v in ranks.values() if "small_s" in v]
    bigs = [v["big_s"] for v in ranks.values() if "big_s" in v]
    row["small_us"] = max(smalls) * 1e6 if len(smalls) == n else None
    row["big_ms"] = max(bigs) * 1e3 if bigs and len(bigs) == n else None
    row["wrong"] = sum(v.get("wrong", 0) for v in ranks.values()) + (n - len(ranks))
    freeze = [v["t_freeze"] for v in ranks.values() if "t_freeze" in v]
    reported = [v["t_report"] for v in ranks.values() if v.get("headline")]
    row["frozen_to_report_s"] = (max(reported) - min(freeze)) if freeze and len(reported) == n else None
    row["_t_freeze"] = min(freeze) if freeze else None
    # CPU the worker processes spent from the freeze to their last rank's report (the failure's
    # rounds, the timed-out collective's return and the harness's waits), summed over processes
    fail_cpu = [max(v["pcpu_report"] for v in res["ranks"].values()) - min(v["pcpu_freeze"] for v in res["ranks"].values())
                for res in results if res["ranks"] and all("pcpu_report" in v and "pcpu_freeze" in v
                                                          for v in res["ranks"].values())]
    row["failure_cpu_s"] = sum(fail_cpu) if len(fail_cpu) == len(results) else None
    # per watchdog step: when the last / the median rank reached it, from the frozen collective's start
    steps: dict[str, list[float]] = {}
    for v in ranks.values():
        for k, t in v.get("steps", {}).items():
            steps.setdefault(k, []).append(t)
    row["report_steps"] = {k: [len(ts), round(min(ts) - min(freeze), 2), round(sorted(ts)[len(ts) // 2] - min(freeze), 2),
                               round(max(ts) - min(freeze), 2)]
                           for k, ts in steps.items()} if freeze else {}
    cpu = {k: sorted(v[k] for v in ranks.values() if k in v) for k in ("cpu_init", "cpu_conn", "cpu_fail")}
    row["rank_cpu_ms"] = {k: [round(1e3 * sum(c) / len(c), 2), round(1e3 * c[-1], 1)] for k, c in cpu.items() if c}
    row["deadline_s"] = deadline
    host = f"node{(n - 1) // per_host + 1}"
    heads = {v.get("headline") for v in ranks.values()}
    row["headline"] = heads.pop() if len(heads) == 1 else sorted(map(str, heads))
    row["frozen_named"] = all(isinstance(v.get("headline"), str) and f"rank {n - 1} ({host}) never joined" in v["headline"]
                              for v in ranks.values()) and len(ranks) == n
    row["report"] = ranks.get(0, {}).get("report")
    row["straggler_at"] = ranks.get(0, {}).get("straggler_at")
    row["straggler_line"] = ranks.get(0, {}).get("straggler_line")
    return row


COLUMNS = [("N", "N", "{}"), ("ranks/proc", "ranks/proc", "{}"), ("hosts", "hosts", "{}"),
           ("rendezvous s", "rendezvous_s", "{:.2f}"), ("connect s", "connect_s", "{:.2f}"),
           ("fds/rank", "fds_per_rank", "{:.1f}"), ("ring fds/rank", "ring_fds_per_rank", "{:.1f}"),
           ("store CPU s (rdv/all)", None, None), ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
           ("4 B us", "small_us", "{:.0f}"), ("1 MiB ms", "big_ms", "{:.1f}"),
           ("frozen->report s", "frozen_to_report_s", "{:.2f}"), ("failure CPU s", "failure_cpu_s", "{:.1f}"),
           ("#wrong", "wrong", "{}"),
           ("named", "frozen_named", "{}"), ("straggler at", "straggler_at", "{}")]


def _cell(row, key, fmt) -> str:
    if key is None:
        a, b = row.get("store_cpu_rdv_s"), row.get("store_cpu_s")
        return "-" if a is None else f"{a:.2f}/{b:.2f}"
    v = row.get(key)
    return "-" if v is None else fmt.format(v)


def print_row(row, markdown: bool, header: bool) -> None:
    if markdown:
        if header:
            print("| " + " | ".join(c for c, _, _ in COLUMNS) + " |")
            print("|" + "---|" * len(COLUMNS))
        print("| " + " | ".join(_cell(row, k, f) for _, k, f in COLUMNS) + " |", flush=True)
    else:
        if header:
            print("  ".join(f"{c:>10}" for c, _, _ in COLUMNS))
        print("  ".join(f"{_cell(row, k, f):>10}" for _, k, f in COLUMNS), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,128,256,512,1024,2048,4096", help="comma-separated N list")
    ap.add_argument("--per-proc", type=int, default=64, help="ranks (threads) per process, at most")
    ap.add_argument("--per-host", type=int, default=8, help="ranks per simulated host")
    ap.add_argument("--deadline", type=float, default=10.0, help="the frozen collective's deadline, s")
    ap.add_argument("--grace", type=float, default=5.0, help="the watchdog's wait for snapshots, s")
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on one N's run, s")
    ap.add_argument("--iters-small", type=int, default=20)
    ap.add_argument("--iters-big", type=int, default=3)
    ap.add_argument("--big", type=int, default=1 << 20, help="bytes of the large allreduce (0: skip it)")
    ap.add_argument("--max-fds", type=int, default=300_000,
                    help="stop before an N predicted to need more ring descriptors than this in all")
    ap.add_argument("--no-ring", action="store_true",
                    help="the side channel alone: rendezvous, watchdogs and a frozen rank, no ring or allreduce")
    ap.add_argument("--store-nice", type=int, default=-20,
                    help="the store process's nice value (root only; a real job's store has a core of its own)")
    ap.add_argument("--switch-interval", type=float, default=0.05,
                    help="sys.setswitchinterval in the workers, s (CPython's 5 ms default wakes every thread "
                         "waiting for the GIL 200 times a second: thousands of rank threads thrash)")
    ap.add_argument("--handshake-timeout", type=float, default=120.0,
                    help="HPCRING_HANDSHAKE_TIMEOUT for the ranks, s (10 s in a real job; thousands of rank "
                         "threads on a few cores wait longer than that for the CPU mid-handshake)")
    ap.add_argument("--straggler-ops", type=int, default=0,
                    help="collectives of the straggler phase (0: none); rank N-2 is the slow one")
    ap.add_argument("--straggler-ms", type=float, default=10.0, help="rank N-2's extra sleep per collective, ms")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", help="append each row as a JSON line to this file")
    ap.add_argument("--show-report", action="store_true", help="print rank 0's report text per N")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    try:
        sizes = [int(x) for x in a.ranks.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ranks must be comma-separated integers, not {a.ranks!r}")
    if not sizes or any(not 2 <= s <= 65536 for s in sizes):
        ap.error("every N in --ranks must be 2..65536")
    for name in ("per_proc", "per_host", "iters_small", "iters_big"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.big < 0 or a.big % 4 or a.big > 1 << 28:
        ap.error("--big must be a multiple of 4 bytes, 0..256 MiB")
    if not (0 < a.deadline <= 3600 and 0 < a.timeout <= 86400 and 0 < a.grace <= 600):
        ap.error("--deadline, --grace and --timeout must be positive (deadline <= 3600 s)")
    if not 0.1 <= a.handshake_timeout <= 600:
        ap.error("--handshake-timeout must be 0.1..600 s")
    print(f"# scale_sim: ranks as threads (<= {a.per_proc} per process), {a.per_host} per simulated host, "
          f"shared memory off, loopback TCP; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"RLIMIT_NOFILE hard {_hard_fd_limit()}; store process at nice "
          f"{a.store_nice if os.geteuid() == 0 else 'unchanged (not root)'}; GIL switch interval "
          f"{a.switch_interval * 1e3:g} ms; handshake timeout {a.handshake_timeout:g} s", flush=True)
    seen, header, status = None, True, 0
    for n in sorted(sizes):
        need = predict_ring_fds(n, seen)
        if a.no_ring:
            need = 0
        if seen is None and need * n > a.max_fds:
            # Too big for a full mesh: measure what the ring holds at a small N before giving up.
            print("# probing the ring's descriptors per rank at N=64", flush=True)
            probe = run_one(64, per_proc=a.per_proc, per_host=a.per_host, deadline=min(a.deadline, 5.0),
                            grace=a.grace, timeout=a.timeout, iters_small=1, iters_big=1)
            if probe.get("ring_fds_per_rank") is not None:
                seen = (64, probe["ring_fds_per_rank"])
                need = predict_ring_fds(n, seen)
        if need * n > a.max_fds:
            print(f"# N={n}: stopped: the ring needs ~{need:.0f} descriptors per rank here "
                  f"({'full mesh' if seen is None or seen[1] >= 0.5 * (seen[0] - 1) else 'measured growth'}; "
                  f"{need * n / 1e6:.2f} M in all, over --max-fds {a.max_fds}); "
                  "connections on demand would lower it", flush=True)
            break
        row = run_one(n, per_proc=a.per_proc, per_host=a.per_host, deadline=a.deadline, grace=a.grace,
                      timeout=a.timeout, iters_small=a.iters_small, iters_big=a.iters_big, big=a.big,
                      ring_fds=need if not a.no_ring else 0, no_ring=a.no_ring,
                      store_nice=a.store_nice if os.geteuid() == 0 else None, switch_interval=a.switch_interval,
                      handshake_timeout=a.handshake_timeout, straggler_ops=a.straggler_ops,
                      straggler_ms=a.straggler_ms)
        print_row(row, a.markdown, header)
        header = False
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if a.show_report and row.get("report"):
            print(row["report"], flush=True)
        print(f"# N={n}: rank CPU ms (mean, max): {row.get('rank_cpu_ms')}; watchdog steps "
              f"(ranks, first, median and last s from the frozen collective's start): {row.get('report_steps')}; "
              f"busy cores per second from that start: {row.get('busy_cores')}", flush=True)
        if row["n_errors"] or row["wrong"] or not row["frozen_named"]:
            status = 1
            print(f"# N={n}: {row['n_errors']} errors, {row['wrong']} wrong, frozen rank named: "
                  f"{row['frozen_named']}; {row['errors'][:2]}; logs in {row['logs']}", flush=True)
            break
        if row.get("ring_fds_per_rank") is not None:
            seen = (n, row["ring_fds_per_rank"])
        print(f"# load {os.getloadavg()[0]:.1f}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
