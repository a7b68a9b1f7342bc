"""hpcring: from one GPU to many on Slurm and LSF."""
__version__ = "0.1.0"

from hpcring.errors import (HpcringError, InvalidParameterError, JobFailedError, Preempted,  # noqa: E402,F401
                            WaitTimeoutError)

_LAZY = {"Session": "hpcring.session", "init": "hpcring.session",
         "preempted": "hpcring.preempt", "on_preempt": "hpcring.preempt", "requeue_count": "hpcring.preempt",
         "checkpoint_saved": "hpcring.preempt",
         "Executor": "hpcring.executor", "Job": "hpcring.executor"}


def __getattr__(name: str):
    """``hpcring.init``, ``hpcring.Session`` and ``hpcring.Executor`` on first use: the CLI imports
    the package without paying for the bootstrap layer or submitit."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcring' has no attribute {name!r}")
