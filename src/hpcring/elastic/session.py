"""One round as a :class:`hpcring.session.Session`: topology, a store client and the round's ring.

hpcring.torch's ``init()`` calls :func:`join` in elastic mode instead of ``hpcring.init()``: the
job's usual rendezvous (rank 0 hosts the store) cannot outlive rank 0, while this one's store
lives with the coordinator. Each round gets a communicator of its own under the round's prefix
(``elastic/<r>/ring``), so the ranks of an old round and a new one never meet by mistake.
The ring is rebuilt on every round. ``HPCRING_BACKEND=nccl`` adds the round's NCCL communicator
as the default: shrunk from the last round's when only ranks were lost (hpcring.elastic.nccl_round),
new otherwise. MPI's communicator cannot shrink without ULFM (not in Open MPI 4.1), so
``HPCRING_BACKEND=mpi`` is refused here.
"""
from __future__ import annotations

import os

from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.topology import Topology
from hpcring.config import envvars
from hpcring.elastic import nccl_round, protocol as P
from hpcring.elastic.member import ElasticJobError, Round, current
from hpcring.errors import UsageError
from hpcring.collectives.api import Communicator
from hpcring.session import Session


def topology_of(rnd: Round, address: str, job_id: str | None) -> Topology:
    hosts = rnd.hosts
    nodes = list(dict.fromkeys(hosts))
    mine = hosts[rnd.rank]
    local = [r for r, h in enumerate(hosts) if h == mine]
    return Topology(rank=rnd.rank, size=rnd.size, local_rank=local.index(rnd.rank), local_size=len(local),
                    node_rank=nodes.index(mine), num_nodes=len(nodes), hosts=tuple(hosts), launcher="elastic",
                    job_id=job_id, master_addr=None, master_port=None, interface=None, address=address,
                    sources={"*": f"elastic round {rnd.number} (coordinator's store)"})


def join(reason: str = "start"):
    """Wait for the next round that takes this worker; its Session (communicator: the ring)."""
    backend = envvars.get("HPCRING_BACKEND")
    if backend not in (None, "", "ring", "nccl"):
        raise UsageError(f"elastic training rebuilds its communicators on the workers that are left (ring, or "
                         f"NCCL by shrinking); HPCRING_BACKEND={backend} cannot do that",
                         hint="unset HPCRING_BACKEND or set it to ring or nccl (MPI cannot shrink without ULFM; "
                              "for a restart instead, run without the elastic driver and use --max-restarts)")
    member = current()
    timeout = envvars.get("HPCRING_ELASTIC_TIMEOUT")
    rnd = member.join(reason, timeout=timeout)
    job = os.environ.get("HPCRING_JOB_ID") or f"elastic-{member.store_port}"
    topo = topology_of(rnd, member.address, job)
    store = StoreClient(member.store_host, member.store_port, member.secret, timeout=60.0)
    try:
        comm = Communicator.create(topo, store, member.secret, backend="ring", prefix=P.ring_prefix(rnd.number))
    except BaseException:
        store.close()
        raise
    session = Session(topo, store, member.secret)
    session._comms["ring"] = comm
    session.default_backend = "ring"
    session.elastic_round = rnd
    if backend == "nccl":
        try:
            gpu, how = nccl_round.build(topo, store, member.secret, rnd.members, P.ring_prefix(rnd.number),
                                        envvars.collective_timeout(None))
        except BaseException:
            nccl_round.release()
            comm.close()
            store.close()
            raise
        session._comms["nccl"] = gpu
        session.default_backend = "nccl"
        session.elastic_nccl = how
    comms = list(session._comms.values())
    member.on_abort(rnd.number, lambda msg: [getattr(c.backend, "abort", lambda m: None)(msg) for c in comms])
    return session


def leave_round(session) -> None:
    """Close the round's communicator and store connection (the next round builds new ones)."""
    member = current()
    member.on_abort(0, None)
    for name, comm in list(session._comms.items()):
        keep = name == "nccl"        # held for the next round's shrink (nccl_round)
        try:
            comm.close(keep_backend=keep)
        except Exception:  # noqa: BLE001 - a failed communicator closes as far as it can
            pass
        if keep:
            nccl_round.keep(session.elastic_round.members, comm.backend)
    session._comms.clear()
    try:
        session.store.close()
    except Exception:  # noqa: BLE001
        pass


__all__ = ["ElasticJobError", "join", "leave_round", "topology_of"]
