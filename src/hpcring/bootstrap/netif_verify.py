"""Verification between ranks: agree on one interface per rank that its peers really reach.

Names are not trusted: every rank listens on each of its candidates (a short-lived socket that
answers an HMAC challenge with the job secret before it reads anything), publishes ``(name,
address, port)`` in the store, and connects to its ring neighbour's (or every rank's) candidates.
Rank 0 gathers the results and picks, for each rank, its first candidate that every tester
reached, so ``ib0`` on one host may pair with ``ibp65s0`` on another.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from hpcring.bootstrap.netif_list import Interface
from hpcring.bootstrap.netif_probe import ProbeListener, probe
from hpcring.bootstrap.store_wire import from_json, json_value
from hpcring.errors import BootstrapError
from hpcring.netio import time_left
from hpcring.ranks import runs

log = logging.getLogger("hpcring.bootstrap.netif")


@dataclass(frozen=True)
class Endpoint:
    """One rank's chosen interface."""
    rank: int
    host: str
    interface: str
    address: str


@dataclass(frozen=True)
class Choice:
    """What verification gives one rank: its own endpoint, and rank 0's summary of every rank's
    choice (runs of ranks, at most ``SUMMARY_RUNS`` of them: one line at any job size)."""
    mine: Endpoint
    summary: str


SUMMARY_RUNS = 8


def verify_interfaces(client, *, rank: int, size: int, host: str, candidates: Sequence[Interface],
                      secret: bytes, mode: str = "ring", timeout: float = 30.0,
                      connect_timeout: float = 2.0, prefix: str = "netif",
                      _dead: Collection[str] = ()) -> Choice:
    """Agree, through the store ``client``, on one verified interface per rank; every rank returns
    its own endpoint and the same summary. Rank 0 publishes the choice as the index of each rank's
    chosen candidate, run-length coded (a few bytes when every rank picks alike), not as a table:
    each of N ranks reading an N-row table is N² bytes through the store (72 KiB a rank at 2048).

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
        results = _probe_peers(client, rank, size, mode, secret, connect_timeout, deadline, prefix,
                               publish={f"{prefix}/cand/{rank}": json_value(mine)})
        if rank == 0:
            client.set(f"{prefix}/res/{rank}", json_value(results))
            client.set(f"{prefix}/choice", json_value(_decide(client, size, mode, deadline, prefix)))
            choice = from_json(client.get(f"{prefix}/choice", timeout=time_left(deadline)))
        else:   # publish my results and read rank 0's choice: one round trip
            choice = from_json(client.exchange({f"{prefix}/res/{rank}": json_value(results)},
                                               [f"{prefix}/choice"], timeout=time_left(deadline))[0])
    finally:
        for lst in listeners:
            lst.close()
    if not choice["ok"]:
        raise BootstrapError(choice["error"], hint=choice["hint"])
    pick = next(i for first, last, i in choice["picks"] if first <= rank <= last)
    c = candidates[pick]
    return Choice(Endpoint(rank, host, c.name, c.address), choice["summary"])


def _peers(rank: int, size: int, mode: str) -> list[int]:
    if size == 1 or mode == "none":
        return []
    if mode == "ring":
        return [(rank + 1) % size]
    return [r for r in range(size) if r != rank]


def _probe_peers(client, rank, size, mode, secret, connect_timeout, deadline, prefix, publish) -> dict[str, list]:
    """``{peer rank: [error or None per candidate of that peer]}``; all probes run in parallel.
    ``publish`` (this rank's candidates) goes out with the read of the peers': one round trip."""
    peers = _peers(rank, size, mode)
    values = client.exchange(publish, [f"{prefix}/cand/{p}" for p in peers], timeout=time_left(deadline))
    cands = {p: from_json(v)["cands"] for p, v in zip(peers, values)}
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
    values = client.gather([f"{prefix}/cand/{r}" for r in range(size)] + [f"{prefix}/res/{r}" for r in range(size)],
                           timeout=time_left(deadline))   # one round trip for the whole job
    cands = [from_json(v) for v in values[:size]]
    tested: dict[int, list[tuple[int, list]]] = {r: [] for r in range(size)}   # target -> [(tester, errors)]
    for r in range(size):
        for peer, errs in from_json(values[size + r]).items():
            tested[int(peer)].append((r, errs))
    table, picks, failures = [], [], []
    for r in range(size):
        ok = [i for i in range(len(cands[r]["cands"])) if all(errs[i] is None for _, errs in tested[r])]
        if not ok:
            failures.append(r)
            continue
        c = cands[r]["cands"][ok[0]]
        table.append([r, cands[r]["host"], c["name"], c["address"]])
        picks.append(ok[0])
    if failures:
        return {"ok": False, **_failure_report(failures, cands, tested)}
    summary = _summarise(table)
    log.info("hpcring interfaces: %s", summary)
    return {"ok": True, "picks": [[a, b, i] for a, b, i in runs(picks)], "summary": summary}


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
    """``0-3->host lo 127.0.0.1, 4->...``: runs of ranks with the same host/interface/address,
    the first ``SUMMARY_RUNS`` of them."""
    rs = runs([tuple(row[1:]) for row in table])
    more = f", ... ({len(rs) - SUMMARY_RUNS} more runs)" if len(rs) > SUMMARY_RUNS else ""
    return ", ".join(f"{a if a == b else f'{a}-{b}'}->{' '.join(map(str, v))}"
                     for a, b, v in rs[:SUMMARY_RUNS]) + more


