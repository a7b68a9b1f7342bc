"""The elastic rendezvous's keys in the store and the records under them (one place for both
sides: :mod:`hpcring.elastic.coordinator` writes rounds, :mod:`hpcring.elastic.member` asks).

``elastic/nreq``            counter; a worker takes n and writes its request under ``req/<n>``
``elastic/req/<n>``         {"wid", "host", "after": its last round, "reason": start|error|interrupt}
``elastic/round/<r>``       {"round", "members": [wid...] in rank order, "hosts", "resets", "updated"}
                            or {"round", "error": text}: the job cannot go on
``elastic/current``         the newest round number (a newcomer waits for the one after)
``elastic/hb/<wid>``        a counter the worker's heartbeat thread raises every HEARTBEAT_S
``elastic/left/<wid>``      the worker ended normally (it is no longer waited for)
``elastic/expelled/<wid>``  the coordinator counted the worker dead (no heartbeat): it may not rejoin
``elastic/abort``           r: round r is lost (a member died or a collective failed): its members
                            abort their communicator so that none waits out its deadline
``elastic/updated``         {"timestamp", "result"}: newcomers wait (Horovod's hosts-updated
                            notification; check_host_updates raises HostsUpdatedInterrupt)
``elastic/<r>/ring/...``    round r's ring communicator (addresses, generations)
"""
from __future__ import annotations

import json

NREQ = "elastic/nreq"
CURRENT = "elastic/current"
ABORT = "elastic/abort"
UPDATED = "elastic/updated"
HEARTBEAT_S = 0.25
DEFAULT_TIMEOUT_S = 600.0      # HOROVOD_ELASTIC_TIMEOUT's default
DEFAULT_DEAD_AFTER_S = 6.0


def req(n: int) -> str:
    return f"elastic/req/{n}"


def round_key(r: int) -> str:
    return f"elastic/round/{r}"


def hb(wid: str) -> str:
    return f"elastic/hb/{wid}"


def left(wid: str) -> str:
    return f"elastic/left/{wid}"


def expelled(wid: str) -> str:
    return f"elastic/expelled/{wid}"


def ring_prefix(r: int) -> str:
    return f"elastic/{r}/ring"


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(raw: bytes | None):
    return None if raw is None else json.loads(raw)
