"""Rank 0's rendezvous store and how the other ranks find it: the port every rank derives from the
job, the store rank 0 starts there (in a process of its own for large jobs), the bootstrap address
and the connect loop whose handshake proves the right store was found (steps 1-2 of
:mod:`hpcring.bootstrap.init`)."""
from __future__ import annotations

import hashlib
import logging
import random
import socket
import time
from collections.abc import Mapping

from hpcring.hostlist import expand
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import CONNECTIONS_PER_RANK, StoreServer, StoreServerProcess
from hpcring.bootstrap.store_wire import StoreAuthError
from hpcring.bootstrap.topology import Topology
from hpcring.config import envvars
from hpcring.errors import BootstrapError
from hpcring.netio import time_left
from hpcring.ranks import each_on_host

log = logging.getLogger("hpcring.bootstrap.init")

PORT_TRIES = 8
STRICT_PORT_ORDER_S = 3.0   # before this, stop a connect round at the first refused port
OWN_PROCESS_MIN_RANKS = 256  # from this job size on, rank 0 serves the store from a child process
RETRY_RANKS = 256           # retry pace: each rank's cap on the wait between refused connects grows
RETRY_CAP_S = (0.2, 1.0)    # from the first value to the second with the job size over RETRY_RANKS
WORLD_KEY = "init/world"    # rank 0's store holds store_world() here from its start


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


def store_world(topo: Topology, env: Mapping[str, str]) -> str:
    """What names this rank's world: the job, its size, the array task and the scheduler's step.
    Every rank of the world derives the same string; rank 0's store holds it under WORLD_KEY."""
    # The world size: two steps of one job with different sizes must not meet. The array task:
    # LSF's elements share one job id (and the array's secret) and may run at once on the same
    # hosts. The scheduler's step: a restart inside the allocation (hpcring.steps) starts while the
    # failed step's last ranks (and its store) may still be dying on the same nodes.
    task = env.get("HPCRING_ARRAY_TASK")
    # (Slurm numbers its steps; on LSF the step loop numbers its blaunch steps: HPCRING_LSF_STEP)
    step = env.get("SLURM_STEP_ID", "") if topo.launcher == "slurm" else env.get("HPCRING_LSF_STEP", "")
    step = step if step.isdigit() else None
    return f"{topo.job_id}/{topo.size}" + (f"/task{task}" if task else "") + (f"/step{step}" if step else "")


def _store_ports(topo: Topology, env: Mapping[str, str], port_range: tuple[int, int]) -> list[int]:
    port = envvars.get("HPCRING_STORE_PORT", env)
    if port is not None:
        return [port]
    world = store_world(topo, env)
    # A step's ports follow the previous step's (PORT_TRIES apart) instead of being hashed anew: two
    # hashed steps of one job landed on the same base (job 2425's steps 0 and 1 both on 29515), and
    # the restarted step's ranks met the failed step's store. The world key check in _connect_any
    # is what guarantees a rank never joins another world; this only keeps them off each other's ports.
    base, _, step = world.rpartition("/step")
    if not base or not step.isdigit():
        return candidate_ports(derive_port(world, port_range), port_range)
    lo, hi = port_range
    first = derive_port(base, port_range)
    return candidate_ports(lo + (first - lo + int(step) * PORT_TRIES) % (hi - lo + 1), port_range)


def _open_store(topo: Topology, env, ports: list[int], secret: bytes, deadline: float,
                world: str | None = None) -> StoreClient:
    if topo.rank == 0:
        server = _start_server(ports, secret, ranks=topo.size, world=world)
        client = StoreClient("127.0.0.1", server.port, secret, timeout=max(1.0, time_left(deadline)))
        client.server = server
        return client
    return _connect_any(bootstrap_master_addr(topo, env), ports, secret, deadline,
                        who=each_on_host([0], topo.hosts), ranks=topo.size, world=world)


def _start_server(ports: list[int], secret: bytes, ranks: int | None = None,
                  world: str | None = None) -> StoreServer | StoreServerProcess:
    """The store; for jobs of OWN_PROCESS_MIN_RANKS ranks or more in a process of its own (rank 0's
    threads cannot slow it; it costs a Python start-up, ~0.1-0.4 s, that small jobs do not pay).
    ``world`` (:func:`store_world`) is in it under WORLD_KEY before the first rank connects."""
    errors = []
    initial = {WORLD_KEY: world.encode()} if world else None
    clients = ranks * CONNECTIONS_PER_RANK if ranks else None   # sizes RLIMIT_NOFILE and the backlog
    own_process = (ranks or 0) >= OWN_PROCESS_MIN_RANKS
    for port in ports:
        try:
            if own_process:
                try:
                    return StoreServerProcess("0.0.0.0", port, secret=secret, clients=clients, ranks=ranks,
                                              initial=initial)
                except BootstrapError as e:
                    if "did not start" not in e.message:
                        raise
                    log.warning("%s; serving the store from rank 0's own process instead", e.message)
                    own_process = False
            return StoreServer("0.0.0.0", port, secret=secret, clients=clients, ranks=ranks, initial=initial)
        except OSError as e:
            errors.append(f"{port}: {e.strerror}")
    raise BootstrapError(f"rank 0 could not bind the rendezvous store on any of ports {ports}: {errors}",
                         hint="set HPCRING_STORE_PORT to a free port, or pass another port_range")


def _other_world(client: StoreClient, world: str | None) -> str | None:
    """None when ``client``'s store serves ``world`` (or no world is asked for); else why not,
    with the client closed. One CHECK round trip: the key is there before the store accepts."""
    if world is None:
        return None
    try:
        theirs = client.check(WORLD_KEY)
    except BootstrapError as e:
        theirs, why = None, f"asking its world failed: {e.message}"
    else:
        why = (f"another world's store ({theirs.decode(errors='replace')!r}, not {world!r})"
               if theirs is not None else "a store with no world key")
    if theirs is not None and theirs.decode(errors="replace") == world:
        return None
    client.close()
    return why


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
                 ranks: int = 1, world: str | None = None) -> StoreClient:
    """First port whose peer authenticates as our store; refused ports are retried with backoff.
    ``who`` names rank 0 (and its host) in the error. The backoff's cap grows with the job size
    (``ranks``) and each wait is jittered: 4096 ranks retrying every 0.2 s in step are 20 000 refused
    connects a second while rank 0 starts its store (on 2 simulated cores, more CPU than there is)."""
    cap = min(RETRY_CAP_S[1], RETRY_CAP_S[0] * max(1.0, ranks / RETRY_RANKS))
    start, delay, seen = time.monotonic(), 0.05, {}
    while True:
        for port in ports:
            try:
                client = StoreClient(host, port, secret, timeout=min(2.0, max(0.1, time_left(deadline))),
                                     connect_retry=False)
            except StoreAuthError as e:
                seen[port] = f"not our store ({e.message})"   # another job's store: try the next port
                continue
            except BootstrapError as e:
                seen[port] = e.message
                if time.monotonic() - start < STRICT_PORT_ORDER_S:
                    break   # nobody there yet: rank 0 is probably still starting on this port
                continue
            other = _other_world(client, world)
            if other is None:
                return client
            seen[port] = other   # this job's store, another world's: try the next port
        if time_left(deadline) <= 0:
            raise BootstrapError(
                f"could not reach the rendezvous store of {who} at {host} on ports {ports}: "
                + "; ".join(f"{p}: {m}" for p, m in seen.items()),
                hint="check that rank 0 started, that HPCRING_MASTER_ADDR/MASTER_ADDR or the first host "
                     "name resolves to rank 0's node, and that these ports are not firewalled")
        time.sleep(min(delay * random.uniform(0.5, 1.0), time_left(deadline)))
        delay = min(delay * 2, cap)   # refused connects are cheap; rank 0 may appear any moment
