"""One node's part of the preflight (``python -m hpcring.preflight``): listen, publish, probe,
measure, publish again, stay until the peers that test this node are done. See the package
docstring for the protocol and the timing."""
from __future__ import annotations

import hashlib
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hpcring.bootstrap import netif_probe
from hpcring.errors import HpcringError
from hpcring.preflight import checks
from hpcring.preflight.record import BadRecord, read_record, write_record
from hpcring.bootstrap.auth import load_secret
from hpcring.bootstrap.launchers import detect
from hpcring.preflight.local import run_local_checks

FULL_MESH_MAX = 16       # up to this many nodes every pair is probed; above, ring neighbours + RANDOM_PEERS
RANDOM_PEERS = 3
PROBE_RETRIES = 1        # a failed probe is tried once more when the deadline allows


@dataclass
class Options:
    out: Path
    expect: list[str]
    deadline: float = 30.0
    min_gbps: float = 0.0
    gpus: int = 0
    ifname: str | None = None
    ifname_for: dict[str, str] = field(default_factory=dict)   # host -> spec (tests, odd nodes)
    host: str | None = None
    blackhole: bool = False   # tests only: this node's listeners accept nothing (connects time out)

    @property
    def connect_timeout(self) -> float:
        return max(0.5, min(3.0, self.deadline / 10))

    @property
    def join_by(self) -> float:
        """Seconds after the start by which a peer's first file must have appeared: what is left
        after that is enough to probe it (two tries of the connect timeout), measure and write."""
        return self.deadline - max(3 * self.connect_timeout + 1.5, 0.25 * self.deadline)


def probe_graph(hosts: Sequence[str], full_mesh_max: int = FULL_MESH_MAX,
                random_peers: int = RANDOM_PEERS) -> dict[str, list[str]]:
    """Whom each host probes. Up to ``full_mesh_max`` hosts: everyone else (N*(N-1) probes). Above:
    its ring neighbours (i+1, i-1) and ``random_peers`` others, drawn from a generator seeded by the
    host list, so every node computes the same graph (and knows who tests it) without talking:
    O(N) probes in all, each node tested by at least its two neighbours."""
    n = len(hosts)
    if n <= full_mesh_max:
        return {h: [p for p in hosts if p != h] for h in hosts}
    rng = random.Random(hashlib.sha256("\0".join(hosts).encode()).digest())
    out = {}
    for i, h in enumerate(hosts):
        picks = [hosts[(i + 1) % n], hosts[(i - 1) % n]]
        while len(picks) < 2 + min(random_peers, n - 3):
            p = hosts[rng.randrange(n)]
            if p != h and p not in picks:
                picks.append(p)
        out[h] = picks
    return out


def _detect_host(environ: Mapping[str, str]) -> str:
    try:
        return detect(environ).host
    except Exception:   # noqa: BLE001  (an environment the launcher tables do not know)
        return socket.gethostname().split(".")[0]


class _Task:
    def __init__(self, opts: Options, environ: Mapping[str, str], secret: bytes, host: str) -> None:
        self.o, self.env, self.secret, self.host = opts, environ, secret, host
        self.t0 = time.monotonic()
        self.started = time.time()
        self.deadline = self.t0 + opts.deadline
        self.join_by = self.t0 + opts.join_by
        self.graph = probe_graph(opts.expect)
        self.targets = self.graph[host]
        self.testers = [h for h, ts in self.graph.items() if host in ts]
        self.poll = 0.1 if len(opts.expect) <= 64 else 0.5
        self.seen: dict[str, dict] = {}       # host -> its latest verified record
        self.bad_files: dict[str, str] = {}
        self.listeners: list[netif_probe.ProbeListener] = []
        self.local: dict = {}
        self.pairs: dict[str, dict] = {}

    # -- steps -------------------------------------------------------------------------------
    def run(self) -> int:
        spec, source = checks.interface_spec(self.o.ifname_for.get(self.host) or self.o.ifname, self.env)
        listen, iface_error = self._listen(spec)
        worker = threading.Thread(target=self._local_checks, daemon=True, name="hpcring-preflight-local")
        worker.start()
        base = {"started": self.started, "deadline": self.o.deadline, "spec": spec, "spec_source": source,
                "listen": listen, "iface_error": iface_error, "pid": os.getpid()}
        try:
            write_record(self.o.out, self.host, {**base, "state": "listening"}, self.secret)
            self._wait_for(self.targets, until=self.join_by, done=False)
            pairs = self.pairs = self._probe_all()
            bw = self._bandwidth()
            worker.join(max(0.0, self.deadline - 1.5 - time.monotonic()))
            local = dict(self.local) if not worker.is_alive() else \
                {"error": f"the version/GPU checks did not finish within {self.o.deadline:g} s"}
            write_record(self.o.out, self.host, {
                **base, "state": "done", "ended": time.time(), "elapsed": round(time.monotonic() - self.t0, 3),
                "versions": local.get("versions"), "gpu": local.get("gpu"), "local_error": local.get("error"),
                "mode": "all pairs" if len(self.o.expect) <= FULL_MESH_MAX else f"ring + {RANDOM_PEERS} random",
                "pairs": pairs, "bw": bw, "min_gbps": self.o.min_gbps,
                "unseen": sorted(set(self.targets) - set(self.seen)),
                "bad_files": self.bad_files}, self.secret)
            # Stay reachable until every node that tests this one is done (or gave no sign by join_by).
            self._wait_for(self.testers, until=self.deadline - 0.5, done=True)
        finally:
            for lst in self.listeners:
                lst.close()
        self.summary = self._summary(pairs, bw, local)
        return 0

    def _summary(self, pairs: dict, bw: dict | None, local: dict) -> str:
        ok = sum(1 for p in pairs.values() if p.get("ok"))
        link = "no ring link" if bw is None else \
            f"ring link to {bw['to']}: " + (f"{bw['gbps']:.3g} Gbit/s" if "gbps" in bw else f"failed ({bw.get('error')})")
        unseen = sorted(set(self.targets) - set(self.seen))
        return (f"hpcring preflight {self.host}: done in {time.monotonic() - self.t0:.1f} s; "
                f"{ok} of {len(pairs)} peers connected" + (f", no file from {', '.join(unseen[:4])}" if unseen else "")
                + f"; {link}" + (f"; {local['error']}" if local.get("error") else ""))

    def _listen(self, spec: str | None) -> tuple[list[dict], str | None]:
        try:
            cands = checks.candidates(spec)
        except HpcringError as e:
            return [], e.message
        out = []
        for c in cands:
            lst = netif_probe.ProbeListener(c.address, self.secret, on_authenticated=checks.sink,
                                      listen="blackhole" if self.o.blackhole else True,
                                      io_timeout=self.o.connect_timeout)
            self.listeners.append(lst)
            out.append({"name": c.name, "address": c.address, "port": lst.port, "error": lst.error})
        return out, None

    def _local_checks(self) -> None:
        """In a thread that only waits: the child process does the work (see preflight.local)."""
        self.local.update(run_local_checks(self.o.gpus, self.deadline - 2.0 - time.monotonic()))

    def _wait_for(self, hosts: Sequence[str], until: float, done: bool) -> None:
        """Poll the files of ``hosts`` until each is there (``done``: in state done, or absent once
        ``join_by`` passed) or ``until`` (monotonic)."""
        pending = set(hosts)
        while pending:
            for h in sorted(pending):
                try:
                    rec = read_record(self.o.out, h, self.secret)
                except BadRecord as e:
                    self.bad_files[h] = str(e)
                    continue
                if rec is None:
                    if done and h not in self.seen and time.monotonic() >= self.join_by:
                        pending.discard(h)
                    continue
                self.bad_files.pop(h, None)
                self.seen[h] = rec
                if not done or rec.get("state") == "done":
                    pending.discard(h)
            if not pending or time.monotonic() + self.poll >= until:
                return
            time.sleep(self.poll)

    def _probe_all(self) -> dict[str, dict]:
        """``{peer: {"ok", "iface", "address", "ms"} or {"ok": False, "err"}}`` for every target seen;
        a peer's candidates in its order, the first that authenticates wins; peers in parallel."""
        peers = [h for h in self.targets if h in self.seen]
        if not peers:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
            return dict(zip(peers, pool.map(self._probe_one, peers)))

    def _probe_one(self, peer: str) -> dict:
        listen = self.seen[peer].get("listen")
        if not isinstance(listen, list) or not listen:
            return {"ok": False, "err": "it listens on no interface"}
        errs: list[str] = []
        for attempt in range(1 + PROBE_RETRIES):
            # A second round only with time for it: one busy moment (a starved listener) must not
            # name a node; a dead address costs one more connect timeout.
            if attempt and self.deadline - 1.0 - time.monotonic() < self.o.connect_timeout + 0.5:
                break
            errs = []
            for c in listen:
                if not isinstance(c, dict):
                    continue
                name, addr, port = c.get("name"), c.get("address"), c.get("port")
                if not isinstance(addr, str) or not isinstance(port, int) or not port:
                    errs.append(f"{name}: {c.get('error') or 'no listener'}")
                    continue
                left = self.deadline - 1.0 - time.monotonic()
                if left <= 0.1:
                    errs.append(f"{name} {addr}: no time left")
                    break
                t = time.perf_counter()
                err = netif_probe.probe(addr, port, self.secret, min(self.o.connect_timeout, left))
                if err is None:
                    return {"ok": True, "iface": name, "address": addr, "port": port, "tries": attempt + 1,
                            "ms": round((time.perf_counter() - t) * 1e3, 2)}
                errs.append(f"{name} {addr}:{port}: {err}")
        return {"ok": False, "err": "; ".join(errs) or "no usable address"}

    def _bandwidth(self) -> dict | None:
        """The ring link to the next node (in --expect-nodes order) that showed up."""
        hosts = self.o.expect
        i = hosts.index(self.host)
        nxt = next((hosts[(i + k) % len(hosts)] for k in range(1, len(hosts))
                    if hosts[(i + k) % len(hosts)] in self.seen), None)
        if nxt is None:
            return None
        out: dict = {"to": nxt}
        pair = self._pair_result(nxt)
        if not pair.get("ok"):
            return {**out, "error": f"not connected ({pair.get('err')})"}
        res = checks.send_bulk(pair["address"], pair["port"], self.secret, self.deadline - 1.0,
                               connect_timeout=self.o.connect_timeout)
        return {**out, "iface": pair["iface"], **res}

    def _pair_result(self, peer: str) -> dict:
        return self.pairs[peer] if peer in self.pairs else self._probe_one(peer)


def run_task(opts: Options, environ: Mapping[str, str] | None = None, *, quiet: bool = False) -> int:
    """This node's part; 0 when it finished (whatever it found), 1 when it could not take part
    (no secret, the folder not writable), with the reason on stderr."""
    env = os.environ if environ is None else environ
    host = opts.host or _detect_host(env)
    if host not in opts.expect:
        print(f"hpcring preflight: this node {host!r} is not among --expect-nodes "
              f"({', '.join(opts.expect[:8])}{' ...' if len(opts.expect) > 8 else ''})", file=sys.stderr)
        return 1
    try:
        secret = load_secret(env)
        task = _Task(opts, env, secret, host)
        code = task.run()
        if not quiet:
            print(task.summary, flush=True)
        return code
    except HpcringError as e:
        print(f"hpcring preflight on {host}: {e.message}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
    except OSError as e:
        print(f"hpcring preflight on {host}: cannot write {opts.out}/{host}.json: {e.strerror or e}", file=sys.stderr)
    return 1
