"""hpcring: from one GPU to many on Slurm and LSF."""
__version__ = "0.1.0"

from hpcring.errors import HpcringError, Preempted  # noqa: E402,F401

_LAZY = {"Session": "hpcring.session", "init": "hpcring.session",
         "preempted": "hpcring.preempt", "on_preempt": "hpcring.preempt", "requeue_count": "hpcring.preempt"}


def __getattr__(name: str):
    """``hpcring.init`` and ``hpcring.Session`` on first use: the CLI imports the package without
    paying for the bootstrap layer."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcring' has no attribute {name!r}")
