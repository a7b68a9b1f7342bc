"""hpcring's flight records in torch's Flight Recorder format, for torch's analyzer ``torchfrtrace``.

Wherever the watchdog dumps a rank's flight records (a failure, a timeout, SIGRTMIN+7, a rank that
raised), it also writes ``<job folder>/diag/fr-trace/fr_trace_rank_<r>``: one pickle per rank, as
torch's ``_dump_fr_trace`` writes it for NCCL (``HPCRING_FR_TRACE=0`` turns it off). Then

    torchfrtrace <job folder>/diag/fr-trace          # torch >= 2.5, installed with torch
    python -m hpcring.diagnostics.fr_trace FOLDER    # the same, after checking the dumps

match the ranks' collectives as torch's tool does for NCCL jobs (``Not all ranks joining
collective, sequence number: 4 ... missing ranks: {2}``).

What torch 2.13's reader (``torch/distributed/flight_recorder/components``: loader.py,
builder.py, types.py, utils.py) requires, and where each value comes from:

* a file per rank named ``<prefix><rank>`` (the rank is what follows the prefix; torchfrtrace
  infers the prefix when every file in the folder ends in digits the same way), a pickle of
  ``{"version": "2.10", "pg_config": {...}, "entries": [...]}`` (plus ``pg_status``);
* ``pg_config``: ``{pg name: {"name", "desc", "ranks": "[0, 1, 2]"}}``; a name must mean the
  same members and description on every rank. The job's first communicator is ``"0"``
  (``default_pg``, as torch names the default group), a later job-wide one ``"1"``, ``"2"``...
  in the order the ranks made them; a group (``session.group``, torch ``new_group`` on the
  ``hpcring`` backend) keeps its name (``group 1 of ranks 0,2``) and global members;
* an entry per collective (:func:`to_entry`): ``record_id`` (this rank's count over all its
  communicators; torchfrtrace aligns ranks on it), ``collective_seq_id`` (the communicator's
  sequence number: the ``#4`` of hpcring's report), ``profiling_name`` (``<backend>:<op>``, both
  from torchfrtrace's fixed lists: see :data:`OPS` and :func:`profiling_backend`), sizes and
  dtypes, ``state`` and the times, ``frames`` (the call site).

What has no equivalent (also in docs/diagnostics.md): hpcring records an element count, not a
shape, so sizes are flat (``[[65536]]``); the backend prefix is ``gloo`` for the ring and MPI
(torchfrtrace knows no other host backend) and ``nccl`` for NCCL; a failed collective is
``started`` (torch has no failed state; ``retired`` is False); a broadcast's root, the error, the
real backend and op are in an extra ``hpcring`` dict per entry, which torchfrtrace ignores;
``frames`` holds the one frame hpcring keeps (the user's call site); thread name and id, and
NCCL's ``duration_ms``, are not recorded; point-to-point messages are not in the dump.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
from pathlib import Path

from hpcring.errors import HpcringError
from hpcring.config import envvars
from hpcring.ranks import rank_ranges

FOLDER = "fr-trace"              # <job folder>/diag/fr-trace
PREFIX = "fr_trace_rank_"        # one file per rank: fr_trace_rank_<r>
VERSION = "2.10"                 # what torch 2.13's _dump_fr_trace writes; torchfrtrace reads "major.minor"
ENABLE_ENV = "HPCRING_FR_TRACE"

# hpcring's op -> torch's op type (torchfrtrace refuses a type outside its COLLECTIVES/P2P sets)
OPS = {"allreduce": "all_reduce", "allreduce_grouped": "allreduce_coalesced", "allgather": "all_gather",
       "broadcast": "broadcast", "reduce": "reduce", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
       "barrier": "barrier"}
# hpcring's (numpy's) dtype names <-> the c10 ScalarType names torch's Flight Recorder writes
DTYPE_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int32": "Int",
               "int64": "Long", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool"}
FROM_TORCH_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}
# torch's entry states: hpcring's queued/started/done/failed
STATES = {"queued": "scheduled", "started": "started", "done": "completed", "failed": "started"}
# what torchfrtrace reads of a dump and of each entry (torch 2.13: loader.read_dump, EntryState, Op)
DUMP_KEYS = ("version", "pg_config", "entries")
ENTRY_KEYS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "time_created_ns",
              "input_sizes", "output_sizes", "input_dtypes", "output_dtypes", "state", "is_p2p")


def enabled(environ=None) -> bool:
    """HPCRING_FR_TRACE (a bad value leaves it on: a diagnostics switch never fails the job)."""
    try:
        return envvars.get(ENABLE_ENV, environ)
    except HpcringError:
        return True


def profiling_backend(backend: str) -> str:
    """The ``<backend>:`` of ``profiling_name``: torchfrtrace accepts only its own list (nccl, gloo,
    ...), so the host backends (ring, MPI) are written as gloo, torch's host backend."""
    return "nccl" if backend == "nccl" else "gloo"


def _ns(t) -> int | None:
    return None if t is None else int(t * 1e9)


def _frames(site) -> list[dict]:
    """torch's ``frames`` (innermost first) from a record's call site: a (file, line, function)
    tuple, or hpcring's ``file:line in function`` text."""
    if isinstance(site, tuple) and len(site) == 3:
        return [{"name": str(site[2]), "filename": str(site[0]), "line": int(site[1])}]
    if isinstance(site, str) and " in " in site:
        where, _, func = site.partition(" in ")
        file, _, line = where.rpartition(":")
        if file and line.isdigit():
            return [{"name": func, "filename": file, "line": int(line)}]
    return []


def _sizes(op: str, count: int, size: int, rank: int) -> tuple[str, list, list]:
    """(torch op type, input_sizes, output_sizes) for ``count`` elements on ``size`` ranks."""
    kind = OPS[op]
    n = int(count or 0)
    if kind == "barrier":
        return kind, [], []
    if kind == "all_gather":
        return kind, [[n]], [[size, n]]
    if kind == "reduce_scatter":
        if size and n % size == 0:
            return kind, [[n]], [[n // size]]
        # uneven shares: the _v variant, with every rank's share (the same list on every rank)
        return "reduce_scatter_v", [[n]], [[n // size + (r < n % size)] for r in range(size)]
    return kind, [[n]], [[n]]


def to_entry(rec, record_id: int, pg: tuple[str, str], pg_id: int, size: int, rank: int, backend: str) -> dict | None:
    """One flight record (a :class:`~hpcring.collectives.recorder.Record` or its ``to_dict()``) as
    a Flight Recorder entry of process group ``pg`` (name, desc) on ``size`` ranks; None for an
    op torchfrtrace has no type for."""
    d = rec.to_dict() if hasattr(rec, "to_dict") else dict(rec)
    site = getattr(rec, "_site", d.get("site"))
    op = d.get("op")
    if op not in OPS:
        return None
    kind, ins, outs = _sizes(op, d.get("count") or 0, size, rank)
    tags = [t for t in str(d.get("dtype") or "").split("+") if t]
    dtypes = [DTYPE_NAMES.get(t, t) for t in tags] if ins else []
    state = d.get("state") or "queued"
    seq = int(d.get("seq") or 0)
    # what torch's entry cannot say: hpcring's op and state, the real backend, a root, the error
    extra = {"op": op, "state": state, "backend": d.get("backend") or backend, "root": d.get("root"),
             "error": d.get("error"), "time_ended_ns": _ns(d.get("t_ended"))}
    return {"frames": _frames(site), "record_id": record_id, "pg_id": pg_id, "process_group": pg,
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"{profiling_backend(d.get('backend') or backend)}:{kind}",
            "time_created_ns": _ns(d.get("t_queued")) or 0, "input_sizes": ins, "input_dtypes": dtypes,
            "output_sizes": outs, "output_dtypes": list(dtypes), "state": STATES.get(state, "scheduled"),
            "time_discovered_started_ns": _ns(d.get("t_started")) if state != "queued" else None,
            "time_discovered_completed_ns": _ns(d.get("t_ended")) if state == "done" else None,
            "retired": state == "done", "timeout_ms": int(float(d.get("timeout") or 0) * 1000),
            "is_p2p": False, "hpcring": extra}


def _pg_of(recorder, world_index: int) -> tuple[str, str, list[int]]:
    """(name, desc, global ranks) of a recorder's process group (see the module doc)."""
    group = getattr(recorder, "group", None)
    if group is not None:
        return str(group[0]), "undefined", sorted(int(r) for r in group[1])
    return str(world_index), "default_pg" if world_index == 0 else f"{recorder.backend} communicator", \
        list(range(int(recorder.size)))


def rank_dump(comms, rank: int, *, host: str = "", reason: str = "") -> dict:
    """This rank's dump: every communicator's records (``comms``: what the watchdog watches,
    each with a ``recorder``) in one Flight Recorder dict. A communicator whose recorder is
    torch's own (``fr_trace_dump()``: :mod:`torch_watch`) brings torch's dump as it is, and
    hpcring's process groups are then named ``hpcring:<name>`` beside torch's."""
    base = None
    recorders = []
    for comm in comms:
        rec = getattr(comm, "recorder", comm)
        own = getattr(rec, "fr_trace_dump", None)
        if own is not None:
            if base is None:
                base = own()
            continue
        recorders.append(rec)
    dump = base or {"version": VERSION, "pg_config": {}, "pg_status": {}, "comm_lib_version": "", "entries": []}
    dump.setdefault("pg_status", {})
    prefix = "hpcring:" if base else ""
    records, total, world = [], 0, 0
    for pg_id, rec in enumerate(recorders):
        name, desc, members = _pg_of(rec, world)
        if getattr(rec, "group", None) is None:
            world += 1
        name = prefix + name
        dump["pg_config"][name] = {"name": name, "desc": desc, "ranks": str(members)}
        kept = rec.records()
        total += int(rec.seq)
        started = [r.seq for r in kept if r.state != "queued"]
        dump["pg_status"][name] = {"last_enqueued_collective": int(rec.seq),
                                   "last_started_collective": max(started, default=-1),
                                   "last_completed_collective": rec.last_done()}
        records += [(r.t_queued or 0.0, pg_id, r, (name, desc), rec) for r in kept]
    # record ids count every collective of this rank, oldest kept first: torchfrtrace starts
    # every rank at the newest first id so that ranks whose rings overwrote more still line up
    records.sort(key=lambda x: (x[0], x[1], x[2].seq))
    first = max(0, total - len(records)) + len(dump["entries"])
    for i, (_, pg_id, r, pg, rec) in enumerate(records):
        e = to_entry(r, first + i, pg, pg_id, int(rec.size), int(rec.rank), rec.backend)
        if e is not None:
            dump["entries"].append(e)
    dump["hpcring"] = {"rank": rank, "host": host or os.uname().nodename, "pid": os.getpid(), "reason": reason}
    return dump


def path_for(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"{PREFIX}{rank}"


def write(folder: str | os.PathLike, rank: int, comms, *, host: str = "", reason: str = "") -> Path:
    """Write :func:`rank_dump` to ``<folder>/fr_trace_rank_<rank>`` atomically (the temporary
    file's name neither ends in a digit nor holds the prefix: a reader that lists the folder
    meanwhile infers the same prefix); returns the path. Raises OSError."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = pickle.dumps(rank_dump(comms, rank, host=host, reason=reason), protocol=4)
    path = path_for(folder, rank)
    tmp = folder / f".writing-{os.getpid()}-{rank}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# reading (hpcring's own checks before torchfrtrace's)
# ---------------------------------------------------------------------------------------------
class FrTraceError(HpcringError):
    """A dump folder torchfrtrace cannot read: missing, empty, a corrupt or foreign file."""


class _Plain(pickle.Unpickler):
    """Builtins only: a Flight Recorder dump is dicts, lists, tuples, text and numbers, and a
    pickle that names any class or function is refused (unpickling one runs code)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a Flight Recorder dump never does")


def load(path: str | os.PathLike) -> dict:
    """One rank's dump, checked: FrTraceError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FrTraceError(f"{path}: cannot read it: {e.strerror or e}") from None
    if not data:
        raise FrTraceError(f"{path}: empty file (a rank stopped while writing it?)")
    try:
        dump = _Plain(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any way a pickle can be bad
        raise FrTraceError(f"{path}: not a Flight Recorder dump: {type(e).__name__}: {e}") from None
    if not isinstance(dump, dict) or not all(k in dump for k in DUMP_KEYS):
        have = sorted(map(str, dump)) if isinstance(dump, dict) else type(dump).__name__
        raise FrTraceError(f"{path}: not a Flight Recorder dump: needs {', '.join(DUMP_KEYS)}; has {have}")
    for i, e in enumerate(dump["entries"]):
        missing = [k for k in ENTRY_KEYS if not isinstance(e, dict) or k not in e]
        if missing:
            raise FrTraceError(f"{path}: entry {i} lacks {', '.join(missing)}")
    return dump


def find_folder(path: str | os.PathLike) -> Path:
    """The dump folder for ``path``: itself, or ``<path>/fr-trace``, ``<path>/diag/fr-trace``
    (a job folder or its diag folder). FrTraceError when there is none."""
    p = Path(path)
    for cand in (p, p / FOLDER, p / "diag" / FOLDER):
        if cand.is_dir() and any(f.name.startswith(PREFIX) for f in cand.iterdir()):
            return cand
    if not p.exists():
        raise FrTraceError(f"{p}: no such folder",
                           hint="the dumps are in <job folder>/diag/fr-trace (written when a collective fails, "
                                "a rank raises, or on SIGRTMIN+7)")
    if not p.is_dir():
        raise FrTraceError(f"{p}: not a folder", hint="give the folder of the dumps, <job folder>/diag/fr-trace")
    raise FrTraceError(f"{p}: no Flight Recorder dumps ({PREFIX}<rank>) here, in {FOLDER}/ or in diag/{FOLDER}/",
                       hint="none is written before a failure; HPCRING_FR_TRACE=0 turns them off")


def read_dir(path: str | os.PathLike) -> tuple[Path, dict[int, dict], list[int]]:
    """(folder, {rank: dump}, ranks without a dump): every ``fr_trace_rank_<r>`` checked; a
    corrupt one, a rank's second file or dumps of different versions are FrTraceError."""
    folder = find_folder(path)
    dumps: dict[int, dict] = {}
    for f in sorted(folder.iterdir()):
        if not f.name.startswith(PREFIX):
            continue
        tail = f.name[len(PREFIX):]
        if not tail.isdigit():
            raise FrTraceError(f"{f}: a file named like a dump that is not {PREFIX}<rank> (torchfrtrace "
                               "reads the rank from the name)", hint="move it out of the folder")
        dumps[int(tail)] = load(f)
    versions = {str(d["version"]) for d in dumps.values()}
    if len(versions) > 1:
        raise FrTraceError(f"{folder}: dumps of different format versions ({', '.join(sorted(versions))}): "
                           "torchfrtrace reads one at a time")
    members: set[int] = set()
    for d in dumps.values():
        for pg in d["pg_config"].values():
            try:
                members.update(int(r) for r in str(pg.get("ranks", "[]")).strip("[]").split(",") if r.strip())
            except (AttributeError, ValueError):
                raise FrTraceError(f"{folder}: a dump's pg_config has ranks {pg!r}, not a list of ranks") from None
    return folder, dumps, sorted(members - set(dumps))


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcring.diagnostics.fr_trace FOLDER [torchfrtrace options]``: check the dumps
    (a clear message for a missing folder, a corrupt file, a rank without a dump), then run
    torchfrtrace on them (``--allow-incomplete-ranks`` added when a rank left no dump)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m hpcring.diagnostics.fr_trace FOLDER [torchfrtrace options]\n"
              "  FOLDER: <job folder>/diag/fr-trace, or the job folder", file=sys.stderr)
        return 2
    try:
        folder, dumps, missing = read_dir(argv[0])
    except FrTraceError as e:
        print(f"hpcring: {e}", file=sys.stderr)
        return 1
    rest = argv[1:]
    print(f"hpcring: {len(dumps)} Flight Recorder dump(s) in {folder} (ranks {rank_ranges(sorted(dumps))})",
          file=sys.stderr, flush=True)
    if missing:
        print(f"hpcring: no dump from ranks {rank_ranges(missing)} (gone before it could write one: killed, "
              "or its host is down); analysing the others with --allow-incomplete-ranks", file=sys.stderr, flush=True)
        if "--allow-incomplete-ranks" not in rest:
            rest.append("--allow-incomplete-ranks")
    try:
        from torch.distributed.flight_recorder.fr_trace import main as torchfrtrace
    except ImportError as e:
        print(f"hpcring: torchfrtrace is not available here ({e}); it comes with torch >= 2.5 "
              "(pip install torch)", file=sys.stderr)
        return 1
    try:
        torchfrtrace([str(folder), "--prefix", PREFIX, *rest])
    except SystemExit as e:          # -j prints and exits
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:  # noqa: BLE001 - torch's analyzer stops on what it cannot match
        print(f"hpcring: torchfrtrace stopped: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
