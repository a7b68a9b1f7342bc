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
   (:mod:`hpcring.bootstrap.netif_verify`). Rank 0 then publishes, under ``init/master``, its
   address on the *chosen* interface (the real MASTER_ADDR, not what its host name resolves to),
   the store port and a framework port (store port + 1 or higher, checked bindable on rank 0) for
   ``torch.distributed``'s own store.

The steps' mechanisms: init_store (1-2), init_pmix (the PMIx way to meet), init_hosts (3's hosts);
frameworks: the environment torch.distributed, NCCL and Gloo read.
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping

from hpcring.bootstrap import launchers, netif_choice, netif_list, netif_verify
from hpcring.bootstrap.auth import load_secret
from hpcring.bootstrap.init_hosts import _gather_hosts
from hpcring.bootstrap.init_pmix import _meet_through_pmix, _pmix_client
from hpcring.bootstrap.init_store import _open_store, _store_ports, store_world
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError
from hpcring.netio import time_left

last_timings: dict[str, float] = {}   # seconds since init_bootstrap started, for benchmarks


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
    candidates = netif_choice.select_candidates(netif_list.list_interfaces(), spec)
    ports = _store_ports(topo, env, port_range)
    world = store_world(topo, env)

    pmx = _pmix_client(topo, env, secret, deadline)
    last_timings["rendezvous_chosen"] = time.monotonic() - t0   # PMIx_Init's cost, when it ran
    if pmx is None:
        client = _open_store(topo, env, ports, secret, deadline, world)
        client.timeout = max(1.0, deadline - time.monotonic())
        last_timings["connected"] = time.monotonic() - t0
        hosts = _gather_hosts(client, topo, deadline)
    else:   # hosts and the store's address through one PMIx fence: no port search, no master address
        client, hosts = _meet_through_pmix(pmx, topo, ports, secret, candidates, deadline, world)
        last_timings["connected"] = time.monotonic() - t0
    last_timings["met"] = time.monotonic() - t0

    try:
        mine = netif_verify.verify_interfaces(
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


def _with_alternatives(exc: BootstrapError, client, topo: Topology, hosts: list[str], secret: bytes,
                       verify: str, deadline: float) -> BootstrapError:
    """The configured interface failed: probe the automatic candidates (all ranks do) and say which work."""
    try:
        auto = netif_choice.select_candidates(netif_list.list_interfaces(), None)
        works = netif_verify.verify_interfaces(
            client, rank=topo.rank, size=topo.size, host=hosts[topo.rank], candidates=auto, secret=secret,
            mode=verify, timeout=min(8.0, time_left(deadline)), prefix="init/netif-alt").summary
        alt = f" Interfaces that do connect every rank (automatic choice, ranks->host interface address): {works}."
    except BootstrapError as alt_exc:
        alt = f" No automatic choice connects every rank either ({alt_exc.message[:200]})."
    return BootstrapError(exc.message.rstrip(".") + "." + alt, hint=exc.hint)


def _agree_master(client: StoreClient, rank: int, mine: netif_verify.Endpoint, deadline: float) -> dict:
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
