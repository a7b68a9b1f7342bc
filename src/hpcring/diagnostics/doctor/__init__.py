"""``hpcring doctor``: is this allocation's network fit for collectives? One report for the whole job.

Every rank runs :func:`run_doctor` (collectively: ``hpcring run -- hpcring doctor``, ``srun``,
``mpirun``, or a submitted script); each gets the same :class:`DoctorReport`, rank 0 prints it.
The side channel is the session's authenticated store (``hpcring.init()``); every connection
between ranks is authenticated with the job secret by the interface probe of
:mod:`hpcring.bootstrap.netif_probe` before a byte of payload flows. Steps, each bounded by one deadline
(``Options.timeout`` from the start):

1. facts: each rank lists its node's interfaces (name, state, MTU, IPv4 addresses), InfiniBand
   devices, the variables NCCL, Gloo and Open MPI read, and its site config's interface spec; it
   opens probe listeners (see 2 and 3) and publishes all that; rank 0 gathers it into one key.
2. connectivity: every rank probes every other rank (all pairs) on the interface ``hpcring.init()``
   chose, and on each other interface a configured variable selects; reachability in parallel,
   then latency as the best of a few sequential connect+authenticate round trips.
3. bandwidth: ring links rank i -> i+1 (mod n), one at a time (a token passed through the store,
   so no two transfers share a CPU or a link): a timed bulk transfer over an authenticated probe
   connection, the receiver acknowledging the byte count; best of ``BW_ROUNDS``.
4. rank 0 evaluates the checks with the pure functions below (unit-tested on synthetic facts) and
   publishes the report; when a rank is missing, rank 0 publishes the error instead, naming it, so
   every rank fails with the same message before the deadline.

Status rules: FAIL for what breaks or hangs jobs (a configured interface missing or down on some
node, an unreachable pair, a slow ring link: under half the median of its class, inter-node links
compared with inter-node links and intra-node with intra-node); WARN for what is suspicious but
may work (NCCL_IB_HCA as a prefix list, names or MTUs differing between nodes, variables that
contradict the site config or differ between ranks).
"""
from __future__ import annotations

from hpcring.diagnostics.doctor.checks import (check_bandwidth, check_connectivity, check_consistency,
                                               check_env, check_interfaces, evaluate, slow_links)
from hpcring.diagnostics.doctor.facts import Selection, _targets, collect_facts, select  # noqa: F401
from hpcring.diagnostics.doctor.model import (CHOSEN, FAIL, OK, WARN, Check, DoctorReport, Options)
from hpcring.diagnostics.doctor.run import ensure_secret_when_alone, measure_link, run_doctor, write_json

__all__ = ["CHOSEN", "FAIL", "OK", "WARN", "Check", "DoctorReport", "Options", "Selection", "check_bandwidth",
           "check_connectivity", "check_consistency", "check_env", "check_interfaces", "collect_facts",
           "ensure_secret_when_alone", "evaluate", "measure_link", "run_doctor", "select", "slow_links",
           "write_json"]
