"""The job-wide timeline: each rank records its operations' phases; ``hpcring timeline`` merges.

``HPCRING_TIMELINE=PATH``: rank r writes ``PATH.rank<r>`` (JSON lines). The first line is a header
``{"rank", "size", "host", "offset_us"}``: this rank's wall clock minus rank 0's, measured at init
(:func:`measure_offset`). Each further line is one Chrome-trace "complete" event (``ph: "X"``)
with ``ts``/``dur`` in microseconds of this rank's clock: phases ``queued`` (submitted -> taken by
a negotiation), ``negotiate`` (the name-matching allgather: time waiting for peers), ``pack``,
``backend`` (the collective), ``unpack``, with tensor names, bytes and backend in ``args``.
:func:`merge` subtracts the offsets and writes one Chrome-trace/Perfetto JSON with one track
(``pid``) per rank, so a straggler shows as that rank's long ``negotiate`` while the others wait.

Cost when off: one ``is None`` test per cycle. When on: one ``json.dumps`` + buffered write per
event (about 5 events per fused cycle; measured in benchmarks/horovod_synthetic.py).
"""
from __future__ import annotations

import glob
import json
import os
import socket
import statistics
import time
from pathlib import Path

import numpy as np

from hpcring.errors import UsageError


def rank_file(path: str, rank: int) -> Path:
    return Path(f"{path}.rank{rank}")


def measure_offset(comm, rounds: int = 5) -> float:
    """This rank's wall clock minus rank 0's, in microseconds: after each barrier every rank reads
    its clock at (nearly) the same moment; the allgathered readings give the differences. The
    error is the barrier's exit skew (tens of microseconds on one host, ~a network latency
    across hosts); the median over ``rounds`` discards outliers."""
    diffs = []
    for _ in range(rounds):
        comm.barrier()
        now = np.array([time.time_ns() // 1000], dtype=np.int64)
        t = comm.allgather(now).reshape(-1)
        diffs.append(float(t[comm.rank] - t[0]))
    return statistics.median(diffs)


class Timeline:
    """One rank's recorder (engine thread only)."""

    def __init__(self, path: str, rank: int, size: int, offset_us: float) -> None:
        f = rank_file(path, rank)
        f.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(f, "w", buffering=1 << 16)
        self.rank = rank
        self._f.write(json.dumps({"rank": rank, "size": size, "host": socket.gethostname(),
                                  "offset_us": offset_us, "pid": os.getpid()}) + "\n")

    def _event(self, name: str, cat: str, t0: float, t1: float, args: dict) -> None:
        self._f.write(json.dumps({"name": name, "cat": cat, "ph": "X", "ts": int(t0 * 1e6),
                                  "dur": max(int((t1 - t0) * 1e6), 1), "args": args}) + "\n")

    def negotiate(self, batch, t0: float, t1: float) -> None:
        for e in batch:
            if e.t_queued < t0:
                self._event(e.name, "queued", e.t_queued, t0, {"kind": e.kind})
        names = [e.name for e in batch]
        args = {"tensors": names[:16], "count": len(names)}
        if batch and getattr(batch[0], "pset", 0):
            args["process_set"] = batch[0].pset
        self._event("negotiate", "negotiate", t0, t1, args)

    def fused(self, chunk, t0, t1, t2, t3, nbytes: int, backend: str) -> None:
        names = [e.name for e in chunk]
        args = {"tensors": names[:16], "count": len(names), "bytes": nbytes, "backend": backend}
        if getattr(chunk[0], "pset", 0):       # hpcring.torch process sets other than the global one
            args["process_set"] = chunk[0].pset
        kind = chunk[0].kind
        self._event(f"pack {kind}", "pack", t0, t1, args)
        self._event(f"{kind} ({len(names)} fused)", "backend", t1, t2, args)
        self._event(f"unpack {kind}", "unpack", t2, t3, args)

    def single(self, e, t0: float, t1: float, backend: str) -> None:
        nbytes = e.numel * e.tensor.element_size() if e.tensor is not None else 0
        args = {"bytes": nbytes, "backend": backend}
        if getattr(e, "pset", 0):
            args["process_set"] = e.pset
        self._event(f"{e.kind} {e.name}", "backend", t0, t1, args)

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass


def find_rank_files(target: str) -> tuple[str, list[Path]]:
    """(base path, rank files) for ``target``: a timeline base path (``PATH.rank*`` exist), or a
    job folder holding ``timeline.json.rank*`` (what ``hpcring submit --timeline`` sets)."""
    p = Path(target)
    for base in ([str(p / "timeline.json")] if p.is_dir() else []) + [str(p)]:
        files = sorted(glob.glob(glob.escape(base) + ".rank*"),
                       key=lambda s: int(s.rsplit(".rank", 1)[1]) if s.rsplit(".rank", 1)[1].isdigit() else -1)
        if files:
            return base, [Path(f) for f in files]
    raise UsageError(f"no timeline files for {target}: expected {target}.rank<N> or {target}/timeline.json.rank<N>",
                     hint="run the job with HPCRING_TIMELINE=PATH (or hpcring submit --timeline)")


def merge(files: list[Path]) -> dict:
    """One Chrome-trace document from the ranks' files: one process track per rank, timestamps
    on rank 0's clock, starting at 0."""
    events, meta = [], []
    for f in files:
        lines = f.read_text().splitlines()
        if not lines:
            raise UsageError(f"{f}: empty timeline file (the rank did not start recording)")
        try:
            head = json.loads(lines[0])
            rows = [json.loads(x) for x in lines[1:] if x.strip()]
        except json.JSONDecodeError as e:
            raise UsageError(f"{f}: not a timeline file ({e})") from None
        r, off = int(head["rank"]), float(head.get("offset_us", 0.0))
        meta.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                     "args": {"name": f"rank {r} ({head.get('host', '?')})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        lanes: dict[str, int] = {}          # queued phases overlap: one lane per tensor name
        for ev in rows:
            ev["ts"] = ev["ts"] - off
            ev["pid"] = r
            ev["tid"] = lanes.setdefault(ev["name"], len(lanes) + 1) if ev.get("cat") == "queued" else 0
            events.append(ev)
    if events:
        t0 = min(ev["ts"] for ev in events)
        for ev in events:
            ev["ts"] = round(ev["ts"] - t0, 1)
    events.sort(key=lambda ev: (ev["pid"], ev["ts"]))
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"producer": "hpcring timeline", "ranks": len(files)}}
