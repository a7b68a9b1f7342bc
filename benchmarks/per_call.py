"""Per-call cost of a small allreduce: where each microsecond goes (issue 23).

    python benchmarks/per_call.py                        # ring, mpi, nccl (fake layer)
    python benchmarks/per_call.py --backends ring --profile
    python benchmarks/per_call.py --save after.json --before before.json

A 4 KiB float32 sum allreduce (``--bytes``), in place (``comm.allreduce(x, out=x)``), 2 ranks:

* ring: 2 forked processes over a socketpair (tcp only, no shared memory), as
  tests/helpers/ring.py ThreadGroup builds the native communicators;
* mpi: ``mpirun -np 2 --allow-run-as-root --oversubscribe`` (Open MPI, mpi4py; vader/self);
* nccl: the real NcclBackend over the fake CuPy/NCCL layer (tests/helpers/fake_cuda.py), 2
  mirror ranks in this process, as tests/unit/test_device_buffers.py builds it.

Three loops per backend, interleaved over ``--rounds`` rounds (the median round is printed):

* ``total``: ``Communicator.allreduce(x, out=x)`` -- what a user pays;
* ``backend``: ``backend.allreduce(flat, flat, "float32", "sum", t)`` -- the backend object alone
  (ring: deadline/lazy-setup check and translation; mpi: the signature check, Iallreduce and the
  Test loop; nccl: staging checks, launch, event);
* ``native``: the library alone (ring: ``_native.Comm.allreduce``; mpi: mpi4py's blocking
  ``Allreduce``; nccl: the fake ``NcclCommunicator.allReduce``).

``overhead = total - native`` is hpcring's own per-call cost (target: <= 10 us);
``api = total - backend`` is the Communicator layer (adaptation, flight record, deadline,
dispatch). Measured on the 2-core dev machine, load average 3, before (commit 30594d6) and after
the short paths, back to back (``--save``/``--before``; the JSON is not kept), us per call:

    backend   total before -> after   own (in-call) before -> after   total - native after
    ring            20.6 -> 13.0              6.0 -> 3.1                     7.0
    mpi            507.3 -> 16.9             54.5 -> 8.0                    13.2 (check included)
    nccl (fake)     53.9 -> 33.4             34.8 -> 17.2                   25.9

``--profile`` runs the ``total`` loop under cProfile on rank 0 and names the top Python
frames by own time. ``--save`` writes the numbers as JSON; ``--before`` prints them beside.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

TIMEOUT = 60.0


def _loop(fn, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


class Timer:
    """Wraps a library call: the time spent inside it, summed (perf_counter_ns). ``also``: more
    wrapped calls (each timed on its own, summed into ``ns``)."""

    def __init__(self, fn) -> None:
        self.fn, self._ns, self.calls, self.also = fn, 0, 0, []

    @property
    def ns(self) -> int:
        return self._ns + sum(t.ns for t in self.also)

    @ns.setter
    def ns(self, v: int) -> None:
        self._ns = v
        for t in self.also:
            t.ns = v

    def __call__(self, *a, **k):
        t0 = time.perf_counter_ns()
        try:
            return self.fn(*a, **k)
        finally:
            self._ns += time.perf_counter_ns() - t0
            self.calls += 1


class _TimedComm:
    """An mpi4py communicator whose non-blocking collectives are timed (the rest passes through)."""

    def __init__(self, comm, timer: Timer) -> None:
        self._real = comm
        for name in ("Iallreduce", "Iallgather", "Ibcast", "Ireduce_scatter", "Ialltoall", "Ibarrier"):
            t = Timer(getattr(comm, name))
            timer.also.append(t)
            setattr(self, name, t)

    def __getattr__(self, name):
        return getattr(self._real, name)


def probe_cost() -> float:
    """us one Timer adds around a call (its own bookkeeping, outside the timed interval but
    inside the total loop's): subtracted from ``own`` once per timed call."""
    def nothing(*a):
        return None
    t = Timer(nothing)
    best = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(20000):
            t(1, 2, 3)
        mid = time.perf_counter_ns()
        for _ in range(20000):
            nothing(1, 2, 3)
        best.append((mid - t0) - (time.perf_counter_ns() - mid) - t.ns)
        t.ns = 0
    return max(statistics.median(best), 0) / 20000 / 1e3


def inside(fn, timer: Timer, iters: int, rounds: int, sync, res: dict) -> None:
    """The median round of the total loop with the library call timed where it happens, into
    ``res``: in_total (us per call of ``fn``), in_native (us per call inside ``timer``'s library
    calls), probe (us the timers themselves add per call, measured here and taken off own)."""
    tot, lib, calls = [], [], []
    for _ in range(rounds):
        sync()
        timer.ns = 0
        before = timer.calls + sum(t.calls for t in timer.also)
        tot.append(_loop(fn, iters))
        lib.append(timer.ns / 1e3 / iters)
        calls.append((timer.calls + sum(t.calls for t in timer.also) - before) / iters)
    i = sorted(range(rounds), key=lambda k: tot[k] - lib[k])[rounds // 2]
    res["in_total"], res["in_native"] = tot[i], lib[i]
    res["probe"] = probe_cost() * calls[i]


def general(comm, x) -> None:
    """The same call down the general path (Communicator.short_path off; absent before issue 23)."""
    comm.short_path = False
    try:
        comm.allreduce(x, out=x)
    finally:
        comm.short_path = True


def measure(phases: dict, iters: int, rounds: int, sync) -> dict:
    """Median (over rounds) of the mean us per call of each phase; phases interleaved per round."""
    got: dict = {k: [] for k in phases}
    for fn in phases.values():          # warm up
        for _ in range(max(10, iters // 20)):
            fn()
    for _ in range(rounds):
        for k, fn in phases.items():
            sync()
            got[k].append(_loop(fn, iters))
    return {k: statistics.median(v) for k, v in got.items()}


def profile(fn, iters: int, top: int) -> str:
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    lines = s.getvalue().splitlines()
    start = next((i for i, l in enumerate(lines) if "ncalls" in l), 0)
    return "\n".join(lines[start:start + top + 1])


# ---------------------------------------------------------------------------------------------
# ring: 2 processes over a socketpair
# ---------------------------------------------------------------------------------------------
def ring_rank(rank: int, fd: int, args, wfd: int | None) -> None:
    from hpcring import _native
    from hpcring.collectives import Communicator
    from hpcring.collectives.ring import DTYPE_CODES, OP_CODES, RingBackend
    hosts = ["node0", "node1"]
    nat = _native.Comm(rank, 2, [None, [fd]] if rank == 0 else [[fd], None], hosts, TIMEOUT)
    be = RingBackend(nat, tuple(hosts))
    comm = Communicator(be, timeout=TIMEOUT)
    n = args.bytes // 4
    x = np.ones(n, np.float32)
    comm.allreduce(x, out=x)
    assert (x == 2).all(), "wrong sum"
    x[...] = 0
    f32, s = DTYPE_CODES["float32"], OP_CODES["sum"]
    flight = _native.Flight(64, ())
    phases = {"total": lambda: comm.allreduce(x, out=x),
              "general": lambda: general(comm, x),
              "backend": lambda: be.allreduce(x, x, "float32", "sum", TIMEOUT),
              "native": lambda: _native.Comm.allreduce(nat, x, x, f32, s, TIMEOUT),
              "native_rec": lambda: _native.Comm.allreduce_rec(nat, flight, x, x, f32, s, TIMEOUT)}
    sync = lambda: _native.Comm.barrier(nat, TIMEOUT)  # noqa: E731
    res = measure(phases, args.iters, args.rounds, sync)
    # the short path's library call is allreduce_rec: the collective plus its flight record,
    # written in C; the record's share (native_rec - native, separate loops) is hpcring's own
    res["rec_in_c"] = max(res["native_rec"] - res["native"], 0.0)
    from hpcring.collectives import ring as R
    timer = Timer(_native.Comm.allreduce_rec)
    real, R._N = R._N, types.SimpleNamespace(allreduce=_native.Comm.allreduce, allreduce_rec=timer)
    try:
        inside(phases["total"], timer, args.iters, args.rounds, sync, res)
    finally:
        R._N = real
    if args.profile:
        res["profile"] = profile(phases["total"], args.iters, args.top)
    if wfd is not None:
        os.write(wfd, json.dumps(res).encode())
        os.close(wfd)
    comm.close()


def ring_rank0(args) -> dict:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            a.close()
            ring_rank(1, b.detach(), args, None)
        except BaseException:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    b.close()
    r, w = os.pipe()
    ring_rank(0, a.detach(), args, w)
    with os.fdopen(r) as fh:
        res = json.loads(fh.read())
    os.waitpid(pid, 0)
    return res


# ---------------------------------------------------------------------------------------------
# mpi: under mpirun
# ---------------------------------------------------------------------------------------------
def mpi_worker(args) -> None:
    from mpi4py import MPI
    from hpcring.collectives import Communicator
    from hpcring.collectives.mpi import MpiBackend
    world = MPI.COMM_WORLD
    be = MpiBackend(world.Dup())
    comm = Communicator(be, timeout=TIMEOUT)
    raw = world.Dup()
    n = args.bytes // 4
    x = np.ones(n, np.float32)
    comm.allreduce(x, out=x)
    assert (x == 2).all(), "wrong sum"
    x[...] = 0
    phases = {"total": lambda: comm.allreduce(x, out=x),
              "general": lambda: general(comm, x),
              "backend": lambda: be.allreduce(x, x, "float32", "sum", TIMEOUT),
              "native": lambda: raw.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)}
    res = measure(phases, args.iters, args.rounds, raw.Barrier)
    res["check"] = be.check
    # the library: starting every MPI request (the check's too) and its Test loop
    timer = Timer(be._wait)
    real_comm, be._wait, be._comm = be._comm, timer, _TimedComm(be._comm, timer)
    inside(phases["total"], timer, args.iters, args.rounds, raw.Barrier, res)
    res["lib_calls"] = sum(t.calls for t in timer.also) / (args.iters * args.rounds)
    del be._wait
    be._comm = real_comm
    if args.profile:
        res["profile"] = profile(phases["total"], args.iters, args.top)
    if world.Get_rank() == 0:
        print("PERCALL-JSON " + json.dumps(res), flush=True)
    comm.close()


def run_mpi(args) -> dict:
    cmd = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader",
           sys.executable, str(Path(__file__).resolve()), "--worker", "mpi", "--bytes", str(args.bytes),
           "--iters", str(args.iters), "--rounds", str(args.rounds), "--top", str(args.top)]
    if args.profile:
        cmd.append("--profile")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("PERCALL-JSON "):
            return json.loads(line[len("PERCALL-JSON "):])
    raise RuntimeError(f"mpirun failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")


# ---------------------------------------------------------------------------------------------
# nccl: the fake layer
# ---------------------------------------------------------------------------------------------
def run_nccl(args) -> dict:
    import helpers.fake_cuda as F
    cp = F.make_cupy(ngpus=2)
    sys.modules["cupy"] = cp
    sys.modules.setdefault("torch", F.make_torch(cp))
    from hpcring.collectives import nccl as N
    from hpcring.collectives.api import Communicator
    gpu = 1
    cp.cuda.Device(gpu).use()           # as NcclBackend.create leaves a rank's thread
    nc = F.FakeNcclComm(cp, 2, 0, gpu)
    be = N.NcclBackend(nc, 0, 2, gpu, hosts=("gpu0",) * 2, cupy=cp, nccl=F.make_nccl_module([nc]),
                       version=22000)
    comm = Communicator(be, timeout=TIMEOUT)
    n = args.bytes // 4
    with cp.cuda.Device(gpu):
        x = cp.empty((n,), np.float32)
    x._a[...] = 0
    base_live = list(cp.live)
    ndt, nop = N.nccl_dtype("float32", be.version, be._nccl), N.nccl_op("sum", "float32", be.version, be._nccl)[0]
    stream = cp.cuda.get_current_stream(gpu)
    ptr = x.data.ptr

    def trim():                         # the fakes log every call and view: keep them short
        nc.calls.clear()
        del cp.live[len(base_live):]
        comm.synchronize()

    def total():
        comm.allreduce(x, out=x)

    def backend():
        with cp.cuda.Device(gpu):
            be.allreduce(x, x, "float32", "sum", TIMEOUT)
            be.take_pending()

    def native():
        nc.allReduce(ptr, ptr, n, ndt, nop, stream.ptr)

    phases = {"total": total, "general": lambda: general(comm, x), "backend": backend, "native": native}
    res = measure(phases, args.iters, args.rounds, trim)
    timer = Timer(nc.allReduce)
    nc.allReduce = timer
    inside(total, timer, args.iters, args.rounds, trim, res)
    del nc.allReduce
    if args.profile:
        trim()
        res["profile"] = profile(total, min(args.iters, 2000), args.top)
    comm.close()
    return res


# ---------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="ring,mpi,nccl")
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="cProfile the total loop: top Python frames")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--save", help="write the results as JSON here")
    ap.add_argument("--before", help="a --save file of an earlier run: printed beside")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "mpi":
        mpi_worker(args)
        return 0
    before = json.loads(Path(args.before).read_text()) if args.before else {}
    results = {}
    load = os.getloadavg()[0]
    for name in args.backends.split(","):
        fn = {"ring": ring_rank0, "mpi": run_mpi, "nccl": run_nccl}[name]
        results[name] = fn(args)
    print(f"allreduce {args.bytes} B float32 sum, 2 ranks, in place; us per call, median of {args.rounds} "
          f"rounds x {args.iters}; load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("general = the same call with Communicator.short_path off (the general path, same run)")
    print("separate loops: total = Communicator.allreduce, backend = backend.allreduce, native = the library "
          "alone;\nin-call: the total loop with the library call timed where it happens (own = total - "
          "time inside the library - probe = hpcring's own per-call cost; probe = what the timers "
          "around the library calls add, measured; ring: + the flight record written inside the native "
          "call, allreduce_rec - allreduce in separate loops)")
    hdr = (f"{'backend':8} {'general':>8} {'total':>8} {'backend':>8} {'native':>8} {'api':>7} {'tot-nat':>8} |"
           f" {'in-call: total':>14} {'library':>8} {'probe':>6} {'own':>7}")
    if before:
        hdr += f" || {'before: total':>13} {'library':>8} {'own':>7}"
    print(hdr)
    for name, r in results.items():
        line = (f"{name:8} {r.get('general', float('nan')):8.1f} {r['total']:8.1f} {r['backend']:8.1f} {r['native']:8.1f} "
                f"{r['total'] - r['backend']:7.1f} {r['total'] - r['native']:8.1f} |"
                f" {r['in_total']:14.1f} {r['in_native']:8.1f} {r.get('probe', 0.0):6.1f}"
                f" {r['in_total'] - r['in_native'] - r.get('probe', 0.0) + r.get('rec_in_c', 0.0):7.1f}")
        b = before.get(name)
        if b:
            line += (f" || {b['in_total']:13.1f} {b['in_native']:8.1f}"
                     f" {b['in_total'] - b['in_native'] - b.get('probe', 0.0):7.1f}")
        print(line)
    if "mpi" in results:
        print(f"(mpi: the backend's signature check is {'on' if results['mpi'].get('check') else 'off'}: "
              f"{results['mpi'].get('lib_calls', 0):.0f} MPI requests per call, the check's small allreduce "
              "among them; the library column includes the backend's Test/sleep polling)")
    for name, r in results.items():
        if "profile" in r:
            print(f"\n--- {name}: top Python frames of the total loop (cProfile, own time) ---\n{r['profile']}")
    if args.save:
        Path(args.save).write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "profile"}
                                               for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
