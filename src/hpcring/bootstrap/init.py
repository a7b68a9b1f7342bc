"""``init_bootstrap()``: from launcher environment to a complete, verified Topology and a store.

How rank 0's address and port are found (the chicken-and-egg of rendezvous):

1. Every rank derives the same store port from the job id: ``lo + sha256(job_id) % (hi - lo + 1)``
   inside ``port_range`` (HPCRING_STORE_PORT overrides). Rank 0 binds the store on 0.0.0.0 at
   that port, or the next one up (at most 8 tries) when it is taken.
2. The other ranks connect to a *bootstrap* address: HPCRING_MASTER_ADDR, MASTER_ADDR, the
   launcher's master address, or the first node's host name resolved to IPv4. Any address of rank
   0's node works because the store listens on every interface. A port whose peer fails the
   handshake (another job's store, another service) is skipped; the authenticated handshake is
   what proves the right store was found.
3. All ranks publish their host names (rank 0 gathers them into one key), then verify interfaces
   (:mod:`hpcring.bootstrap.netif`). Rank 0 then publishes, under ``init/master``, its address on
   the *chosen* interface (the real MASTER_ADDR, not what its host name resolves to), the store port
   and a framework port (store port + 1 or higher, checked bindable on rank 0) for
   ``torch.distributed``'s own store.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import random
import socket
import time
from collections.abc import Mapping

from hpcring.bootstrap import launchers, netif
from hpcring.bootstrap.hostlist import compress, expand
from hpcring.bootstrap.auth import load_secret
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.bootstrap.store_wire import StoreAuthError, StoreTimeoutError
from hpcring.bootstrap.store_server import CONNECTIONS_PER_RANK, StoreServerProcess
from hpcring.bootstrap.topology import Topology
from hpcring.config import envvars
from hpcring.errors import BootstrapError, HostlistError
from hpcring.netio import time_left
from hpcring.ranks import each_on_host, runs

log = logging.getLogger("hpcring.bootstrap.init")

PORT_TRIES = 8
STRICT_PORT_ORDER_S = 3.0   # before this, stop a connect round at the first refused port
OWN_PROCESS_MIN_RANKS = 256  # from this job size on, rank 0 serves the store from a child process
PMIX_INIT_TIMEOUT_S = 10.0  # PMIx_Init talks to the local server only; longer means it is not answering
RETRY_RANKS = 256           # retry pace: each rank's cap on the wait between refused connects grows
RETRY_CAP_S = (0.2, 1.0)    # from the first value to the second with the job size over RETRY_RANKS
GATHER_MARGIN_S = 2.0       # rank 0 gives up this much before the others, to tell them who is missing
last_timings: dict[str, float] = {}   # seconds since init_bootstrap started, for benchmarks


def derive_port(job_id: str | None, port_range: tuple[int, int] = (29500, 29999)) -> int:
    """Store port for ``job_id``: the same on every rank, spread over ``port_range`` (inclusive)."""
    lo, hi = port_range
    if not (0 < lo <= hi < 65536):
        raise BootstrapError(f"bad port range {port_range!r}; expected (low, high) within 1..65535")
    digest = hashlib.sha256((job_id or "no-job-id").encode()).digest()
    return lo + int.from_bytes(digest[:8], "big") % (hi - lo + 1)


def candidate_ports(base: int, port_range: tuple[int, int], tries: int = PORT_TRIES) -> list[int]:
    """``base`` and the ports after it, wrapping inside the range."""
    lo, hi = port_range
    span = hi - lo + 1
    return [lo + (base - lo + i) % span for i in range(min(tries, span))]


def init_bootstrap(*, timeout: float = 60.0, interface: str | None = None,
                   environ: Mapping[str, str] | None = None,
                   port_range: tuple[int, int] = (29500, 29999), verify: str = "ring",
                   topology: Topology | None = None) -> tuple[Topology, StoreClient]:
    """Meet every rank of the job and return ``(completed Topology, connected StoreClient)``.

    Contract: all ranks call this with the same arguments; it returns within ``timeout`` seconds
    or raises BootstrapError naming the store address, the key waited for and what to check.
    The returned Topology has ``hosts`` (gathered from every rank), ``interface`` and ``address``
    (this rank's verified interface), ``master_addr`` (rank 0's address on its verified interface)
    and ``master_port`` (a port for frameworks, distinct from the store's ``client.port``).
    On rank 0 the store server lives as ``client.server`` until the process exits.
    ``topology`` skips launcher detection (tests, custom launchers).
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_timings.clear()
    env = os.environ if environ is None else environ
    topo = topology if topology is not None else _detect(env)
    secret = load_secret(env)
    spec = _interface_spec(interface, env, topo)
    candidates = netif.select_candidates(netif.list_interfaces(), spec)
    ports = _store_ports(topo, env, port_range)

    pmx = _pmix_client(topo, env, secret, deadline)
    last_timings["rendezvous_chosen"] = time.monotonic() - t0   # PMIx_Init's cost, when it ran
    if pmx is None:
        client = _open_store(topo, env, ports, secret, deadline)
        client.timeout = max(1.0, deadline - time.monotonic())
        last_timings["connected"] = time.monotonic() - t0
        hosts = _gather_hosts(client, topo, deadline)
    else:   # hosts and the store's address through one PMIx fence: no port search, no master address
        client, hosts = _meet_through_pmix(pmx, topo, ports, secret, candidates, deadline)
        last_timings["connected"] = time.monotonic() - t0
    last_timings["met"] = time.monotonic() - t0

    try:
        mine = netif.verify_interfaces(
            client, rank=topo.rank, size=topo.size, host=hosts[topo.rank], candidates=candidates,
            secret=secret, mode=verify, timeout=time_left(deadline), prefix="init/netif").mine
    except BootstrapError as exc:
        if spec is None or "verification failed" not in exc.message:
            raise
        raise _with_alternatives(exc, client, topo, hosts, secret, verify, deadline) from None
    master = _agree_master(client, topo.rank, mine, deadline)
    last_timings["verified"] = time.monotonic() - t0

    done = _complete(topo, hosts, "pmix:hpcring.card" if pmx else "store:init/hosts").with_(
        interface=mine.interface, address=mine.address,
        master_addr=master["addr"], master_port=master["framework_port"])
    done = done.with_(sources={**done.sources, "rendezvous": f"pmix {pmx.namespace}" if pmx else "store",
                               "master_addr": "store:init/master (rank 0's verified interface)",
                               "master_port": "store:init/master (free port above the store's)",
                               "interface": f"verified ({verify})", "address": "verified"})
    return done, client


# ----------------------------------------------------------------------------------- steps

def _pmix_client(topo: Topology, env: Mapping[str, str], secret: bytes, deadline: float):
    """A PMIx client when HPCRING_RENDEZVOUS (auto|store|pmix) and the launcher allow one, else None
    (the store); ``pmix`` refuses to fall back, ``auto`` logs why it did."""
    mode = envvars.get("HPCRING_RENDEZVOUS", env)
    if mode == "store":
        return None
    from hpcring.bootstrap import pmix
    reason, level = None, logging.INFO
    if not pmix.present(env):
        reason = "no PMIx server in this process's environment (PMIX_NAMESPACE, PMIX_RANK, PMIX_SERVER_URI*)"
    elif topo.launcher in ("torchrun", "local") or env.get("PMIX_RANK") != str(topo.rank):
        # an inner launcher (torchrun under srun --mpi=pmix) forks ranks that share one PMIx identity
        reason = f"ranks come from {topo.launcher} (rank {topo.rank}), not from the PMIx launcher (PMIX_RANK={env.get('PMIX_RANK')})"
    elif mode == "auto" and topo.size < envvars.get("HPCRING_PMIX_MIN_RANKS", env):
        # PMIx_Init costs each node's PMIx server a registration per rank: up to 48 ranks measured,
        # the store met 2-3x sooner (docs/bootstrap.md); PMIx pays off where one store's fan-in does not
        reason = (f"{topo.size} ranks: auto meets through PMIx from HPCRING_PMIX_MIN_RANKS="
                  f"{envvars.get('HPCRING_PMIX_MIN_RANKS', env)} ranks on")
    else:
        try:
            c = pmix.PmixClient(secret, timeout=min(PMIX_INIT_TIMEOUT_S, max(0.1, time_left(deadline))),
                                library=envvars.get("HPCRING_PMIX_LIBRARY", env))
            if (c.rank, c.size) == (topo.rank, topo.size):
                log.info("rendezvous through PMIx (%s, namespace %s)", c.version.split(" (")[0], c.namespace)
                atexit.register(c.finalize)
                return c
            c.finalize()
            reason = f"PMIx says rank {c.rank} of {c.size}, the launcher rank {topo.rank} of {topo.size}"
        except BootstrapError as e:
            reason, level = e.message, logging.WARNING
    if mode == "pmix":
        raise BootstrapError(f"HPCRING_RENDEZVOUS=pmix, but PMIx cannot be used: {reason}",
                             hint="start the ranks with srun --mpi=pmix or jsrun, or set HPCRING_RENDEZVOUS=auto")
    log.log(level, "rendezvous through the store: %s", reason)
    return None


def _meet_through_pmix(pmx, topo: Topology, ports: list[int], secret: bytes, candidates,
                       deadline: float) -> tuple[StoreClient, list[str]]:
    """Rank 0 starts the store, then every rank publishes its host (rank 0 also the store's port and
    its addresses) and one fence hands everyone all of it; the others connect straight to the store.
    The store still serves interface verification, init/master, the ring's addresses, the watchdog."""
    known = len(topo.hosts) == topo.size and topo.hosts[topo.rank] not in ("", "?")
    card = {"host": topo.hosts[topo.rank] if known else socket.gethostname()}
    client = None
    if topo.rank == 0:
        server = _start_server(ports, secret, ranks=topo.size)
        card["store"] = {"port": server.port, "addrs": list(dict.fromkeys(
            [c.address for c in candidates] + [card["host"]]))}
        client = StoreClient("127.0.0.1", server.port, secret, timeout=max(1.0, time_left(deadline)))
        client.server = server
    cards = [json.loads(v) for v in pmx.exchange({"card": json.dumps(card).encode()}, "card",
                                                 timeout=time_left(deadline))]
    hosts = [str(c["host"]) for c in cards]
    if client is None:
        store = cards[0].get("store") or {}
        client = _connect_store_at(store.get("addrs", []), int(store.get("port", 0)), secret, deadline)
    client.timeout = max(1.0, time_left(deadline))
    return client, hosts


def _connect_store_at(addrs: list[str], port: int, secret: bytes, deadline: float) -> StoreClient:
    """Rank 0's store at one of the addresses it published; the handshake proves it is ours."""
    seen: dict[str, str] = {}
    while True:
        for addr in addrs:
            try:
                return StoreClient(addr, port, secret, timeout=min(2.0, max(0.1, time_left(deadline))),
                                   connect_retry=False)
            except BootstrapError as e:   # StoreAuthError included: someone else answers there
                seen[addr] = e.message
        if time_left(deadline) <= 0 or not addrs:
            raise BootstrapError(
                f"could not reach rank 0's rendezvous store at port {port} on any address it published "
                f"through PMIx: " + ("; ".join(f"{a}: {m}" for a, m in seen.items()) or "none published"),
                hint="rank 0's addresses must be reachable from every node; HPCRING_IFNAME picks the interfaces")
        time.sleep(min(0.2, max(0.0, time_left(deadline))))


def _detect(env: Mapping[str, str]) -> Topology:
    return launchers.detect(env)


def _complete(topo: Topology, hosts: list[str], source: str = "store:init/hosts") -> Topology:
    """Fill node fields (and unknown local ranks) from the gathered hosts."""
    return launchers.complete(topo, hosts, source=source)


def _interface_spec(interface: str | None, env: Mapping[str, str], topo: Topology) -> str | None:
    """Explicit argument, then HPCRING_IFNAME; the local backend uses loopback (one machine)."""
    if interface:
        return interface
    if env.get("HPCRING_IFNAME"):
        return env["HPCRING_IFNAME"]
    return "=lo" if topo.launcher == "local" else None


def _store_ports(topo: Topology, env: Mapping[str, str], port_range: tuple[int, int]) -> list[int]:
    port = envvars.get("HPCRING_STORE_PORT", env)
    if port is not None:
        return [port]
    # Fold the world size in so two steps of one job with different sizes do not share a port, and
    # the array task: LSF's elements share one job id (and the array's secret) and may run at once
    # on the same hosts, where a rank would find another task's store.
    # The scheduler's step too: a restart inside the allocation (hpcring.steps) starts while the
    # failed step's last ranks (and its store) may still be dying on the same nodes.
    task = env.get("HPCRING_ARRAY_TASK")
    step = env.get("SLURM_STEP_ID", "") if topo.launcher == "slurm" else ""
    step = step if step.isdigit() else None
    key = f"{topo.job_id}/{topo.size}" + (f"/task{task}" if task else "") + (f"/step{step}" if step else "")
    return candidate_ports(derive_port(key, port_range), port_range)


def _open_store(topo: Topology, env, ports: list[int], secret: bytes, deadline: float) -> StoreClient:
    if topo.rank == 0:
        server = _start_server(ports, secret, ranks=topo.size)
        client = StoreClient("127.0.0.1", server.port, secret, timeout=max(1.0, time_left(deadline)))
        client.server = server
        return client
    return _connect_any(bootstrap_master_addr(topo, env), ports, secret, deadline,
                        who=each_on_host([0], topo.hosts), ranks=topo.size)


def _start_server(ports: list[int], secret: bytes, ranks: int | None = None) -> StoreServer | StoreServerProcess:
    """The store; for jobs of OWN_PROCESS_MIN_RANKS ranks or more in a process of its own (rank 0's
    threads cannot slow it; it costs a Python start-up, ~0.1-0.4 s, that small jobs do not pay)."""
    errors = []
    clients = ranks * CONNECTIONS_PER_RANK if ranks else None   # sizes RLIMIT_NOFILE and the backlog
    own_process = (ranks or 0) >= OWN_PROCESS_MIN_RANKS
    for port in ports:
        try:
            if own_process:
                try:
                    return StoreServerProcess("0.0.0.0", port, secret=secret, clients=clients, ranks=ranks)
                except BootstrapError as e:
                    if "did not start" not in e.message:
                        raise
                    log.warning("%s; serving the store from rank 0's own process instead", e.message)
                    own_process = False
            return StoreServer("0.0.0.0", port, secret=secret, clients=clients, ranks=ranks)
        except OSError as e:
            errors.append(f"{port}: {e.strerror}")
    raise BootstrapError(f"rank 0 could not bind the rendezvous store on any of ports {ports}: {errors}",
                         hint="set HPCRING_STORE_PORT to a free port, or pass another port_range")


def bootstrap_master_addr(topo: Topology, env: Mapping[str, str]) -> str:
    """Where non-zero ranks first look for the store (any address of rank 0's node will do)."""
    for var in ("HPCRING_MASTER_ADDR", "MASTER_ADDR"):
        if env.get(var):
            return env[var]
    if topo.master_addr:
        return topo.master_addr
    first = topo.hosts[0] if topo.hosts else None
    if (not first or first == "?") and env.get("SLURM_JOB_NODELIST"):
        # mpirun/Hydra inside a Slurm allocation: they map rank 0 onto the allocation's first node
        first = expand(env["SLURM_JOB_NODELIST"])[0]
    if not first or first == "?":   # launchers.UNKNOWN_HOST: this launcher does not list other hosts
        raise BootstrapError("cannot tell where rank 0 runs: no HPCRING_MASTER_ADDR/MASTER_ADDR and no host list",
                             hint="export HPCRING_MASTER_ADDR=<rank 0's node> before starting the ranks")
    try:
        infos = socket.getaddrinfo(first, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise BootstrapError(f"cannot resolve rank 0's host {first!r} to an IPv4 address: {e}",
                             hint="export HPCRING_MASTER_ADDR=<an address of rank 0's node>") from e
    return infos[0][4][0]


def _connect_any(host: str, ports: list[int], secret: bytes, deadline: float, who: str = "rank 0",
                 ranks: int = 1) -> StoreClient:
    """First port whose peer authenticates as our store; refused ports are retried with backoff.
    ``who`` names rank 0 (and its host) in the error. The backoff's cap grows with the job size
    (``ranks``) and each wait is jittered: 4096 ranks retrying every 0.2 s in step are 20 000 refused
    connects a second while rank 0 starts its store (on 2 simulated cores, more CPU than there is)."""
    cap = min(RETRY_CAP_S[1], RETRY_CAP_S[0] * max(1.0, ranks / RETRY_RANKS))
    start, delay, seen = time.monotonic(), 0.05, {}
    while True:
        for port in ports:
            try:
                return StoreClient(host, port, secret, timeout=min(2.0, max(0.1, time_left(deadline))),
                                   connect_retry=False)
            except StoreAuthError as e:
                seen[port] = f"not our store ({e.message})"   # another job's store: try the next port
            except BootstrapError as e:
                seen[port] = e.message
                if time.monotonic() - start < STRICT_PORT_ORDER_S:
                    break   # nobody there yet: rank 0 is probably still starting on this port
        if time_left(deadline) <= 0:
            raise BootstrapError(
                f"could not reach the rendezvous store of {who} at {host} on ports {ports}: "
                + "; ".join(f"{p}: {m}" for p, m in seen.items()),
                hint="check that rank 0 started, that HPCRING_MASTER_ADDR/MASTER_ADDR or the first host "
                     "name resolves to rank 0's node, and that these ports are not firewalled")
        time.sleep(min(delay * random.uniform(0.5, 1.0), time_left(deadline)))
        delay = min(delay * 2, cap)   # refused connects are cheap; rank 0 may appear any moment


def _gather_hosts(client: StoreClient, topo: Topology, deadline: float) -> list[str]:
    """Every rank's host name, in rank order; doubles as the 'all ranks met' point.

    When some ranks never arrive, every rank that did raises the same BootstrapError naming the
    missing ranks and their hosts (rank 0 publishes it under ``init/hosts`` just before the deadline).
    """
    known = len(topo.hosts) == topo.size and topo.hosts[topo.rank] not in ("", "?")
    mine = topo.hosts[topo.rank] if known else socket.gethostname()
    try:
        if topo.rank == 0:
            client.set(_host_key(0), mine.encode())
            _publish_hosts(client, topo, deadline)
            hosts = decode_hosts(client.get("init/hosts", timeout=time_left(deadline)), topo.size)
        else:   # publish mine and read everyone's: one round trip
            hosts = decode_hosts(client.exchange({_host_key(topo.rank): mine.encode()}, ["init/hosts"],
                                                 timeout=time_left(deadline))[0], topo.size)
    except StoreTimeoutError as e:   # rank 0 published nothing: it is hung, or started very late
        try:
            values = client.multi_check([_host_key(r) for r in range(topo.size)])
            missing = [r for r, v in enumerate(values) if v is None]
        except BootstrapError:   # the store went away meanwhile: the timeout says enough
            raise e from None
        raise (_missing_ranks_error(topo, missing, e) if missing else e) from None
    if isinstance(hosts, dict):   # rank 0 gave up waiting; its message names the missing ranks
        raise BootstrapError(hosts["error"], hint=hosts["hint"])
    if len(hosts) != topo.size:
        raise BootstrapError(f"rank 0 published {len(hosts)} hosts for world size {topo.size}",
                             hint="all ranks must agree on the world size (launcher environment)")
    return hosts


def _host_key(rank: int) -> str:
    return f"init/host/{rank}"


def _publish_hosts(client: StoreClient, topo: Topology, deadline: float) -> None:
    """Rank 0: gather every rank's host into ``init/hosts`` (one gatherer keeps this O(size)
    requests); when ranks are missing, publish the error there instead and raise it."""
    # Stop a little before the others' deadline so they read the reason instead of timing out blind.
    margin = min(GATHER_MARGIN_S, 0.1 * time_left(deadline))
    try:
        values = client.gather([_host_key(r) for r in range(topo.size)], timeout=max(0.0, time_left(deadline) - margin))
    except StoreTimeoutError as e:
        missing = sorted(int(k.rsplit("/", 1)[1]) for k in e.missing)
        err = _missing_ranks_error(topo, missing, e)
        client.set("init/hosts", json.dumps({"error": err.message, "hint": err.hint}).encode())
        raise err from None
    client.set("init/hosts", encode_hosts([v.decode() for v in values]))


def encode_hosts(hosts: list[str]) -> bytes:
    """``init/hosts`` as every rank reads it: runs of ranks on one host, grouped by ranks per host,
    each group's hosts as a hostlist: ``{"runs": [["node[1-512]", 8]]}`` for 4096 ranks on 512
    hosts (29 bytes; the plain list is 45 KiB, and N ranks reading it is N x that through the
    store). Names no hostlist can denote keep the plain list (``decode_hosts`` reads both)."""
    groups: list[list] = []                     # [[hosts...], ranks per host]
    for first, last, host in runs(hosts):
        if groups and groups[-1][1] == last - first + 1:
            groups[-1][0].append(host)
        else:
            groups.append([[host], last - first + 1])
    try:
        return json.dumps({"runs": [[compress(hs), k] for hs, k in groups]}).encode()
    except HostlistError:
        return json.dumps(hosts).encode()


def decode_hosts(value: bytes, size: int) -> list[str] | dict:
    """What :func:`encode_hosts` wrote (a list of ``size`` host names), or rank 0's error dict."""
    d = json.loads(value)
    if not (isinstance(d, dict) and "runs" in d):
        return d
    hosts: list[str] = []
    for expr, k in d["runs"]:
        for h in expand(expr, max_hosts=size):
            hosts += [h] * int(k)
    return hosts


def _missing_ranks_error(topo: Topology, missing: list[int], exc: BootstrapError) -> BootstrapError:
    """The rendezvous error that names the ranks that never reached it, with their hosts when the
    launcher lists them (Slurm: SLURM_JOB_NODELIST + tasks per node)."""
    return BootstrapError(
        f"rendezvous incomplete: {len(missing)} of {topo.size} ranks never reached hpcring.init(): "
        f"{each_on_host(missing, topo.hosts)} (job {topo.job_id or '?'}; {exc.message})",
        hint="those ranks did not start or are stuck before hpcring.init() (imports, module loads, a hung "
             "shared file system): check the scheduler (e.g. `sacct -j JOB -o JobID,State,NodeList`) and "
             "their stderr logs; HPCRING_INIT_TIMEOUT sets how long ranks wait")


def _with_alternatives(exc: BootstrapError, client, topo: Topology, hosts: list[str], secret: bytes,
                       verify: str, deadline: float) -> BootstrapError:
    """The configured interface failed: probe the automatic candidates (all ranks do) and say which work."""
    try:
        auto = netif.select_candidates(netif.list_interfaces(), None)
        works = netif.verify_interfaces(
            client, rank=topo.rank, size=topo.size, host=hosts[topo.rank], candidates=auto, secret=secret,
            mode=verify, timeout=min(8.0, time_left(deadline)), prefix="init/netif-alt").summary
        alt = f" Interfaces that do connect every rank (automatic choice, ranks->host interface address): {works}."
    except BootstrapError as alt_exc:
        alt = f" No automatic choice connects every rank either ({alt_exc.message[:200]})."
    return BootstrapError(exc.message.rstrip(".") + "." + alt, hint=exc.hint)


def _agree_master(client: StoreClient, rank: int, mine: netif.Endpoint, deadline: float) -> dict:
    if rank == 0:
        store_port = client.server.port if client.server else client.port
        record = {"addr": mine.address, "store_port": store_port,
                  "framework_port": _free_port_after(store_port)}
        client.set("init/master", json.dumps(record).encode())
        client.set("MASTER_ADDR", record["addr"].encode())
    return json.loads(client.get("init/master", timeout=time_left(deadline)))


def _free_port_after(port: int, tries: int = 64) -> int:
    """First port above ``port`` that rank 0 can bind now (torch binds it later: small race, documented)."""
    for candidate in range(port + 1, min(port + 1 + tries, 65536)):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", candidate))
                return candidate
            except OSError:
                continue
    raise BootstrapError(f"no free port in {port + 1}..{port + tries} on rank 0 for MASTER_PORT",
                         hint="pass another port_range to init_bootstrap")


# ----------------------------------------------------------------------------------- frameworks

def framework_env(topo: Topology, gpus_per_node: int = 0) -> dict[str, str]:
    """Environment for torch.distributed (env://), NCCL and Gloo from a completed Topology.

    NCCL_SOCKET_IFNAME uses the exact form ``=<iface>``; GLOO_SOCKET_IFNAME gets the bare name
    because Gloo compares names literally (it has no ``=`` syntax). CUDA_VISIBLE_DEVICES is set to
    the local rank (modulo ``gpus_per_node``) only when the job has GPUs and it is not set already.
    """
    if topo.master_addr is None or topo.master_port is None:
        raise BootstrapError(f"rank {topo.rank}: Topology has no master address/port yet",
                             hint="call init_bootstrap() first and pass the Topology it returns")
    env = {
        "MASTER_ADDR": topo.master_addr, "MASTER_PORT": str(topo.master_port),
        "RANK": str(topo.rank), "WORLD_SIZE": str(topo.size),
        "LOCAL_RANK": str(topo.local_rank), "LOCAL_WORLD_SIZE": str(topo.local_size),
        "NODE_RANK": str(topo.node_rank),
    }
    if topo.interface:
        env["NCCL_SOCKET_IFNAME"] = f"={topo.interface}"
        env["GLOO_SOCKET_IFNAME"] = topo.interface
    if gpus_per_node > 0 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = str(topo.local_rank % gpus_per_node)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(topo.local_size))
    return env


def threads_per_rank(local_size: int, environ=None, affinity: set[int] | None = None,
                     cpu_count: int | None = None) -> int:
    """CPU threads one rank should use, so that the ranks of a node do not oversubscribe it:
    ``SLURM_CPUS_PER_TASK`` when Slurm set it; else the CPUs this process may run on, divided by
    the ranks of the node when that set is the whole machine (nobody pinned the ranks: they share
    it), taken whole when a launcher pinned the rank to its own CPUs. At least 1."""
    env = os.environ if environ is None else environ
    per_task = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if per_task.isdigit() and int(per_task) > 0:
        return int(per_task)
    cpus = affinity if affinity is not None else (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                                  else set(range(os.cpu_count() or 1)))
    total = cpu_count if cpu_count is not None else (os.cpu_count() or len(cpus))
    n = len(cpus)
    if n >= total:
        n //= max(1, local_size)
    return max(1, n)


def apply_framework_env(topo: Topology, gpus_per_node: int = 0) -> dict[str, str]:
    """Export :func:`framework_env` into ``os.environ``; returns what was set."""
    env = framework_env(topo, gpus_per_node)
    os.environ.update(env)
    return env
