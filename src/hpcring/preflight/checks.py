"""What one node measures for the preflight: its versions, its chosen interface, the GPU check,
and the bandwidth transfer (sender and sink). Each function is bounded in time and never raises
for what it measures: a failure is data (an ``error`` string) for the verdict.
"""
from __future__ import annotations

import importlib.metadata
import platform
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Mapping

from hpcring.bootstrap import netif_choice, netif_list, netif_probe
import hpcring
from hpcring.diagnostics.doctor.facts import site_facts
from hpcring.netio import recv_exact

VERSION_KEYS = ("python", "hpcring", "torch", "openmpi", "nccl")
BW_MAX_BYTES = 32 << 20        # a ring link's transfer: at most 32 MiB ...
BW_MAX_SECONDS = 0.2           # ... or 0.2 s of sending, whichever comes first
_CHUNK = 1 << 20
_COUNT = struct.Struct("!Q")
GEMM_N = 256                   # the GPU check's matrices: 256 x 256 float32 (a few ms per device)
GEMM_RTOL = 1e-2               # relative to the result's largest magnitude (TF32 would pass, garbage not)


# ---------------------------------------------------------------------------------- versions

def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def openmpi_version(timeout: float = 5.0) -> str | None:
    """``4.1.4`` from ``ompi_info --version`` (None when Open MPI is not installed here)."""
    exe = shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"error: {type(e).__name__}"
    for word in out.split():
        if word.startswith("v") and word[1:2].isdigit():
            return word[1:]
    return "unknown"


def torch_facts(gpus: int) -> tuple[dict, object | None]:
    """(``{"torch": version or None, "nccl": version or None}``, the module or None).

    With ``gpus`` > 0 torch is imported (so a node where it is installed but broken shows) and
    NCCL's version is torch's (``torch.cuda.nccl.version()``) when torch has CUDA and a device.
    Without GPUs, the import (seconds of CPU; far more from a cold shared file system on thousands
    of nodes at once) is not worth it: the installed version and whether Python finds the package."""
    out: dict = {"torch": None, "nccl": None}
    if gpus <= 0:
        import importlib.util
        version = _dist_version("torch")
        try:
            found = importlib.util.find_spec("torch") is not None
        except (ImportError, ValueError):
            found = False
        out["torch"] = version if found and version else ("broken: not importable" if version else None)
        return out, None
    try:
        import torch
    except Exception as e:   # noqa: BLE001  (a broken install raises anything at import)
        if _dist_version("torch") is not None:
            out["torch"] = f"broken: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        return out, None
    out["torch"] = str(torch.__version__)
    try:
        if getattr(torch.version, "cuda", None) and torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:   # noqa: BLE001
        out["nccl"] = f"error: {type(e).__name__}"
    return out, torch


def versions(gpus: int = 0) -> tuple[dict, object | None]:
    """This node's versions (``VERSION_KEYS``; None where absent) and the torch module if any."""
    tf, torch = torch_facts(gpus)
    return {"python": platform.python_version(), "hpcring": hpcring.__version__,
            "torch": tf["torch"], "openmpi": openmpi_version(), "nccl": tf["nccl"]}, torch


# ---------------------------------------------------------------------------------- GPU check

def gpu_check(expected: int, torch) -> dict:
    """``{"expected", "count", "skipped" | "error" | "gemm_ms"}``.

    Skipped (not a failure) without torch or with a torch built without CUDA: the version check
    compares torch builds between nodes. With CUDA torch: the device count must be ``expected``
    and a ``GEMM_N``-square float32 GEMM on every device must match the CPU's."""
    out: dict = {"expected": expected}
    if torch is None:
        return {**out, "skipped": "torch is not importable here"}
    if not getattr(getattr(torch, "version", None), "cuda", None):
        return {**out, "skipped": f"torch {getattr(torch, '__version__', '?')} has no CUDA support"}
    try:
        count = int(torch.cuda.device_count())
    except Exception as e:   # noqa: BLE001
        return {**out, "count": None, "error": f"torch.cuda.device_count() failed: {type(e).__name__}: {e}"}
    out["count"] = count
    if count != expected:
        return {**out, "error": f"{count} GPU{'s' if count != 1 else ''} visible, expected {expected}"}
    t0 = time.perf_counter()
    try:
        g = torch.Generator().manual_seed(1234)
        a = torch.randn(GEMM_N, GEMM_N, generator=g, dtype=torch.float32)
        b = torch.randn(GEMM_N, GEMM_N, generator=g, dtype=torch.float32)
        want = a @ b
        scale = float(want.abs().max()) or 1.0
        for d in range(count):
            got = (a.to(f"cuda:{d}") @ b.to(f"cuda:{d}")).cpu()
            err = float((got - want).abs().max()) / scale
            if not err <= GEMM_RTOL:   # also catches NaN
                return {**out, "error": f"GEMM on cuda:{d} differs from the CPU's (max relative error {err:.3g})"}
    except Exception as e:   # noqa: BLE001  (a CUDA error, an ECC fault, a device that fell off the bus)
        return {**out, "error": f"GEMM failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    out["gemm_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    return out


# ---------------------------------------------------------------------------------- interface

def interface_spec(explicit: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(spec, where it came from): ``--ifname``, else HPCRING_IFNAME (job scripts set it from the
    site's fabric), else the fabric of the site HPCRING_SITE names, else automatic (None)."""
    if explicit:
        return explicit, "--ifname"
    if environ.get("HPCRING_IFNAME", "").strip():
        return environ["HPCRING_IFNAME"], "HPCRING_IFNAME"
    if environ.get("HPCRING_SITE"):
        facts = site_facts(environ) or {}
        if facts.get("spec"):
            return facts["spec"], f"site {facts.get('name')} fabric"
    return None, "automatic"


def candidates(spec: str | None) -> list[netif_list.Interface]:
    """hpcring's own choice (bootstrap/netif_choice): the candidates in preference order."""
    return netif_choice.select_candidates(netif_list.list_interfaces(), spec)


# ---------------------------------------------------------------------------------- bandwidth

def sink(conn: socket.socket) -> None:
    """Receiver, run by the probe listener after the peer authenticated: count bytes until EOF
    (at most ``4 * BW_MAX_BYTES``), then acknowledge the count. A plain probe sends nothing and
    closes: the count of 0 goes nowhere, harmlessly."""
    conn.settimeout(5.0)
    buf, total = bytearray(_CHUNK), 0
    while total <= 4 * BW_MAX_BYTES:
        n = conn.recv_into(buf)
        if not n:
            break
        total += n
    conn.sendall(_COUNT.pack(total))


def send_bulk(address: str, port: int, secret: bytes, deadline: float, *, connect_timeout: float,
              max_bytes: int = BW_MAX_BYTES, max_seconds: float = BW_MAX_SECONDS) -> dict:
    """One timed transfer to a listener with :func:`sink`: ``{"gbps", "bytes", "seconds"}`` or
    ``{"error"}``. The time runs until the receiver's acknowledgement, so it covers delivery,
    not only filling socket buffers. Never waits past ``deadline`` (monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0.2:
        return {"error": "no time left before the deadline"}
    chunk = memoryview(bytes(_CHUNK))
    try:
        with netif_probe.probe_connect(address, port, secret, timeout=min(connect_timeout, left)) as s:
            s.settimeout(max(0.2, deadline - time.monotonic()))
            t0 = time.perf_counter()
            sent = 0
            while sent < max_bytes and time.perf_counter() - t0 < max_seconds:
                s.sendall(chunk)
                sent += len(chunk)
            s.shutdown(socket.SHUT_WR)
            (got,) = _COUNT.unpack(recv_exact(s, _COUNT.size))
            dt = time.perf_counter() - t0
    except netif_probe.ProbeFailed as e:
        return {"error": str(e)}
    except (OSError, EOFError) as e:
        return {"error": f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"}
    if got != sent:
        return {"error": f"receiver counted {got} of {sent} bytes"}
    return {"gbps": round(got * 8 / dt / 1e9, 3), "bytes": got, "seconds": round(dt, 4)}
