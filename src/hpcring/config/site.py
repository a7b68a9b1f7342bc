"""Finding, loading and validating site configs.

Lookup order for ``--site NAME|PATH`` (or ``HPCRING_SITE`` when the flag is absent):
  1. a path to a YAML file,
  2. ``$HPCRING_SITE_DIRS`` (colon-separated) and ``~/.config/hpcring/sites/NAME.yaml``,
  3. the bundled configs (``site_configs/`` in the repository, inside the installed package).
With neither flag nor variable: inside a Slurm allocation whose cluster (``SLURM_CLUSTER_NAME``)
has a site config of that name, that site (so ``hpcring run`` in ``salloc`` gets the cluster's
fabric and launcher); otherwise the ``local`` site.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from hpcring.config.schema import SiteConfig, time_to_minutes
from hpcring.config.text import shown, text_problem
from hpcring.config.yamlpos import line_of, load_with_lines
from hpcring.errors import ConfigError, SiteNotFoundError
from hpcring.resources import site_configs_dir

DEFAULT_SITE = "local"


@dataclass(frozen=True)
class Site:
    config: SiteConfig
    path: Path          # where it was loaded from
    origin: str         # "path", "user", "bundled"

    @property
    def name(self) -> str:
        return self.config.name


def search_dirs(environ: Mapping[str, str] | None = None) -> list[tuple[str, Path]]:
    env = os.environ if environ is None else environ
    dirs: list[tuple[str, Path]] = []
    for d in filter(None, env.get("HPCRING_SITE_DIRS", "").split(":")):
        dirs.append(("user", Path(d).expanduser()))
    dirs.append(("user", Path(env.get("XDG_CONFIG_HOME", "~/.config")).expanduser() / "hpcring" / "sites"))
    dirs.append(("bundled", site_configs_dir()))
    return dirs


def available_sites(environ: Mapping[str, str] | None = None) -> list[tuple[str, Path, str]]:
    """(name, path, origin) of every site config found; earlier directories shadow later ones."""
    found: dict[str, tuple[str, Path, str]] = {}
    for origin, d in search_dirs(environ):
        if d.is_dir():
            for p in sorted(d.glob("*.yaml")):
                found.setdefault(p.stem, (p.stem, p, origin))
    return sorted(found.values())


def allocation_site(environ: Mapping[str, str]) -> str | None:
    """The site named like the Slurm cluster this process runs in (``SLURM_CLUSTER_NAME``), when a
    site config of that name exists; else None. (LSF puts no cluster name in a job's environment.)"""
    name = environ.get("SLURM_CLUSTER_NAME", "").strip()
    if not name or os.sep in name:
        return None
    return name if any((d / f"{name}.yaml").is_file() for _, d in search_dirs(environ)) else None


def resolve_site_ref(ref: str | None, environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """Turn a --site value (or HPCRING_SITE, or the default) into (path, origin)."""
    env = os.environ if environ is None else environ
    ref = ref or env.get("HPCRING_SITE") or allocation_site(env) or DEFAULT_SITE
    p = Path(ref).expanduser()
    if p.suffix in (".yaml", ".yml") or os.sep in ref:
        if not p.is_file():
            raise SiteNotFoundError(f"site config file {ref!r} does not exist",
                                    hint="check the path, or pass a site name (hpcring sites list)")
        return p, "path"
    for origin, d in search_dirs(env):
        cand = d / f"{ref}.yaml"
        if cand.is_file():
            return cand, origin
    names = [n for n, _, _ in available_sites(env)]
    close = difflib.get_close_matches(ref, names, n=1)
    raise SiteNotFoundError(
        f"no site config named {ref!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
        hint="known sites: " + ", ".join(names) + "; or pass --site path/to/site.yaml")


def load_site(ref: str | None = None, environ: Mapping[str, str] | None = None) -> Site:
    """Find, parse and validate a site config. Raises ConfigError listing every problem."""
    path, origin = resolve_site_ref(ref, environ)
    return Site(config=parse_site_file(path), path=path, origin=origin)


def parse_site_file(path: Path) -> SiteConfig:
    data, lines = load_with_lines(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a site config must be a mapping of keys, got {type(data).__name__}",
                          hint="start from a bundled config (hpcring sites list; hpcring sites show local)")
    problems: list[str] = []
    cfg = None
    try:
        cfg = SiteConfig.model_validate(data)
    except ValidationError as exc:
        problems += [_describe(err, path, lines) for err in exc.errors()]
        cfg = _validate_pruned(data, exc)  # so cross-field rules still get reported in the same run
    if cfg is not None:
        problems += [f"{_where(path, lines, loc)}: {msg}" for loc, msg in cross_checks(cfg) + file_checks(cfg, path)]
    if problems:
        raise ConfigError(f"site config {path} has {len(problems)} problem(s):", problems,
                          hint="fix each listed key; `hpcring sites validate` re-checks")
    return cfg


def _validate_pruned(data: dict, exc: ValidationError) -> SiteConfig | None:
    """Drop the offending keys (their defaults apply) and validate again; None if still invalid."""
    import copy
    pruned = copy.deepcopy(data)
    for err in exc.errors():
        loc = tuple(err["loc"])
        parent = pruned
        for part in loc[:-1]:
            try:
                parent = parent[part]
            except (KeyError, IndexError, TypeError):
                parent = None
                break
        if isinstance(parent, dict) and loc and loc[-1] in parent:
            del parent[loc[-1]]
    try:
        return SiteConfig.model_validate(pruned)
    except ValidationError:
        return None


def _where(path: Path, lines: dict, loc: tuple) -> str:
    line = line_of(lines, loc)
    # a key is shown as written unless it is itself the problem (escapes, line breaks, megabytes)
    key = ".".join(shown(p) if isinstance(p, str) and text_problem(p) else str(p) for p in loc) or "(top level)"
    return f"{path}:{line} {key}" if line else f"{path} {key}"


def _describe(err: dict[str, Any], path: Path, lines: dict) -> str:
    # a check over a whole list or mapping says which item (ctx "sub") for the item's own line
    loc = tuple(err["loc"]) + tuple((err.get("ctx") or {}).get("sub", ()))
    if err["type"] == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        model = _model_at(SiteConfig, parent)
        fields = list(model.model_fields) if model else []
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else (f" (known keys: {', '.join(fields)})" if fields else "")
        return f"{_where(path, lines, loc)}: unknown key{hint}"
    if err["type"] == "missing":
        return f"{_where(path, lines, loc)}: required key is missing"
    got = err.get("input")
    got_s = f" (got {shown(got)})" if got is not None and not isinstance(got, (dict, list)) else ""
    msg = err["msg"].removeprefix("Value error, ")   # pydantic's prefix for a validator's own message
    if err["type"] == "string_type" and isinstance(got, (bool, int, float)):
        got_s += "; quote it if it is text"
    elif err["type"] in ("int_type", "float_type") and isinstance(got, bool):
        got_s += "; YAML reads true/false/yes/no/on/off as booleans: write a number"
    return f"{_where(path, lines, loc)}: {msg}{got_s}"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """Walk the schema along ``loc`` to the sub-model that owns the last key."""
    cur: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if isinstance(cur, type) and issubclass(cur, BaseModel) and part in cur.model_fields:
            ann = cur.model_fields[part].annotation
            args = getattr(ann, "__args__", ())
            if getattr(ann, "__origin__", None) is dict and args:
                cur = ("dict", args[1])
                continue
            cur = ann
            if type(None) in args:        # an optional section (container, remote): its model
                cur = next(a for a in args if a is not type(None))
        elif isinstance(cur, tuple) and cur[0] == "dict":
            cur = cur[1]
        else:
            return None
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def file_checks(cfg: SiteConfig, path: Path) -> list[tuple[tuple, str]]:
    """What the site file names next to itself: its own template must exist (else every submit fails)."""
    out: list[tuple[tuple, str]] = []
    if cfg.template:
        t = (path.parent / cfg.template).expanduser()
        if not t.is_file():
            out.append((("template",), f"template {t} does not exist (a template is relative to the "
                        "site file); point at an existing .j2 file or remove the key"))
    return out


def cross_checks(cfg: SiteConfig) -> list[tuple[tuple, str]]:
    """Rules that span several keys. Returns (key path, message) pairs; empty when all is well."""
    out: list[tuple[tuple, str]] = []
    fab, lau = cfg.fabric, cfg.launcher
    if fab.kind == "roce" and fab.gid_index is None:
        out.append((("fabric", "gid_index"), "RoCE needs a GID index (NCCL_IB_GID_INDEX); "
                    "find it with `show_gids` on a node (usually 3 for RoCEv2 over IPv4)"))
    if fab.kind in ("infiniband", "roce") and not fab.hcas:
        out.append((("fabric", "hcas"), f"fabric kind {fab.kind!r} needs at least one HCA, e.g. mlx5_0:1 (see `ibstat`)"))
    if fab.kind == "tcp" and fab.hcas:
        out.append((("fabric", "hcas"), "fabric kind 'tcp' uses no HCAs; remove them or set kind to infiniband/roce"))
    if fab.kind != "roce" and fab.gid_index is not None:
        out.append((("fabric", "gid_index"), "a GID index only applies to RoCE"))
    # the launchers hpcring can write for each scheduler (schedulers/<name>.py launch_argv)
    allowed = {"slurm": {"srun"}, "lsf": {"jsrun", "blaunch", "mpirun"}, "local": {"local"}}[cfg.scheduler]
    if cfg.scheduler == "slurm" and lau.kind == "mpirun":
        out.append((("launcher", "kind"), "hpcring starts the ranks of a Slurm job with srun, not mpirun; "
                    "use kind 'srun' (with mpi: pmix or pmi2 for MPI programs: Open MPI and MPICH "
                    "ranks then get their world from Slurm)"))
    elif lau.kind not in allowed:
        out.append((("launcher", "kind"), f"launcher {lau.kind!r} does not run under scheduler "
                    f"{cfg.scheduler!r}; use one of {sorted(allowed)}"))
    if lau.mpi is not None and lau.kind != "srun":
        out.append((("launcher", "mpi"), "launcher.mpi is srun's --mpi flag; it applies only to launcher kind 'srun'"))
    if cfg.partitions and cfg.defaults.partition and cfg.defaults.partition not in cfg.partitions:
        close = difflib.get_close_matches(cfg.defaults.partition, list(cfg.partitions), n=1)
        out.append((("defaults", "partition"), f"default partition {cfg.defaults.partition!r} is not among "
                    f"partitions {sorted(cfg.partitions)}" + (f" (did you mean {close[0]!r}?)" if close else "")))
    for pname, part in cfg.partitions.items():
        if part.max_time and time_to_minutes(cfg.defaults.time) > time_to_minutes(part.max_time) \
                and pname == cfg.defaults.partition:
            out.append((("defaults", "time"), f"default time {cfg.defaults.time} exceeds partition "
                        f"{pname!r} max_time {part.max_time}"))
    if (cfg.lsf.warning_signal is None) != (cfg.lsf.warning_time is None):
        out.append((("lsf", "warning_time" if cfg.lsf.warning_time is None else "warning_signal"),
                    "LSF's warning needs both warning_signal (-wa) and warning_time (-wt); set both, "
                    "or both to null for no warning"))
    if cfg.scheduler == "local" and cfg.partitions:
        out.append((("partitions",), "the local scheduler has no partitions"))
    if cfg.container and cfg.container.runtime == "pyxis" and lau.kind != "srun":
        out.append((("container", "runtime"), "pyxis is a plugin of Slurm's srun; launcher "
                    f"{lau.kind!r} cannot use it: pick apptainer, charliecloud or podman"))
    for i, m in enumerate(cfg.container.mounts if cfg.container and cfg.container.runtime == "charliecloud" else []):
        if m.count(":") == 2:   # ch-run -b SRC:DST has no options: a silent read-write 'ro' would mislead
            out.append((("container", "mounts", i), f"mount {m!r}: Charliecloud's ch-run -b takes no mount "
                        "options; write SRC[:DST]"))
    # flags that start the rank with an empty environment: the secret file's name, the launcher's
    # rank variables and the fabric's NCCL/Gloo/UCX settings would never reach it
    clearing = {"apptainer": ("--cleanenv", "-e", "--containall", "-C"), "charliecloud": ("--unset-env",)}
    for i, f in enumerate(cfg.container.flags if cfg.container else []):
        bad = clearing.get({"singularity": "apptainer"}.get(cfg.container.runtime, cfg.container.runtime), ())
        if f.split("=", 1)[0] in bad:
            out.append((("container", "flags", i), f"{f} starts every rank with an empty environment: "
                        "HPCRING_SECRET_FILE, the launcher's rank variables and the fabric's NCCL_*/GLOO_*/UCX_* "
                        "would not reach it; remove it (docs/containers.md)"))
    return out
