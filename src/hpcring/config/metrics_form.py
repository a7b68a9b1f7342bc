"""The grammar of HPCRING_METRICS (``off``, ``http:HOST:PORT``, ``textfile:DIR``): one parser for the
variable registry, which refuses a bad value before anything starts, and for the exporter
(:mod:`hpcring.diagnostics.metrics`), which acts on a good one."""
from __future__ import annotations

from dataclasses import dataclass

from hpcring.config.text import parse_int_text, shown

FORMS = ("off, http:HOST:PORT (each rank serves on PORT + its local rank, bound to HOST) or textfile:DIR "
         "(node-exporter's textfile collector folder)")


@dataclass(frozen=True)
class Setting:
    """A parsed HPCRING_METRICS: ``kind`` http (``host``, ``port``) or textfile (``folder``)."""
    kind: str
    host: str = ""
    port: int = 0
    folder: str = ""


def parse(text: str) -> Setting | None:
    """The setting in ``text`` (stripped, checked for control characters by the caller); None for
    ``off``; ValueError saying why for anything else."""
    if text.lower() == "off":
        return None
    kind, sep, rest = text.partition(":")
    kind = kind.lower()
    if not sep or kind not in ("http", "textfile"):
        raise ValueError("not a known form")
    if kind == "textfile":
        if not rest.strip():
            raise ValueError("textfile: names no folder")
        return Setting("textfile", folder=rest)
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError("http: needs a host and a port, e.g. http:0.0.0.0:9400")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "/[]@?#" for c in host):
        raise ValueError(f"{shown(host)} is no host to bind to")
    try:
        number = parse_int_text(port)
    except ValueError as exc:
        raise ValueError(f"port {shown(port)}: {exc}") from None
    if not 1 <= number <= 65535:
        raise ValueError(f"port {number} is not in 1-65535")
    return Setting("http", host=host, port=number)
