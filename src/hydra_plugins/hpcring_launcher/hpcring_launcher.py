"""The Hydra launcher ``hydra/launcher=hpcring``: a multirun's points as one hpcring job array.

Hydra's sweeper hands :meth:`HpcringLauncher.launch` a batch of points (each a list of overrides);
the batch is submitted through ``hpcring.Executor.map_array``, one array task per point, each task
the whole job (``nodes`` x ``tasks_per_node`` ranks), at most ``array_parallelism`` at once. On
every rank of a point's job, :class:`SweepPoint` does what Hydra's own launchers do in-process:
the singletons and resolvers of the submitting process restored, the point's config composed
(``load_sweep_config``), ``hydra.job.id`` (hpcring's job id, ``12_3``) and ``hydra.job.num`` set,
then ``run_job`` (the output dir ``hydra.sweep.dir/hydra.sweep.subdir``, its ``.hydra/`` files,
the job's logging, the callbacks, the task function). Rank 0 writes the ``.hydra/`` files; every
rank logs. Each point's :class:`JobReturn` is its rank 0's, returned to Hydra in order; a point
that failed (its task raised on some rank, or its job failed, timed out or was cancelled) returns
a JobReturn with status FAILED holding :class:`SweepPointFailed` (the point, its overrides, the
job, the failing rank and host, the task's exception and traceback), which Hydra raises when the
sweeper reads it, after every other point has ended.

Before anything is queued, a launcher key hpcring does not take, a value its checks refuse
(``hydra.launcher.nodes=0``) or one the site refuses (more nodes than the partition allows) is
a :class:`LauncherError`, which Hydra prints as it prints its own config errors.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.errors import CompactHydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hpcring.config.text import shown
from hpcring.errors import HpcringError, JobFailedError

from .config import EXECUTOR_KEYS, KEYS, OPTION_KEYS

log = logging.getLogger(__name__)


class LauncherError(HpcringError, CompactHydraException):
    """hpcring refused the launcher's config or the sweep before anything was queued; Hydra prints
    the message alone (a CompactHydraException), as it does for its own config errors. The
    refusal itself is ``__cause__``."""

    def __init__(self, exc: HpcringError, prefix: str = "") -> None:
        super().__init__(prefix + exc.message, hint=exc.hint)
        self.exit_code = exc.exit_code


class SweepPointFailed(JobFailedError, CompactHydraException):
    """A sweep point that failed, in its JobReturn (status FAILED): Hydra raises it when the sweeper
    reads the point's ``return_value`` (after "Error executing job with overrides: [...]").
    ``overrides``, ``job_num`` (``hydra.job.num``), ``job_id`` (hpcring's), and as for every
    failed job ``rank``, ``host`` (the first failing rank) and ``traceback`` (its exception's)."""

    def __init__(self, exc: HpcringError, overrides: list[str], job_num: int, job_id: str) -> None:
        point = " ".join(filter_overrides(overrides)) or "no overrides"
        super().__init__(f"sweep point #{job_num} ({point}): {exc.message}", hint=exc.hint,
                         exit_code=getattr(exc, "exit_code", 1))
        self.overrides, self.job_num, self.job_id = list(overrides), job_num, job_id
        self.rank, self.host = getattr(exc, "rank", None), getattr(exc, "host", None)
        self.traceback = getattr(exc, "traceback", None)


def _where(name: str, value: Any) -> str:
    return f"hydra.launcher.{name}={shown(value)}"


class HpcringLauncher(Launcher):
    """``hydra/launcher=hpcring`` (config: ``config.HpcringLauncherConf``)."""

    def __init__(self, **params: Any) -> None:
        self.params = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                       for k, v in params.items()}
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.executor = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.executor = self._executor()

    def _executor(self):
        """The Executor of the launcher's keys, every value checked (LauncherError): as Hydra
        refuses a key it does not know, before the sweep starts."""
        from hpcring.config.jobopts import unknown_parameters
        from hpcring.executor import Executor, check_parameters
        try:
            unknown = [k for k in self.params if k not in KEYS]
            if unknown:
                raise unknown_parameters(unknown, list(KEYS), "hydra.launcher")
            options = {k: self.params[k] for k in OPTION_KEYS if self.params.get(k) is not None}
            check_parameters(options, where=_where, what="hydra.launcher")
            ex = Executor(**{k: self.params.get(k) for k, _ in EXECUTOR_KEYS})
            ex.update_parameters(**options)
        except HpcringError as exc:
            raise LauncherError(exc) from exc
        return ex

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        assert self.executor is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        if not job_overrides:
            return []
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        points = [(list(o), initial_job_idx + i) for i, o in enumerate(job_overrides)]
        log.info(f"hpcring launcher: {len(points)} point(s), each one hpcring job; sweep output dir: {sweep_dir}")
        for overrides, num in points:
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        call = SweepPoint(self.hydra_context, self.task_function, self.config)
        state = Singleton.get_state()
        try:
            jobs = self.executor.map_array(call, [o for o, _ in points], [n for _, n in points],
                                           [state] * len(points))
        except HpcringError as exc:           # refused before anything was queued
            raise LauncherError(exc, "hydra/launcher=hpcring: nothing was submitted: ") from exc
        array = jobs[0].job_id.rsplit("_", 1)[0]
        log.info(f"hpcring launcher: job array {array} ({jobs[0].key.rsplit('_', 1)[0]}), tasks "
                 + ", ".join(f"#{num}: {job.job_id}" for job, (_, num) in zip(jobs, points)))
        try:
            return [self._return(job, overrides, num) for job, (overrides, num) in zip(jobs, points)]
        except KeyboardInterrupt:
            log.warning(f"hpcring launcher: stopped waiting; the sweep's jobs keep running: "
                        f"`hpcring status {array}`, `hpcring cancel {array}`")
            raise

    def _return(self, job, overrides: list[str], num: int) -> JobReturn:
        """The point's JobReturn once its job has ended: rank 0's, or one with status FAILED."""
        try:
            ret = job.result()
        except HpcringError as exc:
            failure = SweepPointFailed(exc, overrides, num, job.job_id)
            log.error(f"\t#{num} : {' '.join(filter_overrides(overrides))} FAILED (job {job.job_id}"
                      + (f", rank {failure.rank} on {failure.host}" if failure.rank is not None else "") + ")")
            return self._failed(failure, overrides, num, job.job_id)
        if not isinstance(ret, JobReturn):
            return self._failed(SweepPointFailed(HpcringError(
                f"job {job.job_id}: rank 0 returned {type(ret).__name__}, not Hydra's JobReturn"), overrides, num,
                job.job_id), overrides, num, job.job_id)
        return ret

    def _failed(self, failure: SweepPointFailed, overrides: list[str], num: int, job_id: str) -> JobReturn:
        """A JobReturn with status FAILED and ``failure`` as its value, with the point's configs as
        ``run_job`` would have filled them (composed here; the job may have died before)."""
        assert self.hydra_context is not None and self.config is not None
        ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
        try:
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.job.id, config.hydra.job.num = job_id, num
            ret.hydra_cfg = OmegaConf.masked_copy(config, "hydra")
            ret.overrides = OmegaConf.to_container(config.hydra.overrides.task)
            ret.task_name = str(config.hydra.job.name)
            task_cfg = config.copy()
            with read_write(task_cfg), open_dict(task_cfg):
                del task_cfg["hydra"]
            ret.cfg = task_cfg
        except Exception as exc:  # noqa: BLE001 - the overrides alone still name the point
            log.debug("cannot compose the config of failed point #%d: %s", num, exc)
        ret.return_value = failure
        return ret


class SweepPoint:
    """What every rank of a sweep point's job calls (pickled with cloudpickle by hpcring.Executor):
    the point's config composed and Hydra's ``run_job`` called, as Hydra's launchers do. A task
    that raised fails the rank with the task's own exception and traceback (so the job fails, and
    ``hpcring status``/``logs`` and the JobReturn name the rank); otherwise returns the JobReturn."""

    def __init__(self, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.config = config
        # How hpcring.Executor names the job (_label): its record's script is the task function's place
        # (`__main__.main()`), its default name Hydra's job name (name= and HPCRING_JOB_NAME win over it).
        self.__module__ = getattr(task_function, "__module__", None) or type(task_function).__module__
        self.__qualname__ = getattr(task_function, "__qualname__", None) or type(task_function).__qualname__
        self.__name__ = str(config.hydra.job.name)

    def __call__(self, overrides: list[str], job_num: int, singleton_state: dict) -> JobReturn:
        import hpcring
        from hpcring.jobdir import job_id

        Singleton.set_state(singleton_state)
        setup_globals()
        rank = hpcring.init().rank            # bootstrapped already by the rank entry: its session
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.id = job_id()    # hpcring's: 12_3 (array 12, task 3)
            config.hydra.job.num = job_num
        if rank != 0:                         # one writer of the point's .hydra/ files
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
        ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        if ret.status == JobStatus.FAILED:
            __tracebackhide__ = True          # noqa: F841 - the rank's traceback starts in the task
            exc = ret._return_value
            raise exc.with_traceback(_from_task(exc.__traceback__))
        return ret


def _from_task(tb):
    """``tb`` from the frame after Hydra's ``run_job`` (the task function's), or all of it."""
    at = tb
    while at is not None:
        if at.tb_frame.f_code.co_name == "run_job" and at.tb_next is not None:
            return at.tb_next
        at = at.tb_next
    return tb
