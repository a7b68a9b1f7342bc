"""The doctor's data: options, checks, the report and its table, the constants every step shares."""
from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from hpcring.ranks import ranks_label
from hpcring.errors import UsageError

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_ORDER = {OK: 0, WARN: 1, FAIL: 2}

# What frameworks read to pick interfaces and HCAs (and hpcring its backend: HPCRING_FABRIC, which
# backend="auto" reads on every rank); compared with the site config and between ranks.
ENV_VARS = ("HPCRING_IFNAME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include",
            "OMPI_MCA_oob_tcp_if_include", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX",
            "UCX_NET_DEVICES", "HPCRING_SITE", "HPCRING_FABRIC")
# (variable, syntax): "nccl" = NCCL_SOCKET_IFNAME syntax, "exact" = comma list of names,
# "ompi" = comma list of names or CIDR subnets (Open MPI's if_include).
IFACE_VARS = (("HPCRING_IFNAME", "nccl"), ("NCCL_SOCKET_IFNAME", "nccl"), ("GLOO_SOCKET_IFNAME", "exact"),
              ("OMPI_MCA_btl_tcp_if_include", "ompi"), ("OMPI_MCA_oob_tcp_if_include", "ompi"))
CHOSEN = "chosen"               # target label of the interface hpcring.init() verified

SLOW_FACTOR = 0.5               # a ring link under this fraction of its class's median is slow
DEFAULT_TIMEOUT = 60.0
DEFAULT_BW_SECONDS = 0.6        # per ring link, all rounds together
BW_ROUNDS = 2                   # best of: one round disturbed by another process does not flag a link
CHUNK = 256 * 1024
CONNECT_TIMEOUT = 2.0
LATENCY_TRIES = 3
GATHER_MARGIN_S = 2.0           # rank 0 gives up this much before the others, to tell them why
_COUNT = struct.Struct(">Q")
_STEP_NAMES = {"facts": "facts", "conn": "connectivity results", "bw": "ring link measurement",
               "bw2": "ring link re-measurement"}


@dataclass(frozen=True)
class Options:
    """``timeout``: seconds from the start by which every rank returns or raises (every wait is
    bounded by it). ``bw_seconds``: bulk-transfer time per ring link (shrunk when n links would not
    fit in half the timeout)."""
    timeout: float = DEFAULT_TIMEOUT
    bw_seconds: float = DEFAULT_BW_SECONDS
    connect_timeout: float = CONNECT_TIMEOUT

    def check(self) -> "Options":
        if self.timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, not {self.timeout}")
        if self.bw_seconds <= 0:
            raise UsageError(f"--bw-seconds must be > 0, not {self.bw_seconds}")
        return self


@dataclass(frozen=True)
class Check:
    name: str
    status: str     # OK, WARN or FAIL
    detail: str


@dataclass
class DoctorReport:
    """The verdict of one doctor run, the same on every rank. ``data`` holds what it is based on
    (per-rank facts, pair probes, ring links) for ``--json``."""
    checks: list[Check]
    hosts: list[str]
    job_id: str | None = None
    started: float = 0.0        # epoch seconds (time.time()), rank 0's clock
    finished: float = 0.0
    data: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return max((c.status for c in self.checks), key=_ORDER.__getitem__, default=OK)

    @property
    def exit_code(self) -> int:
        """1 when any check FAILed (every rank exits with it); WARN alone is 0."""
        return 1 if self.verdict == FAIL else 0

    def verdict_line(self) -> str:
        bad = [c.name for c in self.checks if c.status == FAIL]
        warn = [c.name for c in self.checks if c.status == WARN]
        parts = ([f"{len(bad)} failed ({', '.join(bad)})"] if bad else []) + \
                ([f"{len(warn)} warning(s) ({', '.join(warn)})"] if warn else [])
        return f"verdict: {self.verdict}" + (f": {'; '.join(parts)}" if parts else f": all {len(self.checks)} checks passed")

    def format(self) -> str:
        """The table rank 0 prints: a title, one row per check, the verdict line."""
        rows = [("CHECK", "STATUS", "DETAIL")] + [(c.name, c.status, c.detail) for c in self.checks]
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        lines = [self.title()] + [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
        return "\n".join(lines + [self.verdict_line()])

    def title(self) -> str:
        """``hpcring doctor: 6 ranks on 3 hosts: node1 (ranks 0-1), ..., job 42``."""
        hosts = _distinct(self.hosts)
        ranks = {h: [i for i, x in enumerate(self.hosts) if x == h] for h in hosts}
        layout = ", ".join(f"{h} ({ranks_label(rs)})" for h, rs in ranks.items())
        return (f"hpcring doctor: {_plural(len(self.hosts), 'rank')} on {_plural(len(hosts), 'host')}: {layout}"
                + (f", job {self.job_id}" if self.job_id else ""))

    def to_dict(self, with_data: bool = True) -> dict:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "job_id": self.job_id,
                "hosts": self.hosts, "started": self.started, "finished": self.finished,
                "checks": [asdict(c) for c in self.checks], **(self.data if with_data else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> "DoctorReport":
        extra = {k: v for k, v in d.items() if k not in
                 ("verdict", "exit_code", "job_id", "hosts", "started", "finished", "checks")}
        return cls([Check(**c) for c in d["checks"]], list(d["hosts"]), d.get("job_id"),
                   d.get("started", 0.0), d.get("finished", 0.0), extra)

def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _distinct(items) -> list:
    return list(dict.fromkeys(items))
