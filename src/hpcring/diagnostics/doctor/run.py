"""Steps 1-3 of the doctor, collectively: publish facts, probe every pair, time every ring link,
then rank 0 evaluates and every rank returns the same report."""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from hpcring.bootstrap import netif_probe as netif
from hpcring.bootstrap.store_wire import StoreTimeoutError, from_json, json_value
from hpcring.errors import BootstrapError, UsageError
from hpcring.netio import recv_exact
from hpcring.ranks import each_on_host
from hpcring.diagnostics.doctor.model import (BW_ROUNDS, CHOSEN, CHUNK, CONNECT_TIMEOUT, DoctorReport,
                                              GATHER_MARGIN_S, LATENCY_TRIES, Options, _COUNT, _STEP_NAMES)
from hpcring.diagnostics.doctor.facts import _targets, collect_facts
from hpcring.diagnostics.doctor.checks import evaluate, slow_links
import hpcring
from hpcring.bootstrap.auth import new_secret
from hpcring.bootstrap.launchers import detect


def _sink(conn: socket.socket) -> None:
    """Bandwidth receiver, run after a peer authenticated: count bytes until EOF, acknowledge the count."""
    conn.settimeout(10.0)   # one recv; the sender stops after its seconds, or dies and we give up
    buf, total = bytearray(1 << 20), 0
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        total += n
    conn.sendall(_COUNT.pack(total))


def measure_link(address: str, port: int, secret: bytes, seconds: float, deadline: float,
                 rounds: int = BW_ROUNDS, connect_timeout: float = CONNECT_TIMEOUT) -> tuple[float, int]:
    """``(best rate in bytes/s, bytes of that round)`` to a listener with the :func:`_sink` hook.

    Each round sends for ``seconds / rounds`` then waits for the receiver's count, so the rate
    covers delivery, not just filling socket buffers. Raises netif.ProbeFailed or OSError; never
    waits past ``deadline`` (monotonic)."""
    best = (0.0, 0)
    chunk = memoryview(bytes(CHUNK))
    for _ in range(rounds):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline reached before the transfer")
        with netif.probe_connect(address, port, secret, timeout=min(connect_timeout, left)) as s:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds / rounds:
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)
            (got,) = _COUNT.unpack(recv_exact(s, _COUNT.size))
            rate = got / (time.perf_counter() - t0)
        best = max(best, (rate, got))
    return best


def _latency(address: str, port: int, secret: bytes, timeout: float) -> float:
    """Best of LATENCY_TRIES connect+authenticate round trips, in ms (sequential: no self-contention)."""
    best = float("inf")
    for _ in range(LATENCY_TRIES):
        t0 = time.perf_counter()
        netif.probe_connect(address, port, secret, timeout=timeout).close()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


class _DoctorRank:
    """One rank's part of a doctor run (see the module doc for the steps and keys)."""

    def __init__(self, topology, store, secret: bytes, opts: Options, environ: Mapping[str, str], emit=None) -> None:
        self.topo, self.store, self.secret, self.opts, self.env = topology, store, secret, opts, environ
        self.emit = emit
        self.rank, self.size = topology.rank, topology.size
        self.started = time.time()
        self.deadline = time.monotonic() + opts.timeout
        # The n-th doctor run of a session has generation n on every rank: keys of two runs never mix.
        self.prefix = f"doctor/{store.add(f'doctor/gen/{self.rank}', 1)}"
        self.listeners: list[netif.ProbeListener] = []
        per_link = 0.5 * opts.timeout / max(1, self.size) - 0.3   # the ring chain must fit in half the time
        self.bw_seconds = max(0.05, min(opts.bw_seconds, per_link))

    def run(self) -> DoctorReport:
        try:
            mine = collect_facts(self.topo, self.env)
            mine["listen"] = self._listen(mine)
            facts = self._share_facts(mine)
            self.store.set(self._key("conn", self.rank), json_value(self._probe_all(facts)))
            # Rank 0 starts the bandwidth chain only once every rank has finished probing, so no
            # probe competes with a transfer for the CPU.
            conn = [from_json(v) for v in self._gather("conn")] if self.rank == 0 else None
            if self.size > 1:
                self._measure_link(facts, "bw", after=self.rank - 1 if self.rank else None)
            links = self._recheck(facts) if self.size > 1 else []
            return self._conclude(facts, conn, links) if self.rank == 0 else self._wait_report()
        finally:
            for lst in self.listeners:
                lst.close()

    # -- steps ------------------------------------------------------------------------------
    def _listen(self, fact: dict) -> dict:
        """Probe listeners on every target address, a bandwidth sink on the chosen one."""
        out: dict = {"targets": {}, "bulk": None}
        by_addr: dict[str, int] = {}
        for label, (name, addr) in _targets(fact).items():
            if addr not in by_addr:
                lst = netif.ProbeListener(addr, self.secret)
                self.listeners.append(lst)
                by_addr[addr] = lst.port
            out["targets"][label] = [name, addr, by_addr[addr]]
        if CHOSEN in out["targets"]:
            addr = out["targets"][CHOSEN][1]
            sink = netif.ProbeListener(addr, self.secret, on_authenticated=_sink)
            self.listeners.append(sink)
            out["bulk"] = [addr, sink.port]
        return out

    def _share_facts(self, mine: dict) -> list[dict]:
        """Rank 0 gets every rank's facts; the others only where to probe each rank (O(size) bytes
        each instead of everything rank 0 evaluates)."""
        self.store.set(self._key("facts", self.rank), json_value(mine))
        if self.rank == 0:
            facts = [from_json(v) for v in self._gather("facts")]
            self.store.set(f"{self.prefix}/facts", json_value([{k: f[k] for k in ("rank", "host", "listen")} for f in facts]))
            return facts
        return self._get(f"{self.prefix}/facts", "rank 0 to publish everyone's facts")

    def _probe_all(self, facts: list[dict]) -> dict:
        """``{label: {peer: {"err": reason or None, "ms": latency}}}`` for every peer and target."""
        jobs = [(label, peer, *f["listen"]["targets"][label][1:])
                for label in (facts[self.rank]["listen"]["targets"]) for peer, f in enumerate(facts)
                if peer != self.rank and label in f["listen"]["targets"]]
        timeout = max(0.1, min(self.opts.connect_timeout, self._left()))
        errors: list[str | None] = []
        if jobs:
            with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:   # dead links time out together
                errors = list(pool.map(lambda j: netif.probe(j[2], j[3], self.secret, timeout), jobs))
        out: dict = {}
        for (label, peer, addr, port), err in zip(jobs, errors):
            ms = None
            if err is None:
                try:
                    ms = _latency(addr, port, self.secret, timeout)
                except netif.ProbeFailed as e:
                    err = f"latency probe: {e}"
            out.setdefault(label, {})[str(peer)] = {"err": err, "ms": ms}
        return out

    def _measure_link(self, facts: list[dict], what: str, after: int | None) -> None:
        """Measure link rank -> rank+1 once rank ``after`` published its ``what`` record (None: now),
        then publish this one: a chain, so transfers never overlap."""
        if after is not None:
            self._get(self._key(what, after), f"rank {after} to finish its ring link measurement")
        dst = (self.rank + 1) % self.size
        record: dict = {"src": self.rank, "dst": dst, "seconds": self.bw_seconds}
        bulk = facts[dst]["listen"]["bulk"]
        try:
            if not bulk:
                raise netif.ProbeFailed(f"rank {dst} has no bandwidth listener (no chosen interface)")
            record["rate"], record["bytes"] = measure_link(bulk[0], bulk[1], self.secret, self.bw_seconds,
                                                           self.deadline, connect_timeout=self.opts.connect_timeout)
        except (netif.ProbeFailed, OSError, EOFError) as e:
            record["error"] = str(e) if isinstance(e, netif.ProbeFailed) else f"{type(e).__name__}: {e}"
        self.store.set(self._key(what, self.rank), json_value(record))

    def _recheck(self, facts: list[dict]) -> list[dict] | None:
        """Links that look slow are measured once more (chained again) and keep their best rate, so
        one transfer disturbed by another process does not name a link. Rank 0 returns the links."""
        links = None
        if self.rank == 0:
            links = [from_json(v) for v in self._gather("bw")]
            suspects = sorted(lk["src"] for lk, _, _ in slow_links(facts, links)[0])
            self.store.set(f"{self.prefix}/recheck", json_value(suspects))
        else:
            suspects = self._get(f"{self.prefix}/recheck", "rank 0 to gather the ring link measurements")
        if self.rank in suspects:
            i = suspects.index(self.rank)
            self._measure_link(facts, "bw2", after=suspects[i - 1] if i else None)
        if self.rank == 0 and suspects:
            for new in (from_json(v) for v in self._gather("bw2", suspects)):
                old = links[new["src"]]
                if not new.get("error") and new["rate"] > old.get("rate", 0):
                    links[new["src"]] = {**old, **new, "error": None}
                links[new["src"]]["rechecked"] = True
        return links

    def _conclude(self, facts: list[dict], conn: list[dict], links: list[dict]) -> DoctorReport:
        report = DoctorReport(evaluate(facts, conn, links, self.bw_seconds), [f["host"] for f in facts],
                              self.topo.job_id, self.started, time.time(),
                              {"facts": facts, "pairs": conn, "links": links})
        try:
            if self.emit is not None:   # before publishing: the others may exit as soon as they have it
                self.emit(report)
        finally:   # the verdict only: the others need no copy of the data behind it
            self.store.set(f"{self.prefix}/report", json_value(report.to_dict(with_data=False)))
        return report

    def _wait_report(self) -> DoctorReport:
        return DoctorReport.from_dict(self._get(f"{self.prefix}/report", "rank 0 to publish the report"))

    # -- store helpers ----------------------------------------------------------------------
    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}/{what}/{rank}"

    def _gather(self, what: str, ranks: Sequence[int] | None = None) -> list[bytes]:
        """Rank 0: the ``what`` key of ``ranks`` (default all); a rank that never publishes it is named
        to everyone (rank 0 publishes the error where the others wait, a little before the deadline)."""
        margin = min(GATHER_MARGIN_S, 0.1 * self.opts.timeout)
        ranks = range(self.size) if ranks is None else ranks
        try:
            return self.store.gather([self._key(what, r) for r in ranks], timeout=max(0.0, self._left() - margin))
        except StoreTimeoutError as e:
            missing = sorted(int(k.rsplit("/", 1)[1]) for k in e.missing)
            err = BootstrapError(
                f"hpcring doctor: {each_on_host(missing, self.topo.hosts)} did not report "
                f"{'its' if len(missing) == 1 else 'their'} {_STEP_NAMES[what]} within {self.opts.timeout:g}s "
                f"({len(missing)} of {self.size} ranks missing)",
                hint="every rank of the job must run the doctor: check that those ranks run it and are not "
                     "stuck (their logs); raise --timeout on a busy machine")
            for key in (f"{self.prefix}/facts", f"{self.prefix}/recheck", f"{self.prefix}/report"):   # where the others wait
                self.store.set(key, json_value({"error": err.message, "hint": err.hint}))
            raise err from None

    def _get(self, key: str, waiting_for: str):
        """The JSON value of ``key``; raises rank 0's error when it published one there."""
        try:
            value = from_json(self.store.get(key, timeout=self._left()))
        except StoreTimeoutError as e:
            raise BootstrapError(f"hpcring doctor on rank {self.rank} ({self.topo.host}): timed out after "
                                 f"{self.opts.timeout:g}s waiting for {waiting_for} (key {key!r})",
                                 hint=e.hint) from None
        if isinstance(value, dict) and "error" in value:
            raise BootstrapError(value["error"], hint=value.get("hint"))
        return value

    def _left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def run_doctor(session=None, options: Options | None = None, environ: Mapping[str, str] | None = None,
               emit=None) -> DoctorReport:
    """Run the doctor on this rank; every rank of the job must call it (it is collective).

    ``session``: an ``hpcring.init()`` session (default: ``hpcring.init(timeout=options.timeout)``,
    which joins an existing one). Returns the same report on every rank within ``options.timeout``
    seconds, or raises BootstrapError naming the ranks (and hosts) that did not take part.
    ``emit(report)`` runs on rank 0 before any other rank receives the report: output written there
    is out before a rank exits with the verdict and its launcher (srun --kill-on-bad-exit, mpirun)
    kills the rest, rank 0 included.
    """
    opts = (options or Options()).check()
    if session is None:
        session = hpcring.init(timeout=opts.timeout)
    env = os.environ if environ is None else environ
    return _DoctorRank(session.topology, session.store, session.secret, opts, env, emit).run()


def ensure_secret_when_alone(environ: dict | None = None) -> bool:
    """A process started by no launcher is a job of one rank with no job secret: give it a private
    one (in ``environ``, default os.environ) so ``hpcring doctor`` typed on a node checks that node.
    Returns whether it did; ranks of real jobs always get the job's secret from their launcher."""
    env = os.environ if environ is None else environ
    if env.get("HPCRING_SECRET_FILE") or env.get("HPCRING_SECRET") or env.get("HPCRING_SESSION"):
        return False
    if detect(env).launcher != "single":
        return False
    env["HPCRING_SECRET"] = new_secret()
    return True


def write_json(report: DoctorReport, path: str) -> None:
    """The report with everything it is based on, as JSON (rank 0 writes it)."""
    try:
        with open(path, "w") as fh:
            json.dump(report.to_dict(), fh, indent=1)
    except OSError as e:
        raise UsageError(f"cannot write the doctor's JSON report to {path}: {e.strerror}",
                         hint="pass a --json path in a writable directory (on a shared file system in a job)") from e
