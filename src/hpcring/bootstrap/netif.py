"""Network interfaces: list them, pick candidates from a spec, verify them with real connections.

One module per concern, re-exported here so ``from hpcring.bootstrap import netif`` keeps working:

* :mod:`~hpcring.bootstrap.netif_list`: what the kernel reports (:class:`Interface`, :class:`Link`)
* :mod:`~hpcring.bootstrap.netif_choice`: the spec syntax (as NCCL_SOCKET_IFNAME: ``ib,eth``,
  ``=eth0``, ``^docker,lo``) and the automatic rules that order the candidates
* :mod:`~hpcring.bootstrap.netif_probe`: the authenticated listener and connect, one candidate each
* :mod:`~hpcring.bootstrap.netif_verify`: ranks agree on one interface each that their peers reach
"""
from __future__ import annotations

from hpcring.bootstrap.netif_choice import (AUTO_EXCLUDED_PREFIXES, LINK_LOCAL,  # noqa: F401
                                            InterfaceSpec, auto_reject_reason, parse_spec,
                                            select_candidates)
from hpcring.bootstrap.netif_list import Interface, Link, list_interfaces, list_links  # noqa: F401
from hpcring.bootstrap.netif_probe import ProbeFailed, ProbeListener, probe, probe_connect  # noqa: F401
from hpcring.bootstrap.netif_verify import Endpoint, verify_interfaces  # noqa: F401
