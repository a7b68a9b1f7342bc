"""hpcring: from one GPU to many on Slurm and LSF."""
__version__ = "0.1.0"

from hpcring.errors import HpcringError, Preempted  # noqa: E402,F401
from hpcring.preempt import on_preempt, preempted, requeue_count  # noqa: E402,F401
from hpcring.session import Session, init  # noqa: E402,F401
