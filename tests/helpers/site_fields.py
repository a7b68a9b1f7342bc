"""Every field of the site-config schema, found by walking the pydantic models, and site files with
one field replaced by raw YAML text: the generated site-config tests (test_site_fields_generated.py,
test_injection.py) cover a new field the day it is added.
"""
from __future__ import annotations

import copy
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel

from hpcring.config.schema import PATH, SiteConfig
from hpcring.config.yamlpos import load_with_lines

PLACEHOLDER_KEY = "p1"     # the name used for an entry of a dict of sub-models (partitions)
_MUT = "__MUTATED_VALUE__"
_KEY = "__MUTATED_KEY__"


@dataclass(frozen=True)
class Field:
    """One place a site file can hold a value. ``kind``: int, float, bool, str, literal (then
    ``choices``), list, dict, model (containers: wrong types only), key (a key of a dict)."""

    path: tuple
    kind: str
    choices: tuple = ()
    numeric_bounds: tuple | None = None   # (ge/gt, le/lt) metadata of a number
    takes_int: bool = False               # a text field that also takes a whole number (str | int)
    path_key: bool = False                # names a file, folder or command (schema.PATH): never empty

    @property
    def dotted(self) -> str:
        return ".".join(str(p) for p in self.path)

    def __str__(self) -> str:
        return f"{self.dotted}:{self.kind}"


def _strip_none(ann):
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        rest = tuple(a for a in args if a is not type(None))
        return rest[0] if len(rest) == 1 else typing.Union[rest]
    return ann


def _bounds(info) -> tuple:
    lows = [getattr(m, a) for m in info.metadata for a in ("ge", "gt") if getattr(m, a, None) is not None]
    highs = [getattr(m, a) for m in info.metadata for a in ("le", "lt") if getattr(m, a, None) is not None]
    return (lows[0] if lows else None, highs[0] if highs else None)


def _scalar_kind(ann) -> tuple[str, tuple]:
    if typing.get_origin(ann) is typing.Literal:
        return "literal", typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        members = set(typing.get_args(ann))
        return ("str", ()) if str in members else (_scalar_kind(sorted(members, key=str)[0]))
    if ann is bool:
        return "bool", ()
    if ann is int:
        return "int", ()
    if ann is float:
        return "float", ()
    if ann is str:
        return "str", ()
    raise TypeError(f"schema walker: no mutations for {ann!r}; teach tests/helpers/site_fields.py")


def schema_fields(model: type[BaseModel] = SiteConfig, prefix: tuple = ()) -> list[Field]:
    """Every leaf and container of ``model``, recursively; list items at index 0, dict entries
    under ``PLACEHOLDER_KEY`` (sub-models) or ``K`` (strings)."""
    out: list[Field] = []
    for name, info in model.model_fields.items():
        path = prefix + (name,)
        ann = _strip_none(info.annotation)
        origin = typing.get_origin(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.append(Field(path, "model"))
            out += schema_fields(ann, path)
        elif origin is list:
            (item,) = typing.get_args(ann)
            out.append(Field(path, "list"))
            kind, choices = _scalar_kind(_strip_none(item))
            out.append(Field(path + (0,), kind, choices))
        elif origin is dict:
            _, value = typing.get_args(ann)
            out.append(Field(path, "dict"))
            out.append(Field(path + (_KEY,), "key"))
            if isinstance(value, type) and issubclass(value, BaseModel):
                out += schema_fields(value, path + (PLACEHOLDER_KEY,))
            else:
                kind, choices = _scalar_kind(_strip_none(value))
                out.append(Field(path + ("K",), kind, choices))
        else:
            kind, choices = _scalar_kind(ann)
            out.append(Field(path, kind, choices, _bounds(info) if kind in ("int", "float") else None,
                             takes_int=kind == "str" and int in typing.get_args(ann), path_key=PATH in info.metadata))
    return out


# Valid sites that hold every key of the schema (so each mutation replaces a real line).
def base_site(scheduler: str) -> dict:
    site = {
        "name": "gen",
        "description": "generated",
        "scheduler": scheduler,
        "account": "acct",
        "qos": "normal",
        "constraint": "cpu",
        "job_dir": "jobs",
        "gpus_per_node": 0,
        "cpus_per_node": 8,
        "partitions": {PLACEHOLDER_KEY: {"max_time": "01:00:00", "max_nodes": 4, "gpus_per_node": 0,
                                         "cpus_per_node": 8, "qos": "normal"}},
        "defaults": {"partition": PLACEHOLDER_KEY, "time": "00:10:00", "nodes": 2, "tasks_per_node": 1,
                     "cpus_per_task": 1, "exclusive": False},
        "launcher": {"kind": {"slurm": "srun", "lsf": "jsrun", "local": "local"}[scheduler],
                     "args": ["--verbose"]},
        "fabric": {"kind": "tcp", "data_interfaces": ["=eth0"], "bootstrap_interfaces": ["=eth0"],
                   "ring_streams": 2, "ring_threads": 2, "ring_shm": True},
        "setup": ["true"],
        "env": {"K": "v"},
        "python": "python3",
        "timeout": 60,
        "slurm": {"gpu_directive": "gpus-per-node", "gres_name": "gpu", "signal": "USR2@90", "requeue": True},
        "lsf": {"drop_launch_node": False, "nnodes": False, "gpu_mode": "shared", "warning_signal": "USR2",
                "warning_time": "5"},
        "sched_args": ["--comment=base"],
        # no image: the site's container stays off, so the rendered ranks are the plain ones
        "container": {"runtime": "apptainer", "mounts": ["/data:/data:ro"],
                      "workdir": "/work", "flags": ["--writable-tmpfs"]},
        # a login node: read on `submit` from a laptop only (these tests never get that far)
        "remote": {"host": "login.example.org", "user": "alice", "port": 22,
                   "ssh_options": ["IdentityFile=~/.ssh/id_ed25519"], "workdir": "hpcring-remote",
                   "hpcring": "hpcring"},
    }
    if scheduler == "slurm":
        site["launcher"]["mpi"] = "pmix"
    if scheduler == "local":
        del site["partitions"], site["defaults"]["partition"]
    return site


def applies(field: Field, scheduler: str) -> bool:
    """Whether ``field`` can be set on a valid site of ``scheduler`` (local sites have no partitions)."""
    return not (scheduler == "local" and field.path[0] == "partitions")


def yaml_text(value: str) -> str:
    """A YAML double-quoted scalar for any text: every character outside printable ASCII escaped."""
    out = []
    for ch in value:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= o < 0x7F:
            out.append(ch)
        else:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


def _set(data: dict, path: tuple, value) -> None:
    cur = data
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if part == _KEY:
            raise AssertionError("a mutated key is the last element of a path")
        if isinstance(cur, list):
            while len(cur) <= part:
                cur.append(None)
            cur = cur[part]
            continue
        if not isinstance(cur.get(part), (dict, list)):
            cur[part] = [] if isinstance(nxt, int) else {}
        cur = cur[part]
    last = path[-1]
    if isinstance(cur, list):
        cur[:] = [value]          # the list holds just the mutated item (line and index known)
    elif last == _KEY:
        old = next(iter(cur.values()), "v") if cur else "v"
        cur.clear()
        cur[_KEY] = old
    else:
        cur[last] = value


def write_site(tmp: Path, scheduler: str, field: Field, raw: str, name: str = "site.yaml",
               also: dict | None = None) -> tuple[Path, set[int]]:
    """Write the base site with ``field`` replaced by the raw YAML ``raw`` (a key: its text).
    Returns the file and the lines an error about the field may name (the field's and its parents')."""
    data = copy.deepcopy(base_site(scheduler))
    for path, value in (also or {}).items():
        _set(data, path, value)
    _set(data, field.path, _MUT)
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1 << 20)
    token = _KEY if field.kind == "key" else _MUT
    p = tmp / name
    p.write_text(text)
    _, lines = load_with_lines(p)
    want = {lines[field.path[:i]] for i in range(1, len(field.path) + 1) if field.path[:i] in lines}
    if field.kind == "key":   # the explicit form: YAML limits implicit keys to 1024 characters
        indent = re.search(rf"^( *){token}:", text, re.M).group(1)
        text = text.replace(f"{token}:", f"? {raw}\n{indent}:")
    p.write_text(text.replace(token, raw))
    return p, want
