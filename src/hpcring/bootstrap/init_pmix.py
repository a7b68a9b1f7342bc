"""Meeting through the launcher's PMIx (HPCRING_RENDEZVOUS): whether a PMIx client may be used, and
one fence that hands every rank the hosts and rank 0's store address (no port search)."""
from __future__ import annotations

import atexit
import json
import logging
import socket
import time
from collections.abc import Mapping

from hpcring.bootstrap.init_store import _start_server
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.topology import Topology
from hpcring.config import envvars
from hpcring.errors import BootstrapError
from hpcring.netio import time_left
from hpcring.bootstrap import pmix

log = logging.getLogger("hpcring.bootstrap.init")

PMIX_INIT_TIMEOUT_S = 10.0  # PMIx_Init talks to the local server only; longer means it is not answering


def _pmix_client(topo: Topology, env: Mapping[str, str], secret: bytes, deadline: float):
    """A PMIx client when HPCRING_RENDEZVOUS (auto|store|pmix) and the launcher allow one, else None
    (the store); ``pmix`` refuses to fall back, ``auto`` logs why it did."""
    mode = envvars.get("HPCRING_RENDEZVOUS", env)
    if mode == "store":
        return None
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
                       deadline: float, world: str | None = None) -> tuple[StoreClient, list[str]]:
    """Rank 0 starts the store, then every rank publishes its host (rank 0 also the store's port and
    its addresses) and one fence hands everyone all of it; the others connect straight to the store.
    The store still serves interface verification, init/master, the ring's addresses, the watchdog."""
    known = len(topo.hosts) == topo.size and topo.hosts[topo.rank] not in ("", "?")
    card = {"host": topo.hosts[topo.rank] if known else socket.gethostname()}
    client = None
    if topo.rank == 0:
        server = _start_server(ports, secret, ranks=topo.size, world=world)
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
