"""Hang reports for jobs on torch's own process groups (gloo, NCCL).

torch's collectives do not go through hpcring, so hpcring's flight recorder never sees them. What
this module adds to a rank that calls ``torch.distributed.init_process_group`` inside an hpcring
job (``hpcring submit``: in the rank process; ``hpcring run``: in CMD's Python, through
``hpcring/rank_site/sitecustomize.py``):

1. **The deadline.** Without ``timeout=``, the process group's collectives get hpcring's deadline
   (``HPCRING_TIMEOUT``, else 300 s) instead of torch's default (30 min for gloo, 10 min for NCCL,
   ``torch/distributed/constants.py``); torch's rendezvous keeps the bootstrap's bound
   (``HPCRING_INIT_TIMEOUT``, else 60 s, when longer), then ``_set_pg_timeout`` applies the deadline. NCCL gets deadline + grace + 30 s: torch's NCCL watchdog
   kills the process on its timeout, which must come after hpcring's report.
2. **torch's Flight Recorder** (``torch._C._distributed_c10d._dump_fr_trace``, on by default in
   torch >= 2.8, gloo included) is hpcring's record of the torch collectives, DDP's bucket
   allreduces in C++ included: sequence id, op, sizes, dtypes, retired or not. Its default group's
   entries become hpcring flight records (the same dicts), so the hang report's rules
   (:func:`hpcring.diagnostics.report.diagnose`) name the rank that never joined.
3. **Triggers.** A monitor thread polls the recorder: a collective of the default group still in
   flight after the deadline (hpcring's, or the script's ``timeout=``) triggers hpcring's watchdog (:meth:`Watchdog.trigger`). So does a
   torch distributed error escaping the script (gloo's timeout RuntimeError, "Connection closed by
   peer", ``DistError``). Every rank then dumps stacks and records, one reporter prints the report,
   every rank exits 1.
4. **Dead ranks.** A rank without a snapshot is dead when a peer's torch error says its connection
   was closed or reset, else unreachable (stopped, host down, link cut).

Limits: only the default process group's collectives are matched (other groups' entries are in
the dump); p2p ops are not; NCCL is implemented from torch's documented variables but untested
here (no GPU). ``HPCRING_TORCH_WATCH=0`` turns all of this off.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import math
import os
import pickle
import re
import sys
import threading
import time
from datetime import timedelta

from hpcring import jobdir
from hpcring.diagnostics.fr_trace import FROM_TORCH_DTYPE
from hpcring.diagnostics.report import Report, _headline, diagnose
from hpcring.ranks import who as _who
import hpcring
from hpcring.config import envvars
from hpcring.errors import UsageError

ENABLE_ENV = "HPCRING_TORCH_WATCH"
FR_SIZE = "256"        # entries; each poll dumps them all with the GIL held (torch's 2000: ~6x longer)
NCCL_MARGIN = 30.0     # seconds after hpcring's report before torch's NCCL watchdog may abort
_TORCH_ERR = re.compile(r"gloo|nccl|c10d|ProcessGroup|Connection closed by peer|Timed out waiting", re.I)
_GONE = re.compile(r"closed by peer|Connection reset|reset by peer|Broken pipe|remote worker crash", re.I)
_IN_TORCH = tuple(f"{os.sep}torch{os.sep}{p}" for p in ("distributed", "nn" + os.sep + "parallel", "autograd",
                                                        "_tensor.py"))
_STATE: dict = {"watch": None, "installed": False}


def enabled(environ=None) -> bool:
    """HPCRING_TORCH_WATCH; a bad value is reported (once a process) and leaves the watch on:
    a diagnostics switch must not fail the job."""
    try:
        return envvars.get(ENABLE_ENV, environ)
    except UsageError as e:
        if not _STATE.get("warned"):
            _STATE["warned"] = True
            print(f"hpcring: {e}; the torch watch stays on", file=sys.stderr)
        return True


def fr_env(environ=None) -> dict[str, str]:
    """torch variables to set before torch starts (only those the user did not set): a Flight
    Recorder small enough to poll, and NCCL's own dump on timeout into ``<job folder>/diag``."""
    env = os.environ if environ is None else environ
    out = {}
    if not env.get("TORCH_FR_BUFFER_SIZE") and not env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        out["TORCH_FR_BUFFER_SIZE"] = FR_SIZE
    if not env.get("TORCH_NCCL_DUMP_ON_TIMEOUT"):
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if not env.get("TORCH_FR_DUMP_TEMP_FILE") and not env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        prefix = str(jobdir.diag_dir(env, create=False) / "torch-fr-rank")   # torch appends the rank
        out["TORCH_FR_DUMP_TEMP_FILE"] = out["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = prefix
    return out


def pg_timeout(backend) -> timedelta:
    """The process group's timeout when the script gives none: hpcring's deadline (NCCL: plus
    grace and a margin, so that hpcring reports before torch's NCCL watchdog aborts)."""
    from hpcring.diagnostics.watchdog import grace_default  # deferred: pulls numpy (watchdog -> collectives)
    deadline = envvars.collective_timeout()
    if backend is None or "nccl" in str(backend).lower():      # None: torch picks NCCL for CUDA
        deadline += grace_default() + NCCL_MARGIN
    return timedelta(seconds=deadline)


# ---------------------------------------------------------------------------------------------
# installing: wrap init_process_group once torch.distributed is imported
# ---------------------------------------------------------------------------------------------
def install() -> bool:
    """Watch the torch process group this process will create (idempotent; cheap when the
    script never imports torch.distributed). Returns False when turned off."""
    if not enabled() or _STATE["installed"]:
        return _STATE["installed"]
    _STATE["installed"] = True
    for k, v in fr_env().items():
        os.environ.setdefault(k, v)
    if "torch.distributed" in sys.modules:
        _patch(sys.modules["torch.distributed"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch.distributed", _patch))
    return True


def _hook_excepthook() -> None:
    """Outermost sys.excepthook (over torch's, which redirects stderr while it prints): print
    the traceback as before, then :func:`on_error`."""
    previous = sys.excepthook

    def excepthook(kind, exc, tb):
        _note(exc)              # first: a report triggered by another rank meanwhile says where it was raised
        previous(kind, exc, tb)
        on_error(exc)

    sys.excepthook = excepthook


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``fn(module)`` right after ``name`` is imported (before the importer sees it)."""

    def __init__(self, name: str, fn) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, fn = spec.loader.exec_module, self.fn

        def run(module):
            exec_module(module)
            fn(module)

        spec.loader.exec_module = run
        return spec


def _patch(dist) -> None:
    original = getattr(dist, "init_process_group", None)
    if original is None or getattr(original, "_hpcring", False):
        return

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        if _only_hpcring(backend):           # hpcring's own collectives: they report already
            return original(*args, **kwargs)
        given = kwargs.get("timeout") if kwargs.get("timeout") is not None else (args[2] if len(args) >= 3 else None)
        ours = given is None
        if ours:
            # torch bounds its rendezvous with the same timeout: ranks importing torch at
            # different speeds need the bootstrap's bound there, the deadline only afterwards
            deadline = pg_timeout(backend)
            kwargs["timeout"] = max(deadline, timedelta(seconds=_init_timeout()))
        result = original(*args, **kwargs)
        try:
            if ours:
                dist.distributed_c10d._set_pg_timeout(deadline)
            # the monitor's deadline: hpcring's, or the one the script chose for its group
            _start(dist, None if ours else given.total_seconds())
            _hook_excepthook()
        except Exception as e:  # noqa: BLE001 - diagnostics must never stop training
            print(f"hpcring: torch hang watch not started: {e}", file=sys.stderr)
        return result

    init_process_group._hpcring = True
    init_process_group.__wrapped__ = original
    init_process_group.__doc__ = original.__doc__
    dist.init_process_group = init_process_group
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None and c10d.init_process_group is original:
        c10d.init_process_group = init_process_group


def _only_hpcring(backend) -> bool:
    """``"hpcring"`` or ``"cpu:hpcring,cuda:hpcring"`` (:mod:`hpcring.distributed`)."""
    if not backend:
        return False
    names = {part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")}
    return names == {"hpcring"}


def _init_timeout() -> float:
    """HPCRING_INIT_TIMEOUT as hpcring's bootstrap reads it (a bad value: the default; the
    bootstrap has already said so)."""
    try:
        return envvars.get("HPCRING_INIT_TIMEOUT")
    except UsageError:
        return envvars.DEFAULT_INIT_TIMEOUT


def _start(dist, deadline: float | None) -> None:
    if _STATE["watch"] is not None:
        return
    # hpcring.init() here may be the first one in CMD's process (hpcring run); it leaves SIGUSR1
    # (Lightning's SLURM requeue) alone: its dump signal is SIGRTMIN+7
    session = hpcring.init()
    wd = session.watchdog
    if wd is None:                      # HPCRING_WATCHDOG=0
        return
    pg = dist.distributed_c10d._get_default_group()
    backend = str(dist.get_backend(pg))
    if "nccl" in backend:
        jobdir.diag_dir()               # NCCL's own dump on timeout goes there (fr_env)
    watch = TorchWatch(wd, pg.group_name, backend, deadline)
    _STATE["watch"] = watch
    wd.register(watch)
    wd.diagnose = diagnose_torch
    wd.where = watch.where
    watch.start()


def on_error(exc: BaseException) -> None:
    """The script raised ``exc`` on this rank: when it is a torch distributed error and a watch
    runs, trigger the job-wide report (with ``HPCRING_ON_FAILURE=abort`` this does not return);
    any other exception is this rank's end: its flight records are written now and its exit
    record names what it raised (:func:`hpcring.diagnostics.watchdog.note_raised`)."""
    watch = _note(exc)
    if watch is not None:
        watch.fire(watch.error)
        return
    from hpcring.diagnostics.watchdog import note_raised  # deferred: pulls numpy (watchdog -> collectives)
    note_raised(exc)


def _note(exc: BaseException):
    """Record a torch distributed error and where it was raised on the running watch (what this
    rank's snapshot says); returns the watch, or None when there is none or ``exc`` is not one."""
    watch = _STATE["watch"]
    if watch is None or not is_torch_error(exc):
        return None
    watch.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if frames:
        watch.failed_at = f"raised {type(exc).__name__} {locate_torch(frames[-1], frames[::-1])}"
    return watch


def is_torch_error(exc: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and bool(_TORCH_ERR.search(str(exc)))


# ---------------------------------------------------------------------------------------------
# torch's Flight Recorder as an hpcring communicator (what Watchdog.snapshot/dump read)
# ---------------------------------------------------------------------------------------------
def fr_dump(stack_traces: bool = False) -> dict:
    """torch's Flight Recorder, every group ({} when unavailable); ``stack_traces``: with each
    entry's Python frames (for the dump in torch's format; the monitor's polls go without)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
        return pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=stack_traces,
                                           onlyActive=False))
    except Exception:  # noqa: BLE001 - an older torch, or a recorder turned off
        return {}


def pg_config() -> dict:
    """torch's process groups as the Flight Recorder's ``pg_config`` ({name: name, desc, global
    ranks}): gloo's dump leaves it empty, and torchfrtrace cannot match entries without it."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    out: dict = {}
    if c10d is None:
        return out
    world = c10d._world
    for pg, ranks in dict(world.pg_group_ranks).items():
        name = world.pg_names.get(pg) or getattr(pg, "group_name", "")
        desc = getattr(pg, "group_desc", None) or "undefined"
        out[str(name)] = {"name": str(name), "desc": str(desc), "ranks": str(sorted(int(r) for r in ranks))}
    return out


def to_record(entry: dict, deadline: float | None = None) -> dict:
    """One Flight Recorder entry -> an hpcring flight record dict (Record.to_dict's keys, plus
    ``torch_timeout``); ``timeout`` is ``deadline`` (the monitor's) when given, else torch's."""
    name = str(entry.get("profiling_name") or "?")
    backend, _, op = name.rpartition(":")
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    created = (entry.get("time_created_ns") or 0) / 1e9
    done = (entry.get("time_discovered_completed_ns") or 0) / 1e9 or None
    dtype = FROM_TORCH_DTYPE.get(dtypes[0], dtypes[0]) if dtypes else None
    return {"seq": entry.get("collective_seq_id"), "op": op, "dtype": dtype,
            "count": sum(math.prod(s) for s in sizes), "root": None, "backend": backend or "torch",
            "timeout": deadline or (entry.get("timeout_ms") or 0) / 1000, "site": "?",
            "state": "done" if entry.get("retired") else "started", "t_queued": created, "t_started": created,
            "t_ended": done, "error": None, "torch_timeout": (entry.get("timeout_ms") or 0) / 1000}


class _Rec(dict):
    def to_dict(self) -> dict:
        return dict(self)


class TorchWatch:
    """Duck-types a Communicator for the watchdog (``recorder``, ``error``) over torch's
    Flight Recorder for the default group, and runs the deadline monitor."""

    def __init__(self, watchdog, group: str, backend: str, deadline: float | None = None) -> None:
        self.watchdog, self.group, self.name = watchdog, group, backend
        self.deadline = envvars.collective_timeout() if deadline is None else deadline   # the script's own: torch's
        self.error: str | None = None
        self.failed_at: str | None = None              # where the torch error was raised here
        self.recorder = self                          # the watchdog reads comm.recorder / comm.error
        self._fired = threading.Event()

    # recorder interface -------------------------------------------------------------------
    def entries(self, dump: dict | None = None) -> list[dict]:
        dump = fr_dump() if dump is None else dump
        return [e for e in dump.get("entries", [])
                if (e.get("process_group") or ("",))[0] == self.group and not e.get("is_p2p")]

    def records(self, n: int = 16) -> list[_Rec]:
        recs = [_Rec(to_record(e, self.deadline)) for e in self.entries()[-n:]]
        where = self.where()
        if recs and " torch " in f" {where}":     # the rank waits in (or failed in) a torch call
            open_ = [r for r in recs if r["state"] != "done"] or recs[-1:]
            open_[0]["site"] = where.split(" at ", 1)[-1]
        return recs

    def last_done(self) -> int:
        return max((e.get("collective_seq_id") or 0 for e in self.entries() if e.get("retired")), default=0)

    def dump(self, path, extra: dict | None = None) -> None:
        import json
        raw = fr_dump()
        data = {"rank": self.watchdog.rank, "source": f"torch Flight Recorder ({self.name}, default group)",
                **(extra or {}), "error": self.error,
                "records": [to_record(e, self.deadline) for e in self.entries(raw)],
                "torch": {k: v for k, v in raw.items() if k != "entries"}}
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)

    def fr_trace_dump(self) -> dict | None:
        """torch's own dump, every group, with Python frames, in its own format (for
        :mod:`hpcring.diagnostics.fr_trace`); ``pg_config`` completed where torch leaves a group
        of its entries out (gloo writes one nameless group). None when torch has no recorder."""
        raw = fr_dump(stack_traces=True)
        if not raw:
            return None
        config = raw.setdefault("pg_config", {})
        named = {str((e.get("process_group") or ("",))[0]) for e in raw.get("entries", [])}
        if named - set(config):
            for name, pg in pg_config().items():
                config.setdefault(name, pg)
        return raw

    def where(self) -> str:
        """The main thread's location for the snapshot (torch-aware, see :func:`locate_torch`)."""
        if self.failed_at:
            return self.failed_at
        frame = sys._current_frames().get(threading.main_thread().ident)
        return "?" if frame is None else locate_torch(frame)

    # the deadline -------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._monitor, name="hpcring-torch-watch", daemon=True).start()

    def _monitor(self) -> None:
        import torch.distributed as dist
        every = min(10.0, max(0.5, self.deadline / 10))
        while not self._fired.is_set():
            time.sleep(every)
            if not dist.is_initialized():
                return
            now = time.time()
            late = [e for e in self.entries() if not e.get("retired")
                    and now - (e.get("time_created_ns") or now * 1e9) / 1e9 > self.deadline]
            if late:
                rec = to_record(late[0], self.deadline)
                self.fire(f"torch {rec['backend']} {rec['op']}#{rec['seq']} (default group) still in flight "
                          f"after {now - rec['t_queued']:.1f} s (deadline {self.deadline:g} s)", rec)
                return

    def fire(self, error: str, op: dict | None = None) -> None:
        """Trigger the watchdog and wait for its report (the store keeps the first trigger of the
        job). Every caller waits: a main thread that returned here while the monitor's report
        is being made would end the process (uncaught exception) with no report."""
        self._fired.set()
        if op is None:
            entries = self.entries()
            live = [e for e in entries if not e.get("retired")] or entries[-1:]
            op = to_record(live[0], self.deadline) if live else None
        self.watchdog.trigger(error, op)


def locate_torch(frame, frames=None) -> str:
    """Like :func:`hpcring.diagnostics.stacks.where`, naming the torch call the user's frame is
    in: ``in torch backward at train.py:48 (main)``, ``in torch all_reduce at train.py:60 (sync)``.
    ``frames``: the stack innermost first (default: from ``frame`` outwards)."""
    from hpcring.diagnostics.stacks import Frame, _is_user, locate  # deferred: stacks (~5 ms) off the CMD's start (rank_site)
    if frames is None:
        frames, f = [], frame
        while f is not None and len(frames) < 200:
            frames.append(f)
            f = f.f_back
    stack = [Frame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in frames]
    idx = next((i for i, f in enumerate(stack) if _is_user(f.file)), None)
    torch = [f for f in stack[:idx] if any(p in f.file for p in _IN_TORCH)]
    if idx is None or not torch:
        return locate(stack)
    c10d = [f.func for f in torch if f.file.endswith("distributed_c10d.py") and not f.func.startswith("_")]
    api = c10d[-1] if c10d else next((f.func for f in reversed(torch) if not f.func.startswith("_")), torch[-1].func)
    user = stack[idx]
    return f"in torch {api} at {os.path.basename(user.file)}:{user.line} ({user.func})"


# ---------------------------------------------------------------------------------------------
# the verdict
# ---------------------------------------------------------------------------------------------
def diagnose_torch(size: int, hosts: list[str], snaps: dict[int, dict], exits: dict[int, dict] | None = None,
                   trigger: dict | None = None, **kw) -> Report:
    """:func:`diagnose`, plus two torch facts: a rank inside the torch call that issues the
    collective (DDP's backward) without a record of it yet is joining, not missing; and a silent
    rank whose peers' torch error says a connection was closed or reset is dead, not unreachable."""
    report = diagnose(size, hosts, snaps, exits, trigger, **kw)
    if not report.side_channel:          # one rank's own view: diagnose's headline stands
        return report
    cats = report.categories
    # DDP issues its bucket allreduces from inside backward: a rank in that torch call with no
    # record yet is on its way in (seen when a peer's death is reported at once), not missing
    coming = [r for r in cats.get("missing", []) if str(snaps[r].get("where", "")).startswith("in torch ")]
    if coming:
        cats["missing"] = [r for r in cats["missing"] if r not in coming]
        cats["joined"] = sorted(cats.get("joined", []) + coming)
        for r in coming:
            report.details.pop(r, None)
    texts = [(trigger or {}).get("error") or ""] + [s.get("error") or "" for s in snaps.values()]
    gone = next((t for t in texts if _GONE.search(t)), None)
    if coming or (gone and cats.get("unreachable")):
        if gone and cats.get("unreachable"):
            seen = sorted(r for r, s in snaps.items() if s.get("error") and _GONE.search(s["error"]))
            seen = seen or [(trigger or {}).get("rank")]
            for r in cats["unreachable"]:
                report.details[r] = (f"no answer; torch saw a connection closed (by {_who(seen, report.hosts)}: "
                                     f"{gone[:160]})")
            cats["dead"] = sorted(cats.get("dead", []) + cats["unreachable"])
            cats["unreachable"] = []
        op = report.op or {}
        raised = {r: (exits or {})[r]["error"] for r in cats.get("exited", []) if (exits or {}).get(r, {}).get("error")}
        report.headline = _headline(cats, report.links, report.slow, op or None, op.get("seq"), report.hosts,
                                    raised=raised)
    return report
