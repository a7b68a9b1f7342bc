"""``hpcring.Executor``: submitit's executor interface with hpcring's meaning.

    ex = hpcring.Executor(site="local", folder="runs")
    ex.update_parameters(nodes=1, tasks_per_node=2, time=10)
    job = ex.submit(fn, 3)            # fn(3) on every rank, inside hpcring's bootstrap
    job.results()                     # every rank's return value, in rank order

The parameters are the job options of ``hpcring submit`` under their Python names, read from the
one table (:data:`hpcring.config.jobopts.OPTIONS`) and resolved by the same precedence
(given value > HPCRING_* > site > default, ``config/jobspec.resolve_job``), so a job submitted
from Python and one submitted with the same flags render the same job script. Submission, records
and folders are ``hpcring.submit``'s: ``hpcring status/logs/cancel`` see these jobs, and
:class:`Job` looks up a job the CLI submitted. A function is sent to the ranks with cloudpickle
(by value when it lives in ``__main__``: scripts, notebooks) and called by ``job.RunFunction``.

Nothing here prints: notes go to the ``hpcring`` logger (a warning is shown by default).
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from hpcring.config.jobopts import (BY_NAME, PYTHON_OPTIONS, JobRequest, check_value, unknown_parameters,
                                    where as given_where)
from hpcring.config.text import shown, control_character
from hpcring.errors import (HpcringError, InvalidParameterError, JobFailedError, UsageError,
                            WaitTimeoutError)
from hpcring import jobfollow, jobstatus, nodehistory
from hpcring.config.arrays import MAX_ARRAY_TASKS, parse_dependency
from hpcring.config.envvars import MAX_TIMEOUT, check_number, check_environ
from hpcring.job import RunFunction, pack_call
from hpcring.schedulers.base import JobRecord

log = logging.getLogger("hpcring")

MAX_PICKLE_BYTES = 1 << 30    # a job's function and arguments: submitit's own max_pickle_size_gb (1 GB)
RESULT_WAIT_S = 15.0          # a rank's result file may land after the job's end on shared storage (submitit's)
POLL_S = 0.2                  # Job.wait: first interval between two state queries, growing x1.5 ...
POLL_MAX_S = 2.0              # ... to this while nothing changes
STILL_S = 60.0                # a wait says every minute, on the logger, what it still waits for
_VALID = sorted(o.name for o in PYTHON_OPTIONS)


class Executor:
    """Submit Python functions and scripts as hpcring jobs.

    ``site``: a site name or YAML path (default: ``$HPCRING_SITE``, else the site named like the
    Slurm cluster you are in, else ``local``). ``folder``: the root of the job folders, as the
    site's ``job_dir`` (each job gets ``<folder>/<job id>``; a trailing ``/%j`` is accepted as
    submitit users write it); default: ``$HPCRING_JOB_DIR``, else the site's ``job_dir``.
    """

    def __init__(self, site: str | None = None, folder: str | os.PathLike | None = None) -> None:
        from hpcring.config.jobspec import parse_field  # deferred: pulls pydantic, yaml
        if site is not None:
            site = _constructor_text("site", site)
        if folder is not None:
            if not isinstance(folder, (str, os.PathLike)):
                raise InvalidParameterError(f"Executor(folder={shown(folder)}): not a path "
                                            f"({type(folder).__name__})", hint="give the folder as a str or a Path")
            text = os.fspath(folder)
            text = text[:-3] if text.endswith("/%j") else text
            folder = parse_field("job_dir", _constructor_text("folder", text), f"Executor(folder={shown(text)})")
        self.site = site
        self.folder = folder
        self._params: dict[str, Any] = {}

    # ---- parameters ---------------------------------------------------------------------------

    @property
    def parameters(self) -> dict[str, Any]:
        """The parameters given so far (a copy; what was not given comes from the environment,
        the site or the defaults at submission)."""
        return dict(self._params)

    def update_parameters(self, **kwargs: Any) -> None:
        """Set job options by their Python names: ``nodes``, ``tasks_per_node``, ``gpus_per_node``,
        ``cpus_per_task``, ``time``, ``partition``, ``account``, ``qos``, ``constraint``, ``name``,
        ``timeout`` (the collective deadline, seconds), ``exclusive``, ``sched_arg``, ``template``,
        ``container_image``, ``container_mounts``, ``no_container``, ``no_node_history``,
        ``dependency``, ``after``, and ``array_parallelism`` (map_array's ``%N``). Each is
        checked as its flag is; ``None`` takes a value back. All or nothing: one bad value leaves
        every parameter as it was. Raises InvalidParameterError (a ValueError)."""
        for k, v in check_parameters(kwargs).items():
            if v is None:
                self._params.pop(k, None)
            else:
                self._params[k] = v

    # ---- resolution -----------------------------------------------------------------------------

    def _request(self, script: str, args: list[str] | None = None, array: str | None = None):
        values = {k: v for k, v in self._params.items() if BY_NAME[k].cli}
        return JobRequest(script=script, args=list(args or []), site=self.site, array=array, **values)

    def _resolve(self, req, *, script_file: bool, default_name: str | None = None):
        """(site, job spec, notes): resolved as ``hpcring submit`` resolves its flags, the folder
        and the nodes the site's node history leaves out applied."""
        check_environ()                    # a bad HPCRING_* value stops here, as it stops every command
        site, job = req.resolve(given="python", script_file=script_file, default_name=default_name)
        if self.folder is not None:        # above HPCRING_JOB_DIR and the site, as a flag would be
            job.job_dir, job.sources["job_dir"] = self.folder, "Executor(folder=)"
        notes = nodehistory.leave_out(site, job, ignore=bool(req.no_node_history))
        return site, job, notes

    def render(self, target: Callable | str | os.PathLike | None = None) -> str:
        """The job script ``submit(target)`` (a function) or ``submit_script(target)`` (a path)
        would hand the scheduler, as ``hpcring render`` prints it (job id still ``%j``). Submits
        nothing: the way to check a Slurm or LSF job from anywhere."""
        from hpcring import submit as lib  # deferred: pulls submitit, jinja2, pydantic
        if target is None or callable(target):
            label, name = _label(target) if target is not None else ("function()", "function")
            site, job, notes = self._resolve(self._request(label), script_file=False, default_name=name)
        else:
            site, job, notes = self._resolve(self._request(_path_text(target)), script_file=True)
        _say(notes)
        return lib.preview(site, job, self._params.get("template"))

    # ---- submission -----------------------------------------------------------------------------

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> "Job":
        """Run ``fn(*args, **kwargs)`` on every rank of one job; returns its :class:`Job`.
        Checked before anything is queued: the parameters against the site, that ``fn`` and its
        arguments can be pickled, that the folder can be written."""
        _check_callable(fn, "submit")
        payload = _pickled(fn, args, kwargs, "")
        return self._submit_calls(fn, {"": payload}, None)[0]

    def map_array(self, fn: Callable, *iterables: Iterable[Any]) -> list["Job"]:
        """One array task per item of ``zip(*iterables)``, each the whole job calling
        ``fn(*item)`` on every rank; at most ``array_parallelism`` tasks at once (``--array``'s
        ``%N``). Returns one :class:`Job` per task, in order (an empty input submits nothing)."""
        _check_callable(fn, "map_array")
        if not iterables:
            raise UsageError("map_array(fn) got no iterables", hint="map_array(fn, [1, 2, 3]) calls fn(1), fn(2), fn(3)")
        try:
            items = list(zip(*iterables))
        except TypeError as exc:
            raise UsageError(f"map_array: {exc}", hint="give lists (or other iterables) of arguments") from None
        if not items:
            warnings.warn("map_array: no items: nothing submitted", RuntimeWarning, stacklevel=2)
            return []
        if len(items) > MAX_ARRAY_TASKS:
            raise UsageError(f"map_array: {len(items)} items, more than {MAX_ARRAY_TASKS} array tasks",
                             hint="submit fewer tasks (or batch items into each call)")
        calls = {str(i): _pickled(fn, item, {}, f"item {i}'s ") for i, item in enumerate(items)}
        limit = self._params.get("array_parallelism")
        spec = f"0-{len(items) - 1}" + (f"%{limit}" if limit else "")
        return self._submit_calls(fn, calls, spec)

    def _submit_calls(self, fn: Callable, calls: dict[str, bytes], array: str | None) -> list["Job"]:
        from hpcring import submit as lib  # deferred: pulls submitit, jinja2, pydantic
        total = sum(len(b) for b in calls.values())
        if total > MAX_PICKLE_BYTES:
            raise UsageError(f"the function and its arguments are {total / 2**30:.2f} GiB pickled, more than "
                             f"{MAX_PICKLE_BYTES / 2**30:g} GiB to send through the job folder",
                             hint="pass paths of data the ranks read, not the data itself")
        label, name = _label(fn)
        site, job, notes = self._resolve(self._request(label, array=array), script_file=False, default_name=name)
        entry = RunFunction(calls, label, os.getcwd(), list(sys.path), job.gpus_per_node)
        rec = self._submit(lib, site, job, notes, entry)
        return [Job(t) for t in rec.tasks()] if rec.array is not None else [Job(rec)]

    def submit_script(self, path: str | os.PathLike, args: Iterable[str] = ()) -> "Job":
        """Run the script at ``path`` with ``args`` on every rank, as ``hpcring submit PATH -- ARGS``
        does; its :class:`Job`'s results are the ranks' exit codes (0: a failure raises)."""
        from hpcring import submit as lib  # deferred: pulls submitit, jinja2, pydantic
        args = _script_args(args)
        site, job, notes = self._resolve(self._request(_path_text(path), args), script_file=True)
        return Job(self._submit(lib, site, job, notes, None))

    def _submit(self, lib, site, job, notes, entry):
        try:
            rec = lib.submit(site, job, self._params.get("template"), entry=entry)
        except HpcringError:
            _say(notes)                # a refusal may be about the nodes left out: say which
            raise
        _say(notes)
        for warning in lib.node_local_warnings(site, job):
            log.warning("warning: %s", warning)
        log.info("submitted job %s [%s] (%d ranks on %d node(s), site %s); logs in %s", rec.job_id, rec.key,
                 job.ntasks, job.nodes, site.name, rec.folder)
        return rec

    def job(self, ref: str) -> "Job":
        """The :class:`Job` of a job id or record name (``38``, ``local-38``, ``38_2``), however it
        was submitted."""
        return Job(ref)

    def __repr__(self) -> str:
        return f"hpcring.Executor(site={self.site!r}, folder={self.folder!r}, parameters={self._params!r})"


class Job:
    """A submitted job: ``hpcring.Job("38")`` looks one up by id or record name (the CLI's too).

    ``state``, ``done()``, ``wait(timeout=None)``, ``result()`` (rank 0's return value),
    ``results()`` (every rank's, in rank order), ``exception()``, ``cancel()``,
    ``stdout(rank=0)``/``stderr(rank=0)`` and ``logs()`` (every rank's lines, tagged as
    ``hpcring logs`` tags them). A job that failed raises :class:`hpcring.JobFailedError` from
    ``result()``/``results()``: the first failing rank, its host and error, its traceback text.
    """

    def __init__(self, ref) -> None:
        from hpcring import submit as lib  # deferred: pulls submitit, jinja2, pydantic
        self._rec = ref if isinstance(ref, JobRecord) else lib.record(str(ref))

    # identity
    @property
    def job_id(self) -> str:
        return self._rec.job_id

    @property
    def key(self) -> str:
        """The record's name (``local-38``), unambiguous across schedulers and clusters."""
        return self._rec.key

    @property
    def name(self) -> str:
        return self._rec.name

    @property
    def folder(self) -> Path:
        return Path(self._rec.folder)

    @property
    def num_tasks(self) -> int:
        """Ranks of the job (an array: of each task)."""
        return self._rec.ntasks

    def tasks(self) -> list["Job"]:
        """An array's tasks (each a whole job), or ``[self]``."""
        return [Job(t) for t in self._rec.tasks()] if self._rec.array is not None else [self]

    # state
    def _state(self):
        return jobstatus.job_state(self._rec)

    @property
    def state(self) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ... (one query)."""
        return self._state().state

    def done(self) -> bool:
        return self._state().finished

    def wait(self, timeout: float | None = None) -> str:
        """Until the job has ended (its final state), or at most ``timeout`` seconds: then
        :class:`hpcring.WaitTimeoutError` (a TimeoutError) names the job and its state; the job
        keeps running. Without a timeout the job's own time limit bounds the wait once it runs;
        each state change, and every minute what it still waits for, goes to the ``hpcring``
        logger (INFO)."""
        if timeout is not None:
            timeout = check_number("wait(timeout=)", timeout, lo=0, hi=MAX_TIMEOUT,
                                   hint="give seconds, or None to wait until the job ends")
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        interval, last, said = POLL_S, None, start
        while True:
            st = self._state()
            now = time.monotonic()
            if st.state != last:
                log.info("job %s (%s): %s", self.job_id, self.name, st.state)
                last, interval, said = st.state, POLL_S, now
            elif now - said >= STILL_S:
                log.info("job %s (%s): still %s after %.0f s", self.job_id, self.name, st.state, now - start)
                said = now
            if st.finished:
                return st.state
            if deadline is not None and now >= deadline:
                raise WaitTimeoutError(f"job {self.job_id} ({self.name}) is still {st.state} after the wait's "
                                       f"{timeout:g} s", hint=f"wait longer (wait(timeout=...)); it keeps running: "
                                       f"stop it with job.cancel() or `hpcring cancel {self.key}`")
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - now)))
            interval = min(interval * 1.5, POLL_MAX_S)

    # results
    def results(self, timeout: float | None = None) -> list:
        """Every rank's return value, in rank order, once the job has ended (``timeout``: as
        :meth:`wait`). A job that did not complete raises its :class:`hpcring.JobFailedError`."""
        return [self._result_of(r) for r in self._completed(timeout)]

    def result(self, timeout: float | None = None):
        """Rank 0's return value (see :meth:`results`)."""
        return self._result_of(self._completed(timeout)[0])

    def exception(self, timeout: float | None = None) -> JobFailedError | None:
        """The job's failure (what result() raises), or None when it completed."""
        try:
            self._completed(timeout)
        except JobFailedError as exc:
            return exc
        return None

    def _completed(self, timeout: float | None) -> list[int]:
        """Wait; the ranks to read when the job completed, else raise its failure."""
        if self._rec.array is not None:
            raise UsageError(f"job {self.job_id} is an array of {len(self._rec.array)} tasks: each task has its results",
                             hint=f"job.tasks()[i].results(), or `hpcring.Job('{self.job_id}_{self._rec.array[0]}')`")
        self.wait(timeout)
        st = self._state()
        oc = jobstatus.outcome(self._rec, st)
        if not oc.ok:
            raise self._failure(oc)
        return list(range(self._rec.ntasks))

    def _failure(self, oc) -> JobFailedError:
        """The CLI's verdict on the job (``describe_failure``), with the first failing rank, its
        host and, for a function, its traceback text."""
        try:
            _say(nodehistory.record_ended(self._rec, oc))   # as `submit --wait` and `status` do
        except HpcringError as exc:
            log.warning("warning: %s", exc)
        exc = jobstatus.describe_failure(self._rec, oc)
        if oc.failed:
            first = oc.failed[0]
            exc.rank, exc.host = first.get("rank"), first.get("host")
            outcome = self._read_result(exc.rank, wait=False)
            if outcome is not None and outcome[0] == "error" and str(outcome[1]).startswith("Traceback"):
                exc.traceback = str(outcome[1])
                exc.message += (f"\n  traceback of rank {exc.rank} on {exc.host}:\n"
                                + textwrap.indent(exc.traceback.rstrip(), "    "))
                exc.args = (exc.message,)
        return exc

    def _result_path(self, rank: int) -> Path:
        return self.folder / f"{self.job_id}_{rank}_result.pkl"

    def _read_result(self, rank, wait: bool):
        """submitit's ("success"|"error", value) of ``rank``, or None when it is not there
        (waited for at most RESULT_WAIT_S when ``wait``)."""
        path = self._result_path(rank)
        deadline = time.monotonic() + (RESULT_WAIT_S if wait else 0)
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            with open(path, "rb") as fh:
                return pickle.load(fh)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a class the result needs is not importable here, a cut file
            raise JobFailedError(f"job {self.job_id}: rank {rank}'s result {path} cannot be read here: "
                                 f"{type(exc).__name__}: {exc}",
                                 hint="return plain data (numbers, strings, lists, dicts, numpy arrays), or "
                                      "types importable where you read the result") from None

    def _result_of(self, rank: int):
        got = self._read_result(rank, wait=True)
        if got is None:
            raise JobFailedError(f"job {self.job_id} ({self.name}) completed but rank {rank} left no result "
                                 f"within {RESULT_WAIT_S:g} s ({self._result_path(rank)})",
                                 hint="the job folder must be one that this machine and the nodes share")
        outcome, value = got
        if outcome != "success":
            raise JobFailedError(f"job {self.job_id} ({self.name}): rank {rank} failed: {value}")
        return value

    # control and output
    def cancel(self) -> None:
        """Cancel the job (an array: every task), as ``hpcring cancel``; nothing when it has ended."""
        from hpcring import submit as lib  # deferred: pulls submitit, jinja2, pydantic
        ended = lib.cancel(self._rec)
        if ended is None:
            log.info("cancel requested for job %s", self.job_id)

    def _log(self, rank: int, ext: str) -> str | None:
        if not 0 <= rank < self._rec.ntasks:
            raise UsageError(f"rank {rank} is out of range: job {self.job_id} has ranks 0-{self._rec.ntasks - 1}")
        try:
            return (self.folder / f"{self.job_id}_{rank}_log.{ext}").read_text(errors="replace")
        except FileNotFoundError:
            return None

    def stdout(self, rank: int = 0) -> str | None:
        """What ``rank`` wrote on stdout so far (None before it started)."""
        return self._log(rank, "out")

    def stderr(self, rank: int = 0) -> str | None:
        return self._log(rank, "err")

    def logs(self, rank: int | None = None) -> str:
        """Every rank's lines so far, tagged ``[rank]<stdout>:`` as ``hpcring logs`` prints them
        (an array: ``[task:rank]``)."""
        return "".join(line + "\n" for line in jobfollow.tagged_lines(self._rec, rank))

    def __repr__(self) -> str:
        return f"hpcring.Job({self.key!r}, name={self.name!r})"


# ---- helpers ------------------------------------------------------------------------------------

def check_parameters(values: dict[str, Any], where: Callable[[str, Any], str] = given_where,
                     what: str = "update_parameters") -> dict[str, Any]:
    """``update_parameters``' checks, for whoever hands hpcring.Executor its parameters: every name
    one it takes, every value (None: not given, kept) checked as its flag is. Returns the values
    normalised; raises InvalidParameterError. ``where(name, value)`` and ``what`` name them in
    messages (defaults: ``update_parameters(nodes=0)``; the Hydra launcher: ``hydra.launcher.nodes=0``)."""
    unknown = [k for k in values if k not in BY_NAME or not BY_NAME[k].python]
    if unknown:
        raise unknown_parameters(unknown, _VALID, what)
    return {k: (None if v is None else _checked(k, v, where(k, v))) for k, v in values.items()}


def _checked(name: str, value: Any, at: str) -> Any:
    """One update_parameters value, checked as its flag is checked (InvalidParameterError)."""
    from hpcring.config.jobspec import parse_field  # deferred: pulls pydantic, yaml
    v = check_value(name, value, at)
    try:
        if BY_NAME[name].spec:
            parse_field(name, v, at)       # bounds, time syntax, the deadline: as every source
        elif name == "dependency":
            parse_dependency(v)
        elif name == "after":
            parse_dependency(None, v)
    except UsageError as exc:
        message = exc.message if exc.message.startswith(at) else f"{at}: {exc.message}"
        raise InvalidParameterError(message, hint=exc.hint) from None
    return v


def _constructor_text(what: str, value: Any) -> str:
    at = f"Executor({what}={shown(value)})"
    if not isinstance(value, str):
        raise InvalidParameterError(f"{at}: not a str ({type(value).__name__})",
                                    hint=f"give {what} as a str" + (" or a Path" if what == "folder" else ""))
    bad = control_character(value)
    if bad or not value.strip():
        raise InvalidParameterError(f"{at}: " + (f"contains the control character {bad[1]!r} at position {bad[0]}"
                                                 if bad else "is empty"),
                                    hint=f"give {what} as one line of text, or leave it out for the default")
    return value


def _path_text(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"submit_script({shown(path)}): not a path ({type(path).__name__})",
                         hint="give the script's path as a str or a Path")
    return os.fspath(path)


def _script_args(args: Iterable[str]) -> list[str]:
    if isinstance(args, str):
        raise UsageError(f"submit_script(path, {shown(args)}): args is one str",
                         hint="give the script's arguments as a list: ['--lr', '0.1']")
    out = list(args)
    for i, a in enumerate(out):
        if not isinstance(a, str):
            raise UsageError(f"submit_script: argument {i} {shown(a)} is not a str ({type(a).__name__})",
                             hint="a script's arguments are text: str(value)")
    return out


def _check_callable(fn: Any, what: str) -> None:
    if not callable(fn):
        raise UsageError(f"{what}: {shown(fn)} is not callable ({type(fn).__name__})",
                         hint=f"{what}(fn, ...) takes the function every rank calls; a script: submit_script(path)")


def _label(fn: Callable) -> tuple[str, str]:
    """(the record's ``script``: ``__main__.work()``, the default job name: ``work``)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    short = getattr(fn, "__name__", None) or type(fn).__name__
    label = f"{module}.{name}()"
    return (label if len(label) <= 200 else label[:197] + "...()"), short


def _pickled(fn: Callable, args: tuple, kwargs: dict, item: str) -> bytes:
    """``(fn, args, kwargs)`` as cloudpickle bytes (a function of ``__main__`` by value); a part
    that cannot be pickled is a UsageError naming it."""
    import cloudpickle

    try:
        return pack_call(fn, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - PicklingError, TypeError, RecursionError, ...
        why = f"{type(exc).__name__}: {exc}"
    parts = [(f"the function {_label(fn)[0]}", fn)] + [(f"{item}argument {i} ({type(a).__name__})", a)
                                                          for i, a in enumerate(args)]
    parts += [(f"{item}keyword argument {k}= ({type(v).__name__})", v) for k, v in kwargs.items()]
    culprit = "the function and its arguments"
    for what, obj in parts:
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001
            culprit, why = what, f"{type(exc).__name__}: {exc}"
            break
    raise UsageError(f"cannot send {culprit} to the ranks: it cannot be pickled ({why}); nothing was submitted",
                     hint="every rank gets the function and its arguments pickled (cloudpickle): pass plain data "
                          "(numbers, text, lists, arrays, paths) and open files, locks, sockets or clients inside "
                          "the function")


def _say(notes: list[str]) -> None:
    for note in notes:
        log.warning("%s", note)
