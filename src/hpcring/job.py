"""What runs inside every rank of a submitted job.

``RunScript`` is the callable submitit pickles: in each rank it goes through ``rank_life`` (the
bootstrap, the framework env, the torch watch and the status record, shared with ``hpcring run``),
runs the user's script as ``__main__`` with its arguments, ends the job when the script failed, and
hands a preempted job back to submitit for its requeue. ``RunFunction`` does the same around a
Python function (``hpcring.Executor``): its return value is the rank's result.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

from hpcring.errors import HpcringError, Preempted
from hpcring.fsutil import write_json
from hpcring.jobdir import array_task, job_folder
from hpcring.diagnostics.torch_watch import on_error
from hpcring.rank_life import RankLife, error_text

READY_WAIT_S = 60.0   # rank 0 waits this long for every rank to stop before it requeues


def run_as_main(script: str, args: list[str]) -> tuple[int, str | None]:
    """Run ``script`` as ``__main__``; return (exit code, error text or None). Never raises."""
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0, None
    except Preempted:
        raise                      # the script saved its state and asks to be requeued
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0, None
        print(exc.code, file=sys.stderr)
        return 1, None
    except BaseException as exc:  # the traceback goes to this rank's stderr log
        print_user_traceback(exc)
        on_error(exc)                  # a torch collective failed: the job-wide report first
        return 1, error_text(exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


_WRAPPER_FILES = {__file__, runpy.__file__, "<frozen runpy>"}   # run_as_main's, call_function's frames


def print_user_traceback(exc: BaseException, file=None) -> None:
    """The traceback as if the user had run ``python script.py``: the frames of run_as_main and
    runpy that lead into the script are left out (chained exceptions keep theirs), and so are the
    leading frames of a wrapper that sets ``__tracebackhide__ = True`` (pytest's convention; the
    Hydra launcher's call of the task function)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in _WRAPPER_FILES
                              or tb.tb_frame.f_locals.get("__tracebackhide__") is True):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr if file is None else file)


class _QuietSubmititSignals(logging.Filter):
    """submitit logs every SIGTERM/SIGCONT it ignores (a requeue, a teardown, a cancel: several
    per rank) and, on rank 0, the warning signal hpcring hands it to requeue (hpcring says so
    itself); the rank's log is the user's output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Bypassing signal", "Caught signal"))


def _exit_rank(code: int, why: str) -> None:
    """End this rank with the script's own exit code and no traceback of ours: the script's was
    printed already. submitit gets its error result first, so ``Job.result()`` still raises."""
    try:
        import submitit
        from submitit.core.utils import cloudpickle_dump
        cloudpickle_dump(("error", why), submitit.JobEnvironment().paths.result_pickle)
    except Exception:  # noqa: BLE001 - not under submitit, or no folder: the exit code says it
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)   # not an Exception: submitit's handler lets it through without a log line


def not_on_this_node(cwd: str, script: str | None, host: str) -> str | None:
    """Why this node cannot run the job where it was submitted (the submit directory or the script
    is missing here: typically a node-local path such as /tmp), or None."""
    hint = ("submit from a directory every node sees (a shared file system; /tmp and /dev/shm are "
            "private to each node)")
    if not os.path.isdir(cwd):
        return f"the job's working directory {cwd} (where it was submitted) does not exist on {host}: {hint}"
    if script is not None and not os.path.isfile(script):
        return f"the script {script} does not exist on {host}: {hint}"
    return None


class _RankEntry:
    """What both pickled rank entries (a script, a function) do around the user's work, once:
    the array task's variable, the rank's life (record, bootstrap, framework env, torch watch),
    the requeue count, the submit directory check, and ending the job when the work failed."""

    def _start(self, cmd: list[str]):
        """(life, session, topology, error): ``error`` says why this node cannot run the work
        (then nothing ran), else the rank is in the submit directory with the torch backend hook
        installed. A failed bootstrap ends the job here (never returns)."""
        from hpcring import preempt  # deferred: ~1.5 ms off the CMD's start (rank_site)

        life = RankLife(job_folder(), cmd)
        logging.getLogger("submitit").addFilter(_QuietSubmititSignals())
        os.environ[preempt.REQUEUE_VAR] = str(self.requeues)
        preempt.install(life.folder / f"{life.job_id}_preempt.json")   # the warning is the script's to act on
        session = life.bootstrap(self.gpus_per_node)
        if session is None:
            # A rank that never started (or hangs before init) would hold the job: end it all
            # (a launcher that waits for every task, as blaunch does, would wait to the time limit).
            from hpcring.diagnostics import teardown  # deferred: ~2.5 ms off the CMD's start (rank_site)
            exc, rec = life.failure, life.record
            teardown.end_job(rec["rank"], rec["error"].splitlines()[0])
            _exit_rank(exc.exit_code or 1, f"{type(exc).__name__}: {exc.message}")
        topo = session.topology
        life.watch_torch()             # a torch process group in the work gets the hang report too
        if topo.rank == 0:
            write_json(life.folder / f"{life.job_id}_requeues.json", {"count": preempt.requeue_count()})
        error = not_on_this_node(self.cwd, self._needed_file(), topo.host)
        if error is not None:          # before chdir, so the message, not a traceback, reaches the log
            print(f"hpcring: rank {topo.rank}: {error}", file=sys.stderr, flush=True)
        else:
            os.chdir(self.cwd)
            register_torch_backend_on_import()
        return life, session, topo, error

    def _needed_file(self) -> str | None:
        return None

    def _preempted(self, life, session, topo, exc: Preempted) -> None:
        life.finish(0, preempted=str(exc) or "Preempted")
        _requeue_when_all_stopped(session, topo)

    def _end(self, life, topo, code: int, error: str | None, what: str, result_text: str | None = None) -> None:
        """Record the outcome; a failure ends the whole job (mpi4py's rule: Slurm's
        --kill-on-bad-exit does it for srun; blaunch would wait for peers stuck on this rank) and
        this rank, with ``result_text`` (else the error) as submitit's error result."""
        life.finish(code, error)
        if code != 0:
            from hpcring.diagnostics import teardown  # deferred: ~2.5 ms off the CMD's start (rank_site)
            teardown.end_job(topo.rank, f"rank {topo.rank} on {topo.host}: {error or f'exited with code {code}'}")
            _exit_rank(code, result_text or f"rank {topo.rank} on {topo.host}: {what} "
                                            f"{error or f'exited with code {code}'}")


class RunScript(_RankEntry):
    """Run ``script`` with ``args`` in ``cwd`` as ``__main__`` on every rank."""

    def __init__(self, script: str, args: list[str], cwd: str, gpus_per_node: int = 0, requeues: int = 0,
                 sweep: dict[str, list[str]] | None = None) -> None:
        self.script = script
        self.args = list(args)
        self.cwd = cwd
        self.gpus_per_node = gpus_per_node
        self.requeues = requeues
        self.sweep = dict(sweep or {})     # array task -> its --sweep values as script arguments

    def __submitit_checkpoint__(self):
        """submitit's checkpoint hook (rank 0, on requeue): the same script, one more requeue."""
        from submitit.core.utils import DelayedSubmission
        return DelayedSubmission(RunScript(self.script, self.args, self.cwd, self.gpus_per_node, self.requeues + 1,
                                           getattr(self, "sweep", None)))

    checkpoint = __submitit_checkpoint__   # submitit's signal handler looks for this name first

    def _needed_file(self) -> str | None:
        return self.script

    def __call__(self) -> int:
        from hpcring import preempt  # deferred: ~1.5 ms off the CMD's start (rank_site)

        task = _array_task()
        args = self.args + getattr(self, "sweep", {}).get(task or "", [])
        life, session, topo, error = self._start([self.script, *args])
        if error is not None:
            code = 2
        else:
            try:
                code, error = run_as_main(self.script, args)
                preempt.finished()
            except Preempted as exc:
                self._preempted(life, session, topo, exc)
                return 0
        self._end(life, topo, code, error, self.script)
        return 0


class RunFunction(_RankEntry):
    """Call a Python function on every rank (``hpcring.Executor``): ``calls`` holds each call as
    cloudpickle bytes, ``""`` for a single job, the task index for each task of an array
    (``map_array``). The bytes are loaded in the rank, after the bootstrap, in the submit directory
    with the submitter's ``sys.path`` added, so a function from the submitter's own modules loads
    where they are shared, and one that cannot load fails that rank with the reason (no
    traceback of submitit's). The function's return value is the rank's result (submitit's
    ``<job>_<rank>_result.pkl``); an exception fails the rank as a script's does, and its
    traceback (the user's frames only) becomes that rank's error result, which
    ``hpcring.Job.result()`` raises with the rank and host."""

    def __init__(self, calls: dict[str, bytes], label: str, cwd: str, path: list[str],
                 gpus_per_node: int = 0, requeues: int = 0) -> None:
        self.calls = dict(calls)
        self.label = label              # ``work (function __main__.work)``: the record's script
        self.cwd = cwd
        self.path = list(path)          # the submitter's sys.path
        self.gpus_per_node = gpus_per_node
        self.requeues = requeues

    def __submitit_checkpoint__(self):
        """submitit's checkpoint hook (rank 0, on requeue): the same call again, one more requeue."""
        from submitit.core.utils import DelayedSubmission
        return DelayedSubmission(RunFunction(self.calls, self.label, self.cwd, self.path, self.gpus_per_node,
                                             self.requeues + 1))

    checkpoint = __submitit_checkpoint__

    def __call__(self):
        from hpcring import preempt  # deferred: ~1.5 ms off the CMD's start (rank_site)

        task = _array_task()
        life, session, topo, error = self._start([self.label] + ([f"task {task}"] if task is not None else []))
        value, code, text, payload = None, 0, None, None
        if error is not None:
            code = 2
        else:
            for entry in self.path:      # after the rank's own: its Python wins where both have a module
                if entry and entry not in sys.path and os.path.exists(entry):
                    sys.path.append(entry)
            # a single job's one call whatever HPCRING_ARRAY_TASK the submitter's environment passed on
            payload = self.calls[""] if "" in self.calls else self.calls.get(task or "")
            if payload is None:
                error = text = f"{self.label}: no call for array task {task} (tasks {', '.join(self.calls)})"
                code = 1
                print(f"hpcring: rank {topo.rank}: {error}", file=sys.stderr, flush=True)
        if payload is not None and error is None:
            try:
                value, code, error, text = call_function(payload, self.label)
                preempt.finished()
            except Preempted as exc:
                self._preempted(life, session, topo, exc)
                return None
        self._end(life, topo, code, error, self.label, result_text=text)
        return value


def _array_task() -> str | None:
    """This array task's index, also exported as HPCRING_ARRAY_TASK (one variable for every
    scheduler: LSF's index is 1-based)."""
    task = array_task()
    if task is not None:
        os.environ["HPCRING_ARRAY_TASK"] = task
    return task


def pack_call(fn, args: tuple, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` as the bytes :class:`RunFunction` calls (raises what pickling
    raises). cloudpickle sends a function of ``__main__`` (a script, a notebook) by value and names
    its code ``<dynamic-code>``; here the code keeps its file name, and the source lines of every
    such file go along (a notebook's cells exist nowhere else), so a rank's traceback reads as the
    submitter's would: file, line and the line itself."""
    import io
    import linecache
    import pickle
    import types
    from collections import ChainMap

    import cloudpickle
    files: set[str] = set()
    try:
        reduce_code = cloudpickle.cloudpickle._code_reduce

        def keep_filename(code):
            files.add(code.co_filename)
            make, fields = reduce_code(code)
            return make, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)
        class Pickler(cloudpickle.Pickler):      # the C pickler reads dispatch_table once, from the class
            dispatch_table = ChainMap({types.CodeType: keep_filename}, cloudpickle.Pickler.dispatch_table)
        buf = io.BytesIO()
        Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, tuple(args), dict(kwargs)))
        inner = buf.getvalue()
    except (AttributeError, TypeError):    # another cloudpickle's insides: its own names, then
        files.clear()
        inner = cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
    sources = {f: linecache.getlines(f) for f in files}
    return pickle.dumps((inner, {f: lines for f, lines in sources.items() if lines}))


def unpack_call(payload: bytes):
    """:func:`pack_call`'s ``(fn, args, kwargs)``, the source lines it carries put in linecache."""
    import linecache
    import pickle

    import cloudpickle
    inner, sources = pickle.loads(payload)
    for name, lines in sources.items():        # mtime None: linecache never checks them against a file
        linecache.cache[name] = (sum(map(len, lines)), None, list(lines), name)
    return cloudpickle.loads(inner)


def call_function(payload: bytes, label: str) -> tuple[object, int, str | None, str | None]:
    """Load ``(fn, args, kwargs)`` from ``payload`` (:func:`pack_call`) and call it: (return value,
    exit code, error in words, traceback text). Never raises but ``Preempted``: a failure to load,
    an exception, a ``sys.exit(N)`` and a return value that cannot be pickled back are this rank's
    failure."""
    import cloudpickle
    try:
        fn, args, kwargs = unpack_call(payload)
    except Exception as exc:  # noqa: BLE001 - e.g. its module is not importable on this node
        why = (f"cannot load {label} on this node: {type(exc).__name__}: {exc} (a function from __main__ is "
               "sent whole; one from a module needs that module importable where the ranks run)")
        print(f"hpcring: {why}", file=sys.stderr, flush=True)
        return None, 1, why, why
    try:
        value = fn(*args, **kwargs)
    except Preempted:
        raise
    except SystemExit as exc:          # as a script's: sys.exit(0) is a success, sys.exit("why") prints it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
        return None, code, f"SystemExit: {exc.code}" if code else None, None
    except BaseException as exc:  # the traceback goes to this rank's stderr log and to the result
        print_user_traceback(exc)
        on_error(exc)                  # a torch collective failed: the job-wide report first
        return None, 1, error_text(exc), user_traceback(exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - submitit would fail after the rank recorded success
        why = f"the return value of {label} cannot be pickled: {type(exc).__name__}: {exc}"
        print(f"hpcring: {why}", file=sys.stderr, flush=True)
        return None, 1, why, why
    return value, 0, None, None


def user_traceback(exc: BaseException) -> str:
    """:func:`print_user_traceback`'s text."""
    import io
    buf = io.StringIO()
    print_user_traceback(exc, file=buf)
    return buf.getvalue()


def register_torch_backend_on_import() -> None:
    """Make ``dist.init_process_group("hpcring")`` work in the user's script without an extra
    import: the backend is registered right after the script imports torch (importing torch here
    would cost every job ~2 s, torch or not)."""
    if "torch" in sys.modules:
        _register_torch_backend()
    elif not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch's own loader so registration runs after ``import torch``."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)          # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _register_torch_backend()
            spec.loader.exec_module = exec_module
        return spec


def _register_torch_backend() -> None:
    """Import hpcring.distributed (which registers the backend); a failure must not break the
    user's ``import torch``: it is reported and init_process_group("hpcring") then says unknown."""
    try:
        import torch.distributed as dist
        if dist.is_available():
            import hpcring.distributed  # deferred: pulls torch
    except Exception as exc:  # noqa: BLE001
        print(f"hpcring: could not register the torch.distributed backend 'hpcring': {exc}", file=sys.stderr)


def _requeue_when_all_stopped(session, topo) -> None:
    """Every rank raised Preempted: rank 0 waits (bounded) until all have, then requeues the job
    through submitit (which exits this process); the others just return."""
    store = session.store
    try:
        store.add("preempt/stopped", 1)
        deadline = time.monotonic() + READY_WAIT_S
        while topo.rank == 0 and store.add("preempt/stopped", 0) < topo.size and time.monotonic() < deadline:
            time.sleep(0.05)
    except HpcringError as exc:      # requeue anyway: the checkpoint is what matters
        print(f"hpcring: rank {topo.rank}: {exc}", file=sys.stderr, flush=True)
    if topo.rank == 0:
        from hpcring import preempt  # deferred: ~1.5 ms off the CMD's start (rank_site)
        print(f"hpcring: rank 0: every rank stopped for preemption; requeueing the job "
              f"(requeue {preempt.requeue_count() + 1})", file=sys.stderr, flush=True)
        preempt.requeue_through_submitit()
