"""Every rank's host through the store (``init/hosts``, gathered by rank 0): the point where all
ranks met, the error that names the ranks that never came, and the compact encoding of the list."""
from __future__ import annotations

import json
import socket

from hpcring.hostlist import compress, expand
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_wire import StoreTimeoutError
from hpcring.bootstrap.topology import Topology
from hpcring.errors import BootstrapError, HostlistError
from hpcring.netio import time_left
from hpcring.ranks import each_on_host, runs

GATHER_MARGIN_S = 2.0       # rank 0 gives up this much before the others, to tell them who is missing


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
