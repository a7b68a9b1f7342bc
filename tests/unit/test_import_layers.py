"""Imports go downwards only (docs/architecture.md): every import of an hpcring module in
src/hpcring, at module level or inside a function, points at a unit of its own level or below, and
the units of one level import each other in no circle."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "hpcring"

# unit -> level; a module belongs to the longest unit its dotted name (below hpcring) starts with.
# A unit may import any unit of a lower level, and one of its own level if no circle results.
# Function-level imports are held to the same direction (a lazy import may not point upward).
LEVEL = {
    "errors": 0, "_native": 0,
    # leaves anyone may import ("hpcring": the package itself, its version and lazy names)
    "hpcring": 1, "ranks": 1, "fsutil": 1, "netio": 1, "resources": 1, "jobdir": 1, "hostlist": 1,
    "config.envvars": 1, "config.text": 1, "config.slurmtime": 1, "config.metrics_form": 1,
    "config": 2, "bootstrap": 2,
    # the only code that runs scheduler commands (ranks too end their job through it); the collectives
    "schedulers": 3, "collectives": 3,
    "diagnostics": 4, "outcome": 4,
    "session": 5, "preempt": 5,
    # on a session: the doctor and the torch watch join one (hpcring.init())
    "rank_life": 6, "distributed": 6, "elastic": 6, "diagnostics.doctor": 6, "diagnostics.torch_watch": 6,
    # rank entries (rank_site: the sitecustomize of hpcring run's CMD), hpcring.torch, the gang check
    "job": 7, "rank_exec": 7, "rank_site": 7, "torch": 7, "preflight": 7,
    # a job from outside: its state, following it, restarts, submitting, hpcring run
    "steps_record": 8, "jobstatus": 8, "remote": 8, "remote_ignore": 8,
    "jobfollow": 9, "restarts": 9, "submit": 9, "allocation": 9,
    "nodehistory": 10, "jobreport": 10, "bench": 10,
    "steps": 11, "executor": 11, "jobreport_html": 11,
    "jobreport_plots": 12, "devcluster": 12,
    "cli": 13, "__main__": 13,
}
# An import of an hpcring module inside a function, outside cli/, says on its line why it waits:
# `# deferred: <reason>` naming the library or the cost it keeps off an import path (`pulls torch`,
# `launcher tables (~10 ms) off the CMD's start (rank_site)`). Anything else goes to module level.
DEFERRED_MARK = "# deferred:"

# to fix: files (or folders, ending in /) below src/hpcring whose function-level imports are not
# marked yet: other engineers are changing them now. Remove an entry once its imports are moved or marked.
UNMARKED = ()

# to fix: upward imports whose fix needs an edit in a package other engineers are changing now
# (bootstrap/, collectives/). (importing file, imported module) -> why it is still here.
KNOWN: dict = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = SRC.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def lazy_names() -> dict[str, str]:
    """hpcring.__init__'s ``_LAZY``: ``hpcring.init`` is an import of hpcring.session."""
    for node in ast.parse((PKG / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


LAZY = lazy_names()


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported hpcring module, inside a function) of every import in ``path``."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", str(path))


def imports_in(source: str, me: str, is_package: bool = False, where: str = "<text>") -> list[tuple[int, str, bool]]:
    """:func:`imports` of module ``me``'s ``source``: ``import``, ``from`` (relative too), under
    ``if TYPE_CHECKING``, in functions, and ``hpcring.<lazy name>`` (``hpcring.init()``)."""
    package = me if is_package else me.rpartition(".")[0]
    out = []

    def target(base: str, name: str) -> str:
        if base == "hpcring" and name in LAZY:
            return LAZY[name]
        sub = f"{base}.{name}"
        return sub if is_module(sub) or (base == "hpcring" and name in LEVEL) else base

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, in_function) for a in child.names
                           if a.name.split(".")[0] == "hpcring")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base.split(".")[0] == "hpcring":
                    out.extend((child.lineno, target(base, a.name), in_function) for a in child.names)
            elif (isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name)
                  and child.value.id == "hpcring" and child.attr in LAZY):
                out.append((child.lineno, LAZY[child.attr], in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, where), False)
    return out


def unit_of(module: str) -> str:
    rest = module.split(".")[1:]
    for n in range(len(rest), 0, -1):
        if ".".join(rest[:n]) in LEVEL:
            return ".".join(rest[:n])
    if not rest:
        return "hpcring"
    raise AssertionError(f"{module}: no unit in LEVEL; add it (docs/architecture.md says where it sits)")


def edges() -> list[tuple[str, int, str, bool, str, str]]:
    """(file, line, imported module, in a function, unit, imported unit) of every import between units."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        me = unit_of(module_name(path))
        for line, mod, in_function in imports(path):
            them = unit_of(mod)
            if them != me:
                out.append((path.relative_to(PKG).as_posix(), line, mod, in_function, me, them))
    return out


def test_every_import_goes_down():
    upward, seen = [], set()
    for file, line, mod, in_function, me, them in edges():
        if LEVEL[them] > LEVEL[me]:
            seen.add((file, mod))
            if (file, mod) not in KNOWN:
                upward.append(f"{file}:{line}: {me} (level {LEVEL[me]}) imports {mod} ({them}, level {LEVEL[them]})"
                              + (" in a function" if in_function else ""))
    assert not upward, "upward imports (move the code to the layer that owns it):\n" + "\n".join(upward)
    gone = sorted(set(KNOWN) - seen)
    assert not gone, f"KNOWN entries that no longer occur (remove them from the table): {gone}"


def test_units_of_one_level_import_each_other_in_no_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    for _file, _line, _mod, _in_function, me, them in edges():
        if LEVEL[them] == LEVEL[me]:
            graph[me].add(them)
    circles = []

    def walk(unit: str, path: list[str]) -> None:
        for nxt in sorted(graph[unit]):
            if nxt in path:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif len(path) < len(LEVEL):
                walk(nxt, path + [nxt])

    for unit in sorted(graph):
        walk(unit, [unit])
    assert not circles, "units of one level importing each other in a circle:\n" + "\n".join(sorted(set(circles)))


def test_the_checker_sees_every_kind_of_import():
    source = """
from typing import TYPE_CHECKING
import hpcring
from . import report
from ..config import envvars, site
if TYPE_CHECKING:
    from hpcring.schedulers.base import JobState

def f():
    import hpcring.distributed
    from hpcring import _native, jobdir
    return hpcring.init(), hpcring.__version__
"""
    got = sorted(imports_in(source, "hpcring.diagnostics.x"))
    assert got == [(3, "hpcring", False), (4, "hpcring.diagnostics.report", False),
                   (5, "hpcring.config.envvars", False), (5, "hpcring.config.site", False),
                   (7, "hpcring.schedulers.base", False), (10, "hpcring.distributed", True),
                   (11, "hpcring._native", True), (11, "hpcring.jobdir", True), (12, "hpcring.session", True)]
    assert [unit_of(m) for _line, m, _f in got] == ["hpcring", "diagnostics", "config.envvars", "config", "schedulers",
                                                    "distributed", "_native", "jobdir", "session"]


def function_imports_in(source: str, me: str, is_package: bool = False,
                        where: str = "<text>") -> list[tuple[int, str, str | None]]:
    """(line, imported hpcring module, reason after ``# deferred:`` or None) of every ``import``/``from``
    statement of an hpcring module (relative ones too) inside a function or lambda of ``source``."""
    package = me if is_package else me.rpartition(".")[0]
    lines = source.splitlines()
    out = []

    def reason(node: ast.stmt) -> str | None:
        text = lines[node.lineno - 1]
        return text.partition(DEFERRED_MARK)[2].strip() if DEFERRED_MARK in text else None

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, reason(child)) for a in child.names
                           if a.name.split(".")[0] == "hpcring")
            elif in_function and isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base.split(".")[0] == "hpcring":
                    out.append((child.lineno, base, reason(child)))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, where), False)
    return out


def test_a_function_level_import_outside_cli_says_why_it_is_deferred():
    unmarked, empty = [], []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("cli/"):
            continue
        found = function_imports_in(path.read_text(), module_name(path), path.name == "__init__.py", str(path))
        for line, mod, why in found:
            if why is None and not any(rel == u or (u.endswith("/") and rel.startswith(u)) for u in UNMARKED):
                unmarked.append(f"{rel}:{line}: imports {mod} in a function")
            elif why is not None and not any(c.isalnum() for c in why):
                empty.append(f"{rel}:{line}: imports {mod} with an empty '{DEFERRED_MARK}' reason")
    assert not unmarked, ("function-level imports of hpcring modules without a reason: move each to module "
                          f"level, or say what it keeps off the import ('{DEFERRED_MARK} pulls torch'):\n"
                          + "\n".join(unmarked))
    assert not empty, "deferred imports must name the library or cost they defer:\n" + "\n".join(empty)
    stale = sorted(u for u in UNMARKED if not (PKG / u).exists())
    assert not stale, f"UNMARKED names paths that do not exist (remove them from the table): {stale}"


def test_the_deferred_check_sees_every_kind_of_function_level_import():
    source = """
import hpcring
from hpcring.config import envvars

def f():
    import json
    import hpcring.distributed
    from . import report  # deferred: pulls numpy
    from ..schedulers import slurm  # deferred:
    g = lambda: __import__("hpcring")

class C:
    def m(self):
        def inner():
            from hpcring.jobdir import job_id  # deferred:  ~2 ms off the start
        return inner
"""
    got = function_imports_in(source, "hpcring.diagnostics.x")
    assert got == [(7, "hpcring.distributed", None), (8, "hpcring.diagnostics", "pulls numpy"),
                   (9, "hpcring.schedulers", ""), (15, "hpcring.jobdir", "~2 ms off the start")]
