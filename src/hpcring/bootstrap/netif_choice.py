"""Which interfaces are candidates, in which order: the spec syntax and the automatic rules.

Spec syntax (site config ``interface:``, ``init_bootstrap(interface=...)``, HPCRING_IFNAME), the
same as NCCL_SOCKET_IFNAME:

* ``ib,eth``      use interfaces whose names start with ``ib`` or ``eth`` (in that order)
* ``=eth0,ib0``   exact names only
* ``^docker,lo``  every interface the automatic rules keep, except these prefixes (``^=`` exact)
* empty / None    automatic: drop loopback, docker*, virbr*, veth*, link-local 169.254/16, down
                  interfaces and interfaces without IPv4; InfiniBand (ib*) first, then by /sys speed.

Pure functions over a listing (:mod:`hpcring.bootstrap.netif_list`); whether a candidate really
connects is decided later by :mod:`hpcring.bootstrap.netif_verify`.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpcring.bootstrap.netif_list import Interface
from hpcring.errors import BootstrapError

log = logging.getLogger("hpcring.bootstrap.netif")

AUTO_EXCLUDED_PREFIXES = ("docker", "virbr", "veth")
LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")


@dataclass(frozen=True)
class InterfaceSpec:
    names: tuple[str, ...]
    exclude: bool = False
    exact: bool = False

    def matches(self, name: str) -> bool:
        return any(self._match_one(p, name) for p in self.names)

    def rank_of(self, name: str) -> int:
        """Position of the first pattern matching ``name`` (for ordering include lists)."""
        return next(i for i, p in enumerate(self.names) if self._match_one(p, name))

    def _match_one(self, pattern: str, name: str) -> bool:
        return name == pattern if self.exact else name.startswith(pattern)


def parse_spec(spec: str | InterfaceSpec | None) -> InterfaceSpec | None:
    """``"^docker,lo"`` / ``"=eth0"`` / ``"ib,eth"`` -> InterfaceSpec; empty or None -> None (auto)."""
    if spec is None or isinstance(spec, InterfaceSpec):
        return spec
    text = spec.strip()
    if not text:
        return None
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise BootstrapError(f"interface spec {spec!r} names no interface",
                             hint="examples: 'ib0', '=eth0', 'ib,eth', '^docker,lo'")
    return InterfaceSpec(names, exclude=exclude, exact=exact)


def auto_reject_reason(iface: Interface) -> str | None:
    """Why the automatic rules drop ``iface`` (None = keep it)."""
    if iface.loopback or iface.name == "lo" or iface.address.startswith("127."):
        return "loopback"
    if iface.name.startswith(AUTO_EXCLUDED_PREFIXES):
        return "container/VM bridge or veth"
    if ipaddress.ip_address(iface.address) in LINK_LOCAL:
        return "link-local 169.254/16"
    if not iface.up:
        return "down"
    return None


def _preference(iface: Interface, index: int) -> tuple:
    # InfiniBand (IPoIB) first: it is the fabric on HPC clusters; then the fastest link.
    return (0 if iface.name.startswith("ib") else 1, -(iface.speed or 0), index)


def select_candidates(interfaces: Sequence[Interface], spec: str | InterfaceSpec | None = None) -> list[Interface]:
    """Candidates in preference order for ``spec`` (see module docstring); never empty.

    An include spec keeps loopback and its own order (so ``=lo`` works on one machine); down
    interfaces are still dropped. BootstrapError names the interfaces that exist when nothing
    matches.
    """
    parsed = parse_spec(spec)
    indexed = list(enumerate(interfaces))
    if parsed is not None and not parsed.exclude:
        picked = [(i, f) for i, f in indexed if parsed.matches(f.name) and f.up]
        picked.sort(key=lambda t: (parsed.rank_of(t[1].name), t[0]))
        if not picked:
            raise BootstrapError(
                f"no usable interface matches {spec!r} on {socket.gethostname()}; "
                f"interfaces here: {_describe(interfaces)}",
                hint="fix the site config's interface or HPCRING_IFNAME, or leave it empty for automatic choice")
        return [f for _, f in picked]
    kept = [(i, f) for i, f in indexed
            if auto_reject_reason(f) is None and not (parsed and parsed.matches(f.name))]
    if not kept:
        loop = [f for f in interfaces if f.up and (f.loopback or f.name == "lo")]
        if loop:
            # Only good for ranks on one machine; verification decides whether that is the case.
            log.warning("no non-loopback interface on %s (%s); trying loopback",
                        socket.gethostname(), _describe(interfaces))
            return loop[:1]
        raise BootstrapError(f"no usable network interface on {socket.gethostname()}: {_describe(interfaces)}",
                             hint="set the interface explicitly (HPCRING_IFNAME or the site config)")
    kept.sort(key=lambda t: _preference(t[1], t[0]))
    return [f for _, f in kept]


def _describe(interfaces: Iterable[Interface]) -> str:
    parts = [f"{f.name} {f.address}/{f.prefixlen}{'' if f.up else ' (down)'}" for f in interfaces]
    return ", ".join(parts) or "none with IPv4"
