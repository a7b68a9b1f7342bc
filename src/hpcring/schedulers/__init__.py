"""One small module per scheduler; ``get(name)`` returns it."""
from __future__ import annotations

from types import ModuleType

from hpcring.errors import ConfigError


def get(name: str) -> ModuleType:
    if name == "slurm":
        from hpcring.schedulers import slurm as mod
    elif name == "local":
        from hpcring.schedulers import local as mod
    elif name == "lsf":
        try:
            from hpcring.schedulers import lsf as mod
        except ImportError:
            raise ConfigError("the LSF scheduler backend is not available in this build",
                              hint="use a Slurm or local site") from None
    else:
        raise ConfigError(f"unknown scheduler {name!r}")
    return mod
