"""``hydra/launcher=hpcring``: the launcher's structured config, registered in Hydra's ConfigStore.

Its keys are ``hpcring.Executor``'s: ``site`` and ``folder`` (the constructor's), then every
parameter ``update_parameters`` takes, generated from the one option table
(:data:`hpcring.config.jobopts.PYTHON_OPTIONS`), so a job option added there is a launcher key
here with no edit. Every key defaults to None: not given, so hpcring's precedence applies as for
a flag left out (``HPCRING_*`` > site config > built-in default). Values are checked by the
Executor's checks when the sweep starts (``HpcringLauncher.setup``); Hydra itself refuses a key
that is not here.

Light on purpose: Hydra imports every plugin module at start-up (the option table is standard
library only; hpcring's submission layer loads when a sweep is launched).
"""
from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import List, Optional

from hydra.core.config_store import ConfigStore

from hpcring.config.jobopts import BY_NAME, PYTHON_OPTIONS

TARGET = "hydra_plugins.hpcring_launcher.hpcring_launcher.HpcringLauncher"

# An option's kind -> the OmegaConf type of its key. A time limit is text ("90", "1:00:00"): minutes
# given as a number become "90", which means the same; quote a time limit in YAML ("1:00:00"), where
# an unquoted 1:00:00 is the base-60 number 3600.
TYPES = {"int": Optional[int], "float": Optional[float], "time": Optional[str], "text": Optional[str],
         "bool": Optional[bool], "list": Optional[List[str]]}

# The Executor's constructor arguments (not job options): (key, help)
EXECUTOR_KEYS = (
    ("site", BY_NAME["site"].help),
    ("folder", "Root of the job folders, each job's <folder>/<job id> (Executor(folder=); default: "
               "$HPCRING_JOB_DIR, else the site's job_dir)."),
)
OPTION_KEYS = tuple(o.name for o in PYTHON_OPTIONS)
KEYS = tuple(k for k, _ in EXECUTOR_KEYS) + OPTION_KEYS
HELP = dict(EXECUTOR_KEYS) | {o.name: o.help for o in PYTHON_OPTIONS}

HpcringLauncherConf = make_dataclass(
    "HpcringLauncherConf",
    [("_target_", str, field(default=TARGET))]
    + [(k, Optional[str], field(default=None)) for k, _ in EXECUTOR_KEYS]
    + [(o.name, TYPES[o.kind], field(default=None)) for o in PYTHON_OPTIONS],
    namespace={"__module__": __name__,
               "__doc__": "hydra/launcher=hpcring: every sweep point one hpcring job, the sweep one job array "
                          "(map_array; array_parallelism: at most that many points at once). Keys: "
                          + ", ".join(KEYS) + " (docs/python-api.md, Hydra)."})

ConfigStore.instance().store(group="hydra/launcher", name="hpcring", node=HpcringLauncherConf, provider="hpcring")
