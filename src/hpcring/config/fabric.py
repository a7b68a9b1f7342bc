"""From a site's fabric description to the environment NCCL, Gloo, Open MPI and UCX need.

Why each variable:
- NCCL_SOCKET_IFNAME: NCCL's bootstrap (and its data path on TCP). NCCL syntax kept as written.
- NCCL_IB_HCA: always in the exact-match ``=`` form, because ``mlx5_1`` would also match mlx5_10..19.
- NCCL_IB_GID_INDEX: RoCE only; the wrong GID silently falls back or hangs.
- NCCL_IB_DISABLE=1: on TCP-only sites, so NCCL does not probe for IB devices.
- GLOO_SOCKET_IFNAME / OMPI_MCA_btl_tcp_if_include / OMPI_MCA_oob_tcp_if_include: these take exact
  interface names only (no prefixes), so they are set here only when every entry is exact;
  otherwise hpcring sets them per rank at init, after verifying which interface connects.
- UCX_NET_DEVICES: UCX takes device:port for IB/RoCE and interface names for TCP.
- HPCRING_RING_STREAMS / HPCRING_RING_THREADS / HPCRING_RING_SHM: hpcring's own ring (fabric.ring_*).
"""
from __future__ import annotations

from hpcring.config.schema import Fabric


def exact_names(spec: list[str]) -> list[str] | None:
    """Interface names if every entry is exact (``=eth0``), else None. ``^`` lists are never exact."""
    if not spec or spec[0].startswith("^"):
        return None
    if all(s.startswith("=") for s in spec):
        return [s[1:] for s in spec]
    return None


def nccl_ifname(spec: list[str]) -> str:
    """NCCL_SOCKET_IFNAME syntax: one leading ``=`` or ``^`` applies to the whole list."""
    if spec and spec[0].startswith("^"):
        return "^" + ",".join(s.lstrip("^") for s in spec)
    if spec and all(s.startswith("=") for s in spec):
        return "=" + ",".join(s[1:] for s in spec)
    return ",".join(s.lstrip("=") for s in spec)


def bootstrap_spec(fab: Fabric) -> str | None:
    """The interface spec (NCCL syntax) for sockets: bootstrap interfaces, else data interfaces."""
    spec = (fab.data_interfaces or fab.bootstrap_interfaces) if fab.kind == "tcp" else \
        (fab.bootstrap_interfaces or fab.data_interfaces)
    return nccl_ifname(spec) if spec else None


def fabric_env(fab: Fabric) -> dict[str, str]:
    """The variables a job needs for this fabric (pure; no site-level ``env`` merged in)."""
    env: dict[str, str] = {"HPCRING_FABRIC": fab.kind}     # what backend="auto" means (choice.py)
    socket_spec = (fab.data_interfaces or fab.bootstrap_interfaces) if fab.kind == "tcp" else \
        (fab.bootstrap_interfaces or fab.data_interfaces)
    if fab.kind == "tcp":
        env["NCCL_IB_DISABLE"] = "1"
    if socket_spec:
        env["NCCL_SOCKET_IFNAME"] = bootstrap_spec(fab)
    if fab.hcas:
        env["NCCL_IB_HCA"] = "=" + ",".join(fab.hcas)
        env["UCX_NET_DEVICES"] = ",".join(h if ":" in h else f"{h}:1" for h in fab.hcas)
    if fab.kind == "roce" and fab.gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(fab.gid_index)
    if fab.ring_streams is not None:
        env["HPCRING_RING_STREAMS"] = str(fab.ring_streams)
    if fab.ring_threads is not None:
        env["HPCRING_RING_THREADS"] = str(fab.ring_threads)
    if fab.ring_shm is not None:
        env["HPCRING_RING_SHM"] = "1" if fab.ring_shm else "0"
    exact_socket = exact_names(socket_spec)
    if exact_socket:
        env["GLOO_SOCKET_IFNAME"] = ",".join(exact_socket)
        env["OMPI_MCA_oob_tcp_if_include"] = ",".join(exact_socket)
    exact_data = exact_names(fab.data_interfaces or socket_spec)
    if exact_data:
        env["OMPI_MCA_btl_tcp_if_include"] = ",".join(exact_data)
        if fab.kind == "tcp":
            env["UCX_NET_DEVICES"] = ",".join(exact_data)
    return env
