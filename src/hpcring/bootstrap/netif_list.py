"""This machine's network interfaces, as the kernel of this network namespace sees them.

Two listings: :func:`list_interfaces` (IPv4 interfaces with address, prefix, state, speed, MTU:
the candidates for rendezvous and the ring) and :func:`list_links` (every interface, with or
without an address: what ``hpcring doctor`` reports).
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import socket
import struct
import subprocess
from dataclasses import dataclass

log = logging.getLogger("hpcring.bootstrap.netif")

SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
IFF_RUNNING = 0x40   # lower layer up (carrier)
SIOCGIFFLAGS = 0x8913
SIOCGIFMTU = 0x8921


@dataclass(frozen=True)
class Interface:
    name: str
    address: str                 # IPv4, dotted quad
    prefixlen: int = 32
    up: bool = True
    speed: int | None = None     # Mb/s from /sys/class/net/<if>/speed; None when unknown
    mtu: int | None = None
    loopback: bool = False


@dataclass(frozen=True)
class Link:
    """One interface of this network namespace, whether or not it has an IPv4 address."""
    name: str
    up: bool          # administratively up (IFF_UP)
    carrier: bool     # lower layer up (IFF_RUNNING)
    mtu: int | None

    @property
    def state(self) -> str:
        """``up``, ``no-carrier`` (up but the link below is not) or ``down``."""
        return "up" if self.up and self.carrier else ("no-carrier" if self.up else "down")


def list_interfaces(*, all_addresses: bool = False) -> list[Interface]:
    """IPv4 interfaces in kernel order.

    Default: ioctl (SIOCGIFADDR), in-process and cheap, one (primary) address per interface; 256
    ranks on one machine each forking ``ip`` cost more than the whole rendezvous. With
    ``all_addresses`` (or if ioctl fails) parse ``ip -j -4 addr``: one entry per address.
    """
    if not all_addresses:
        try:
            return _from_ioctl()
        except OSError as e:
            log.debug("ioctl interface listing failed (%s); trying `ip -j addr`", e)
    return _from_ip_json(_run_ip())


def list_links() -> list[Link]:
    """Every interface in kernel order, flags and MTU from the kernel (not /sys: see _from_ioctl)."""
    result = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                flags, mtu = _flags_mtu(s, _ifreq(name))
            except OSError:   # vanished between the listing and the ioctl
                continue
            result.append(Link(name, bool(flags & IFF_UP), bool(flags & IFF_RUNNING), mtu))
    return result


def _run_ip() -> str:
    out = subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=5, check=True)
    return out.stdout


def _from_ip_json(text: str) -> list[Interface]:
    result = []
    for link in json.loads(text):
        name = link["ifname"]
        flags = set(link.get("flags", ()))
        for addr in link.get("addr_info", ()):
            if addr.get("family") != "inet":
                continue
            result.append(Interface(
                name=name, address=addr["local"], prefixlen=int(addr.get("prefixlen", 32)),
                up=("UP" in flags) and _sys_operstate(name) not in ("down", "lowerlayerdown", "notpresent"),
                speed=_sys_int(name, "speed"), mtu=link.get("mtu") or _sys_int(name, "mtu"),
                loopback="LOOPBACK" in flags))
    return result


def _ifreq(name: str) -> bytes:
    return struct.pack("256s", name.encode()[:15])


def _flags_mtu(s: socket.socket, req: bytes) -> tuple[int, int]:
    """Interface flags (IFF_*) and MTU by ioctl; OSError when the interface is gone."""
    flags = struct.unpack("H", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req)[16:18])[0]
    mtu = struct.unpack("i", fcntl.ioctl(s.fileno(), SIOCGIFMTU, req)[16:20])[0]
    return flags, mtu


def _from_ioctl() -> list[Interface]:
    result = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for index, name in socket.if_nameindex():
            req = _ifreq(name)
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, req)[20:24])
            except OSError:
                continue   # no IPv4 address on this interface
            # Flags and MTU from the kernel for THIS network namespace: /sys may belong to another
            # one (nsenter'd nodes, some containers) and describe a different interface of that name.
            flags, mtu = _flags_mtu(s, req)
            own_sys = _sys_int(name, "ifindex") == index
            result.append(Interface(
                name=name, address=addr, prefixlen=ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen,
                up=bool(flags & IFF_UP) and bool(flags & IFF_RUNNING),
                speed=_sys_int(name, "speed") if own_sys else None, mtu=mtu,
                loopback=bool(flags & IFF_LOOPBACK) or name == "lo"))
    return result


def _sys_read(name: str, attr: str) -> str | None:
    try:
        with open(f"/sys/class/net/{name}/{attr}") as f:
            return f.read().strip()
    except OSError:   # virtual links raise EINVAL on speed; missing sysfs in some containers
        return None


def _sys_operstate(name: str) -> str:
    return _sys_read(name, "operstate") or "unknown"


def _sys_int(name: str, attr: str) -> int | None:
    text = _sys_read(name, attr)
    try:
        value = int(text, 0) if text else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None
