"""Network interfaces: list them, pick candidates from a spec, verify them with real connections.

Spec syntax (site config ``interface:``, ``init_bootstrap(interface=...)``, HPCRING_IFNAME), the
same as NCCL_SOCKET_IFNAME:

* ``ib,eth``      use interfaces whose names start with ``ib`` or ``eth`` (in that order)
* ``=eth0,ib0``   exact names only
* ``^docker,lo``  every interface the automatic rules keep, except these prefixes (``^=`` exact)
* empty / None    automatic: drop loopback, docker*, virbr*, veth*, link-local 169.254/16, down
                  interfaces and interfaces without IPv4; InfiniBand (ib*) first, then by /sys speed.

Verification (:func:`verify_interfaces`) does not trust names: every rank listens on each of its
candidates (a short-lived socket that answers an HMAC challenge with the job secret before it
reads anything), publishes ``(name, address, port)`` in the store, and connects to its ring
neighbour's (or every rank's) candidates. Rank 0 gathers the results and picks, for each rank,
its first candidate that every tester reached, so ``ib0`` on one host may pair with ``ibp65s0``
on another.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from hpcring.bootstrap import auth
from hpcring.errors import BootstrapError
from hpcring.netio import recv_exact  # noqa: F401  (callers of the probes read through it)
from hpcring.ranks import runs

log = logging.getLogger("hpcring.bootstrap.netif")

AUTO_EXCLUDED_PREFIXES = ("docker", "virbr", "veth")
LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
IFF_RUNNING = 0x40   # lower layer up (carrier)
SIOCGIFFLAGS = 0x8913
SIOCGIFMTU = 0x8921


@dataclass(frozen=True)
class Interface:
    name: str
    address: str                 # IPv4, dotted quad
    prefixlen: int = 32
    up: bool = True
    speed: int | None = None     # Mb/s from /sys/class/net/<if>/speed; None when unknown
    mtu: int | None = None
    loopback: bool = False


# --------------------------------------------------------------------------------------- listing

def list_interfaces(*, all_addresses: bool = False) -> list[Interface]:
    """IPv4 interfaces in kernel order.

    Default: ioctl (SIOCGIFADDR), in-process and cheap, one (primary) address per interface; 256
    ranks on one machine each forking ``ip`` cost more than the whole rendezvous. With
    ``all_addresses`` (or if ioctl fails) parse ``ip -j -4 addr``: one entry per address.
    """
    if not all_addresses:
        try:
            return _from_ioctl()
        except OSError as e:
            log.debug("ioctl interface listing failed (%s); trying `ip -j addr`", e)
    return _from_ip_json(_run_ip())


def _run_ip() -> str:
    out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=5, check=True)
    return out.stdout


def _from_ip_json(text: str) -> list[Interface]:
    result = []
    for link in json.loads(text):
        name = link["ifname"]
        flags = set(link.get("flags", ()))
        for addr in link.get("addr_info", ()):
            if addr.get("family") != "inet":
                continue
            result.append(Interface(
                name=name, address=addr["local"], prefixlen=int(addr.get("prefixlen", 32)),
                up=("UP" in flags) and _sys_operstate(name) not in ("down", "lowerlayerdown", "notpresent"),
                speed=_sys_int(name, "speed"), mtu=link.get("mtu") or _sys_int(name, "mtu"),
                loopback="LOOPBACK" in flags))
    return result


def _from_ioctl() -> list[Interface]:
    result = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for index, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, req)[20:24])
            except OSError:
                continue   # no IPv4 address on this interface
            # Flags and MTU from the kernel for THIS network namespace: /sys may belong to another
            # one (nsenter'd nodes, some containers) and describe a different interface of that name.
            flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[16:18])[0]
            mtu = struct.unpack("i", fcntl.ioctl(s.fileno(), SIOCGIFMTU, req)[16:20])[0]
            own_sys = _sys_int(name, "ifindex") == index
            result.append(Interface(
                name=name, address=addr, prefixlen=ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen,
                up=bool(flags & IFF_UP) and bool(flags & IFF_RUNNING),
                speed=_sys_int(name, "speed") if own_sys else None, mtu=mtu,
                loopback=bool(flags & IFF_LOOPBACK) or name == "lo"))
    return result


@dataclass(frozen=True)
class Link:
    """One interface of this network namespace, whether or not it has an IPv4 address."""
    name: str
    up: bool          # administratively up (IFF_UP)
    carrier: bool     # lower layer up (IFF_RUNNING)
    mtu: int | None

    @property
    def state(self) -> str:
        """``up``, ``no-carrier`` (up but the link below is not) or ``down``."""
        return "up" if self.up and self.carrier else ("no-carrier" if self.up else "down")


def list_links() -> list[Link]:
    """Every interface in kernel order, flags and MTU from the kernel (not /sys: see _from_ioctl)."""
    result = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[16:18])[0]
                mtu = struct.unpack("i", fcntl.ioctl(s.fileno(), SIOCGIFMTU, req)[16:20])[0]
            except OSError:   # vanished between the listing and the ioctl
                continue
            result.append(Link(name, bool(flags & IFF_UP), bool(flags & IFF_RUNNING), mtu))
    return result


def _sys_read(name: str, attr: str) -> str | None:
    try:
        with open(f"/sys/class/net/{name}/{attr}") as f:
            return f.read().strip()
    except OSError:   # virtual links raise EINVAL on speed; missing sysfs in some containers
        return None


def _sys_operstate(name: str) -> str:
    return _sys_read(name, "operstate") or "unknown"


def _sys_int(name: str, attr: str) -> int | None:
    text = _sys_read(name, attr)
    try:
        value = int(text, 0) if text else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None


# --------------------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class InterfaceSpec:
    names: tuple[str, ...]
    exclude: bool = False
    exact: bool = False

    def matches(self, name: str) -> bool:
        return any(self._match_one(p, name) for p in self.names)

    def rank_of(self, name: str) -> int:
        """Position of the first pattern matching ``name`` (for ordering include lists)."""
        return next(i for i, p in enumerate(self.names) if self._match_one(p, name))

    def _match_one(self, pattern: str, name: str) -> bool:
        return name == pattern if self.exact else name.startswith(pattern)


def parse_spec(spec: str | InterfaceSpec | None) -> InterfaceSpec | None:
    """``"^docker,lo"`` / ``"=eth0"`` / ``"ib,eth"`` -> InterfaceSpec; empty or None -> None (auto)."""
    if spec is None or isinstance(spec, InterfaceSpec):
        return spec
    text = spec.strip()
    if not text:
        return None
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise BootstrapError(f"interface spec {spec!r} names no interface",
                             hint="examples: 'ib0', '=eth0', 'ib,eth', '^docker,lo'")
    return InterfaceSpec(names, exclude=exclude, exact=exact)


def auto_reject_reason(iface: Interface) -> str | None:
    """Why the automatic rules drop ``iface`` (None = keep it)."""
    if iface.loopback or iface.name == "lo" or iface.address.startswith("127."):
        return "loopback"
    if iface.name.startswith(AUTO_EXCLUDED_PREFIXES):
        return "container/VM bridge or veth"
    if ipaddress.ip_address(iface.address) in LINK_LOCAL:
        return "link-local 169.254/16"
    if not iface.up:
        return "down"
    return None


def _preference(iface: Interface, index: int) -> tuple:
    # InfiniBand (IPoIB) first: it is the fabric on HPC clusters; then the fastest link.
    return (0 if iface.name.startswith("ib") else 1, -(iface.speed or 0), index)


def select_candidates(interfaces: Sequence[Interface], spec: str | InterfaceSpec | None = None) -> list[Interface]:
    """Candidates in preference order for ``spec`` (see module docstring); never empty.

    An include spec keeps loopback and its own order (so ``=lo`` works on one machine); down
    interfaces are still dropped. BootstrapError names the interfaces that exist when nothing
    matches.
    """
    parsed = parse_spec(spec)
    indexed = list(enumerate(interfaces))
    if parsed is not None and not parsed.exclude:
        picked = [(i, f) for i, f in indexed if parsed.matches(f.name) and f.up]
        picked.sort(key=lambda t: (parsed.rank_of(t[1].name), t[0]))
        if not picked:
            raise BootstrapError(
                f"no usable interface matches {spec!r} on {socket.gethostname()}; "
                f"interfaces here: {_describe(interfaces)}",
                hint="fix the site config's interface or HPCRING_IFNAME, or leave it empty for automatic choice")
        return [f for _, f in picked]
    kept = [(i, f) for i, f in indexed
            if auto_reject_reason(f) is None and not (parsed and parsed.matches(f.name))]
    if not kept:
        loop = [f for f in interfaces if f.up and (f.loopback or f.name == "lo")]
        if loop:
            # Only good for ranks on one machine; verification decides whether that is the case.
            log.warning("no non-loopback interface on %s (%s); trying loopback",
                        socket.gethostname(), _describe(interfaces))
            return loop[:1]
        raise BootstrapError(f"no usable network interface on {socket.gethostname()}: {_describe(interfaces)}",
                             hint="set the interface explicitly (HPCRING_IFNAME or the site config)")
    kept.sort(key=lambda t: _preference(t[1], t[0]))
    return [f for _, f in kept]


def _describe(interfaces: Iterable[Interface]) -> str:
    parts = [f"{f.name} {f.address}/{f.prefixlen}{'' if f.up else ' (down)'}" for f in interfaces]
    return ", ".join(parts) or "none with IPv4"


# --------------------------------------------------------------------------------------- probes

class ProbeListener:
    """Short-lived authenticated listener on one candidate address.

    Contract: binds ``(address, 0)`` at construction (``port`` 0 and ``error`` set when that
    fails); each accepted peer gets a nonce and must answer with the HMAC before anything else is
    read; wrong answers are logged with the peer address and dropped.
    ``on_authenticated(conn)``, if given, is called with each peer's socket after a successful
    challenge (in that peer's thread; the socket is closed when it returns), so other tools can
    reuse the authentication for a short exchange of their own (``hpcring doctor``'s bandwidth sink).
    Test seams for dead links: ``listen=False`` binds but never listens (connects are refused);
    ``listen="blackhole"`` listens with a full accept queue that is never drained, so the kernel
    drops further SYNs and connects time out, like a firewalled or unrouted link.
    """

    def __init__(self, address: str, secret: bytes, *, listen: bool | str = True,
                 io_timeout: float = 2.0, on_authenticated=None) -> None:
        self.address, self._secret, self._io_timeout = address, secret, io_timeout
        self._on_authenticated = on_authenticated
        self.port, self.error = 0, None
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
            self.port = self._sock.getsockname()[1]
            self._fillers: list[socket.socket] = []
            if listen == "blackhole":
                self._sock.listen(0)
                self._fill_queue()
                return
            if listen:
                self._sock.listen(256)
        except OSError as e:
            self.error = f"cannot bind {address}: {e.strerror}"
            return
        self._sock.settimeout(0.2)   # lets the accept loop notice close() quickly
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"hpcring-probe:{address}")
        if listen:
            self._thread.start()

    def _fill_queue(self) -> None:
        for _ in range(3):   # backlog 0 holds one connection; the rest sit in SYN retry
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect((self.address, self.port))
            except BlockingIOError:
                pass
            self._fillers.append(c)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn, peer), daemon=True).start()

    def _answer(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                conn.settimeout(self._io_timeout)
                try:
                    ns, nc, _ = auth.PROBE.accept(conn, self._secret)
                except auth.BadProof:
                    log.warning("interface probe on %s:%d: dropped unauthenticated peer %s:%d",
                                self.address, self.port, peer[0], peer[1])
                    return
                conn.sendall(auth.PROBE.server_proof(self._secret, ns, nc))
                if self._on_authenticated is not None:
                    self._on_authenticated(conn)
            except (OSError, EOFError) as e:
                log.debug("probe from %s failed: %s", peer, e)

    def close(self) -> None:
        self._stop.set()
        for c in getattr(self, "_fillers", ()):
            c.close()
        self._sock.close()


class ProbeFailed(Exception):
    """A probe did not authenticate; ``str()`` is the short reason :func:`probe` returns."""


def probe_connect(address: str, port: int, secret: bytes, timeout: float = 2.0) -> socket.socket:
    """Connect to a :class:`ProbeListener` and run the challenge within ``timeout`` seconds; return
    the authenticated socket (the caller closes it) or raise ProbeFailed with a short reason."""
    if not port:
        raise ProbeFailed("peer has no listener on this address")
    t0 = time.monotonic()
    s = None
    try:
        s = socket.create_connection((address, port), timeout=timeout)
        s.settimeout(max(0.1, timeout - (time.monotonic() - t0)))
        try:
            auth.PROBE.prove(s, secret, auth.PROBE.read_hello(s))
        except auth.BadProof:
            raise ProbeFailed("answered with a bad MAC (another job's rank?)") from None
        return s
    except (OSError, EOFError, ProbeFailed) as e:
        if s is not None:
            s.close()
        if isinstance(e, ProbeFailed):
            raise
        raise ProbeFailed(_probe_reason(e, timeout)) from None


def _probe_reason(e: BaseException, timeout: float) -> str:
    if isinstance(e, (TimeoutError, socket.timeout)):
        return f"timed out after {timeout:.1f}s"
    if isinstance(e, EOFError):
        return "peer closed the connection (secret mismatch?)"
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"


def probe(address: str, port: int, secret: bytes, timeout: float = 2.0) -> str | None:
    """Connect and run the challenge; None on success, else a short reason (never raises)."""
    try:
        probe_connect(address, port, secret, timeout).close()
        return None
    except ProbeFailed as e:
        return str(e)




# --------------------------------------------------------------------------------------- verify

@dataclass(frozen=True)
class Endpoint:
    """One rank's chosen interface."""
    rank: int
    host: str
    interface: str
    address: str


def verify_interfaces(client, *, rank: int, size: int, host: str, candidates: Sequence[Interface],
                      secret: bytes, mode: str = "ring", timeout: float = 30.0,
                      connect_timeout: float = 2.0, prefix: str = "netif",
                      _dead: Collection[str] = ()) -> list[Endpoint]:
    """Agree, through the store ``client``, on one verified interface per rank; every rank returns
    the same table (index = rank).

    ``mode``: ``"ring"`` (each rank probes rank+1), ``"all"`` (every pair) or ``"none"`` (first
    candidate, no connections). Raises BootstrapError naming the unreachable rank's host, its
    interfaces and addresses tried, the errors, and the interfaces that did connect; with dead
    links this returns after about ``connect_timeout`` plus store round trips.
    ``_dead``: candidate names whose listener is a blackhole (connects time out; tests only).
    """
    if mode not in ("ring", "all", "none"):
        raise BootstrapError(f"interface verification mode must be ring, all or none, not {mode!r}")
    if not candidates:
        raise BootstrapError(f"rank {rank} on {host} has no interface candidates")
    deadline = time.monotonic() + timeout
    listeners = [ProbeListener(c.address, secret, listen="blackhole" if c.name in _dead else True)
                 for c in candidates] \
        if mode != "none" and size > 1 else []
    try:
        mine = {"host": host, "cands": [
            {"name": c.name, "address": c.address,
             "port": listeners[i].port if listeners else 0,
             "error": listeners[i].error if listeners else None}
            for i, c in enumerate(candidates)]}
        client.set(f"{prefix}/cand/{rank}", _dumps(mine))
        results = _probe_peers(client, rank, size, mode, secret, connect_timeout, deadline, prefix)
        client.set(f"{prefix}/res/{rank}", _dumps(results))
        if rank == 0:
            client.set(f"{prefix}/choice", _dumps(_decide(client, size, mode, deadline, prefix)))
        choice = _loads(client.get(f"{prefix}/choice", timeout=_left(deadline)))
    finally:
        for lst in listeners:
            lst.close()
    if not choice["ok"]:
        raise BootstrapError(choice["error"], hint=choice["hint"])
    return [Endpoint(*row) for row in choice["table"]]


def _peers(rank: int, size: int, mode: str) -> list[int]:
    if size == 1 or mode == "none":
        return []
    if mode == "ring":
        return [(rank + 1) % size]
    return [r for r in range(size) if r != rank]


def _probe_peers(client, rank, size, mode, secret, connect_timeout, deadline, prefix) -> dict[str, list]:
    """``{peer rank: [error or None per candidate of that peer]}``; all probes run in parallel."""
    peers = _peers(rank, size, mode)
    cands = {p: _loads(client.get(f"{prefix}/cand/{p}", timeout=_left(deadline)))["cands"] for p in peers}
    jobs = [(p, i, c) for p in peers for i, c in enumerate(cands[p])]
    if not jobs:
        return {}
    from concurrent.futures import ThreadPoolExecutor   # only ranks that probe pay for the import
    with ThreadPoolExecutor(max_workers=min(32, len(jobs))) as pool:
        errors = list(pool.map(lambda j: probe(j[2]["address"], j[2]["port"], secret, connect_timeout), jobs))
    out: dict[str, list] = {str(p): [None] * len(cands[p]) for p in peers}
    for (p, i, _), err in zip(jobs, errors):
        out[str(p)][i] = err
    return out


def _decide(client, size: int, mode: str, deadline: float, prefix: str) -> dict:
    """Rank 0: gather every rank's candidates and probe results and choose per rank."""
    cands = [_loads(client.get(f"{prefix}/cand/{r}", timeout=_left(deadline))) for r in range(size)]
    tested: dict[int, list[tuple[int, list]]] = {r: [] for r in range(size)}   # target -> [(tester, errors)]
    for r in range(size):
        for peer, errs in _loads(client.get(f"{prefix}/res/{r}", timeout=_left(deadline))).items():
            tested[int(peer)].append((r, errs))
    table, failures = [], []
    for r in range(size):
        ok = [i for i in range(len(cands[r]["cands"])) if all(errs[i] is None for _, errs in tested[r])]
        if not ok:
            failures.append(r)
            continue
        c = cands[r]["cands"][ok[0]]
        table.append([r, cands[r]["host"], c["name"], c["address"]])
    if failures:
        return {"ok": False, **_failure_report(failures, cands, tested)}
    log.info("hpcring interfaces: %s", _summarise(table))
    return {"ok": True, "table": table}


def _failure_report(failures: list[int], cands: list[dict], tested: dict) -> dict:
    lines = []
    for r in failures[:8]:
        host = cands[r]["host"]
        for tester, errs in tested[r]:
            tried = "; ".join(f"{c['name']} {c['address']}:{c['port']} -> {errs[i]}"
                              for i, c in enumerate(cands[r]["cands"]) if errs[i])
            lines.append(f"rank {r} on {host} unreachable from rank {tester} on {cands[tester]['host']}: {tried}")
    worked = sorted({f"{cands[r]['host']} {c['name']} {c['address']}"
                     for r in tested for _, errs in tested[r]
                     for i, c in enumerate(cands[r]["cands"]) if errs[i] is None})
    more = f" (and {len(failures) - 8} more ranks)" if len(failures) > 8 else ""
    return {"error": "interface verification failed: " + " | ".join(lines) + more
                     + f". Interfaces that did connect: {', '.join(worked) or 'none'}",
            "hint": "choose an interface that links every node (site config interface / HPCRING_IFNAME, "
                    "e.g. '=ib0' or 'ib,eth'); check that it is up and not firewalled between these hosts"}


def _summarise(table: list[list]) -> str:
    """``0-3->host lo 127.0.0.1, 4->...``: runs of ranks with the same host/interface/address."""
    return ", ".join(f"{a if a == b else f'{a}-{b}'}->{' '.join(map(str, v))}"
                     for a, b, v in runs([tuple(row[1:]) for row in table]))


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _loads(data: bytes):
    return json.loads(data.decode())
