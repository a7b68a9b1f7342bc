"""A rank's time summary: what ``hpcring report`` splits a rank's time with (one writer, one reader).

The flight recorder keeps the last 2048 collectives and writes them only when something is
dumped (a failure, SIGRTMIN+7). A finished job needs less, and all of it: at rank exit (the
watchdog's exit hook) and with every dump, each rank writes ``<job folder>/diag/summary-rank<r>.json``
(a later write replaces an earlier one), a fixed-size aggregate per communicator:

=================  ==========================================================================
version            1
rank, size, host   global rank, world size, host name
pid, written, why  the process, when this was written (epoch s), ``exit`` or ``dump: <reason>``
process_started    this process's start (epoch s, from /proc; None where there is none)
comms              one entry per communicator: ``name`` (the backend for the job's own, the
                   group's name for a group: ranks match communicators by it), ``backend``,
                   ``rank`` and ``size`` in it, ``members`` (a group's global ranks), ``totals``
                   (:class:`hpcring.collectives.recorder.Totals`: ``done``, ``failed``, ``base``,
                   ``first_started``, ``last_ended``, ``sum_started``, ``sum_inside``,
                   ``sum_failed``; sums relative to ``base``) and ``tail``: the last
                   :data:`TAIL` collectives that ended done, ``seq``, ``started`` and ``ended``
                   (seconds after ``base``, to the microsecond) and ``bytes`` (the message:
                   element count times the dtype's size; null where the dtype is not known;
                   absent in summaries of older hpcring versions, which readers accept) and
                   ``in_flight``: the starts (epoch s) of the collectives begun and not ended
                   when this was written, at most :data:`TAIL` (a dump's rank is stuck in one:
                   the report counts it as failed once the rank has ended; absent in older
                   summaries)
checkpoints        what the script noted with ``hpcring.checkpoint_saved``: ``count``,
                   ``last_step``, ``last_at`` (epoch s), ``seconds`` (time spent saving, when
                   given); absent when it noted none
=================  ==========================================================================

Size: constant however long the job runs (about 8 KiB with one communicator); cost: the totals
are a few additions per collective (in C for the short paths: a C ring record and its end took
364-373 ns before, 380-387 ns after, on this loaded 2-core machine), the file one atomic write at
exit (about 1 ms with 2048 records kept). Ranks of ``hpcring run``, ``hpcring bench`` and ranks started
by hand (no ``SUBMITIT_FOLDER``: they keep a folder only for a hang report) write it only with a
dump.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

from hpcring.collectives.dtypes import ITEMSIZE
from hpcring.fsutil import write_json

VERSION = 1
TAIL = 256
PREFIX = "summary-rank"
_NAME = re.compile(rf"{PREFIX}(\d+)\.json")


def file_name(rank: int) -> str:
    return f"{PREFIX}{rank}.json"


def process_started() -> float | None:
    """This process's start (epoch s) from /proc (None where that cannot be read)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def message_bytes(rec) -> int | None:
    """A record's message in bytes (count times its dtype's size; 0 for no elements), or None
    where the dtype is not one of hpcring's."""
    count = rec.count or 0
    if count <= 0:
        return 0
    size = ITEMSIZE.get(rec.dtype)
    return None if size is None else int(count) * size


def comm_entry(comm) -> dict:
    """The summary of one communicator (its recorder's totals and tail)."""
    rec = comm.recorder
    tot = rec.totals()
    base = tot.base
    records = rec.records()
    done = [r for r in records if r.state == "done" and r.t_ended is not None][-TAIL:]
    open_ = [r.t_started for r in records if r.state == "started" and r.t_started is not None][-TAIL:]
    entry = {"name": rec.group[0] if rec.group is not None else rec.backend, "backend": rec.backend,
             "rank": rec.rank, "size": rec.size, "totals": tot.to_dict(),
             "tail": {"seq": [r.seq for r in done],
                      "started": [round(r.t_started - base, 6) for r in done],
                      "ended": [round(r.t_ended - base, 6) for r in done],
                      "bytes": [message_bytes(r) for r in done]},
             "in_flight": [round(t, 6) for t in open_]}
    if rec.group is not None:
        entry["members"] = list(rec.group[1])
    return entry


def checkpoints() -> dict | None:
    """What the script noted with ``hpcring.checkpoint_saved`` (looked up, not imported: the
    script-facing API sits above this layer), or None."""
    mod = sys.modules.get("hpcring.preempt")
    noted = getattr(mod, "_checkpoints", None) if mod is not None else None
    return dict(noted) if noted else None


def write(folder: Path, rank: int, size: int, host: str, comms, why: str) -> Path:
    """Write this rank's summary into ``folder`` (the job's ``diag/``); returns its path."""
    data = {"version": VERSION, "rank": rank, "size": size, "host": host, "pid": os.getpid(),
            "written": time.time(), "why": why, "process_started": process_started(),
            "comms": [comm_entry(c) for c in comms]}
    noted = checkpoints()
    if noted:
        data["checkpoints"] = noted
    path = Path(folder) / file_name(rank)
    for attempt in range(3):
        # another rank's exit removes an empty diag/ (stacks.py's live files): make it again
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_json(path, data)
            return path
        except FileNotFoundError:
            if attempt == 2:
                raise
    return path


# ---- the reader ---------------------------------------------------------------------------------

class Bad(ValueError):
    """A summary file that is not one (the message says what is wrong with it)."""


def _num(d: dict, key: str, where: str, *, optional: bool = False, integer: bool = False):
    v = d.get(key)
    if v is None and optional:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
        raise Bad(f"{where}{key} is {json.dumps(v)[:40]}, not a {'whole ' if integer else ''}number")
    if v < 0 and key not in ("sum_started",):
        raise Bad(f"{where}{key} is negative ({v})")
    return v


def check(data) -> dict:
    """``data`` if it is a version-1 summary (every field :func:`write` writes, of its type); else
    :class:`Bad` naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise Bad(f"a JSON {type(data).__name__}, not an object")
    if data.get("version") != VERSION:
        raise Bad(f"version {json.dumps(data.get('version'))[:20]}, not {VERSION} (written by another hpcring?)")
    _num(data, "rank", "", integer=True)
    _num(data, "size", "", integer=True)
    _num(data, "written", "")
    _num(data, "process_started", "", optional=True)
    if not isinstance(data.get("host"), str):
        raise Bad("host is missing")
    comms = data.get("comms")
    if not isinstance(comms, list):
        raise Bad("comms is missing")
    for i, c in enumerate(comms):
        where = f"comms[{i}]."
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise Bad(f"{where}name is missing")
        t = c.get("totals")
        if not isinstance(t, dict):
            raise Bad(f"{where}totals is missing")
        for k in ("done", "failed"):
            _num(t, k, where + "totals.", integer=True)
        for k in ("base", "first_started", "last_ended", "sum_started", "sum_inside", "sum_failed"):
            _num(t, k, where + "totals.")
        tail = c.get("tail")
        if not isinstance(tail, dict) or not all(isinstance(tail.get(k), list) for k in ("seq", "started", "ended")):
            raise Bad(f"{where}tail is missing")
        if not len(tail["seq"]) == len(tail["started"]) == len(tail["ended"]) <= TAIL:
            raise Bad(f"{where}tail's lists differ in length or hold more than {TAIL}")
        for k in ("seq", "started", "ended"):
            for v in tail[k]:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                    raise Bad(f"{where}tail.{k} holds {json.dumps(v)[:40]}")
        sizes = tail.get("bytes")          # optional: summaries of older versions have none
        if sizes is not None:
            if not isinstance(sizes, list) or len(sizes) != len(tail["seq"]):
                raise Bad(f"{where}tail.bytes is not a list as long as tail.seq")
            for v in sizes:
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                    raise Bad(f"{where}tail.bytes holds {json.dumps(v)[:40]}")
        open_ = c.get("in_flight")         # optional: summaries of older versions have none
        if open_ is not None:
            if not isinstance(open_, list) or len(open_) > TAIL:
                raise Bad(f"{where}in_flight is not a list of at most {TAIL} starts")
            for v in open_:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    raise Bad(f"{where}in_flight holds {json.dumps(v)[:40]}")
    cp = data.get("checkpoints")
    if cp is not None:
        if not isinstance(cp, dict):
            raise Bad("checkpoints is not an object")
        _num(cp, "count", "checkpoints.", integer=True)
        _num(cp, "last_at", "checkpoints.", optional=True)
        _num(cp, "seconds", "checkpoints.", optional=True)
    return data


def read_dir(diag: Path) -> tuple[dict[int, dict], list[str]]:
    """({rank: summary}, problems) from a job's ``diag/`` folder: a file that cannot be read, is
    no JSON or no summary is a problem naming it and what is wrong, and is left out."""
    out, problems = {}, []
    try:
        names = sorted(os.listdir(diag))
    except FileNotFoundError:
        return {}, []
    except OSError as exc:
        return {}, [f"{diag}: cannot be listed: {exc.strerror or exc}"]
    for name in names:
        m = _NAME.fullmatch(name)
        if not m:
            continue
        path = Path(diag) / name
        try:
            data = check(json.loads(path.read_text()))
        except OSError as exc:
            problems.append(f"{path}: cannot be read: {exc.strerror or exc}")
            continue
        except UnicodeDecodeError:
            problems.append(f"{path}: not text (corrupt)")
            continue
        except Bad as exc:
            problems.append(f"{path}: not a rank summary: {exc}")
            continue
        except ValueError as exc:
            problems.append(f"{path}: not JSON (truncated or corrupt): {exc}")
            continue
        if data["rank"] != int(m.group(1)):
            problems.append(f"{path}: holds rank {data['rank']}, not rank {m.group(1)}")
            continue
        out[data["rank"]] = data
    return out, problems
