"""Generated bad input for ``hpcring.Executor.update_parameters``: every parameter, by kind, as
tests/unit/test_bad_input_generated.py does for the flags.

The targets are read from the one option table (:data:`hpcring.config.jobopts.OPTIONS`), so a
parameter added later is covered without touching this file. For each bad value:

* an InvalidParameterError (a UsageError and a ValueError), one message that names the parameter,
  with a hint, no longer than a screen;
* every parameter as it was (all or nothing), nothing started, nothing written.

Then: unknown names (the CLI-only options, submitit's own names, random words) are refused naming
each and listing the valid ones; and the same values given as flags to ``hpcring render`` and as
parameters to ``Executor.render`` are accepted or refused alike, with the same numbers in the
message, and render the very same job script.
"""
from __future__ import annotations

import keyword
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hpcring
from hpcring.cli.main import app
from hpcring.config import jobopts
from hpcring.config.jobopts import BY_NAME, OPTIONS, PYTHON_OPTIONS, SUBMITIT_NAMES
from hpcring.errors import HpcringError, InvalidParameterError

ROOT = Path(__file__).resolve().parents[2]
HELLO = str(ROOT / "examples" / "hello.py")
LONG = 5000


class Opaque:
    """An object of no type a parameter takes."""


TEXT_BAD = ["", " ", "   ", "a\nb", "a\rb", "tab\there", "\x1b[31mred", "a\x00b", "bell\x07", "del\x7f",
            "\u2028line", "x" * LONG, 5, 1.5, True, object, b"bytes", ["a"], Opaque()]
TEXT_ODD = ["\u00fcn\u00efc\u00f8d\u00e9", "\u540d\u524d", "\U0001f600", "-"]
BOOL_BAD = ["yes", "true", "False", 1, 0, 1.0, [], {}, b"1", Opaque()]
LIST_BAD = [5, 1.5, True, b"x", {"a": 1}, [5], ["ok", 5], ["a\nb"], [""], [" "], ["x" * LONG], "a\nb", "",
            ("ok", None), Opaque()]


def int_bad(o) -> list:
    return [True, False, 1.5, 2.0, "1", "abc", "", math.nan, math.inf, -math.inf, int(o.lo) - 1, int(o.hi) + 1,
            -1, 2**70, -2**70, [1], {}, b"1", complex(1, 0), Opaque()]


def float_bad(o) -> list:
    return [True, False, "300", "abc", "", math.nan, math.inf, -math.inf, 0, 0.0, -1, -1e-9, o.hi * 2, 1e300,
            [1], b"1", complex(1, 0), Opaque()]


TIME_BAD = [True, 1.5, "abc", "0", 0, -5, "-5", "UNLIMITED", "-1", "infinite", "1_0", "\uff11\uff10", "1:2:3:4",
            "", " ", "a\nb", 10**9, "99999999999", [30], b"30", Opaque()]


def mutations(o) -> tuple[list, list]:
    """(values that must be refused, values that must merely not crash) for option ``o``."""
    bad = {"int": int_bad, "float": float_bad}.get(o.kind)
    if bad:
        return bad(o), []
    if o.kind == "time":
        return TIME_BAD, []
    if o.kind == "bool":
        return BOOL_BAD, []
    if o.kind == "list":
        return LIST_BAD, [] if o.name == "after" else [["\u00fcn\u00efc\u00f8d\u00e9"]]   # after: job ids
    extra = {"dependency": ["x:1", "afterok", "afterok:", "afterok:abc", "afterok:1;rm"]}.get(o.name, [])
    return TEXT_BAD + extra, TEXT_ODD if o.name != "dependency" else []


GOOD = {"int": lambda o: int(o.lo) or 1, "float": lambda o: 1.5, "time": lambda o: "1:00:00",
        "text": lambda o: "afterok:38" if o.name == "dependency" else "abc", "bool": lambda o: True,
        "list": lambda o: ["38"] if o.name == "after" else ["x"]}


@pytest.fixture
def sandbox(local_env, monkeypatch):
    dirs = local_env
    monkeypatch.chdir(dirs["cwd"])
    started = []

    def trip(*a, **kw):
        started.append(a[:1])
        raise AssertionError(f"something was started: {a[:1]}")
    monkeypatch.setattr(subprocess, "Popen", trip)
    monkeypatch.setattr(os, "fork", trip)
    dirs["started"] = started
    return dirs


def _left(dirs) -> list[str]:
    return [str(p) for k in ("state", "jobs", "cwd") for p in dirs[k].rglob("*")]


def problems(o, value, dirs, refused=True) -> list[str]:
    ex = hpcring.Executor(site="local")
    ex.update_parameters(**{p.name: GOOD[p.kind](p) for p in PYTHON_OPTIONS if p.name != o.name})
    before = ex.parameters
    why = []
    try:
        ex.update_parameters(**{o.name: value})
    except InvalidParameterError as exc:
        if not refused:
            why.append(f"refused: {str(exc)[:120]}")
        text = str(exc)
        if o.name not in text:
            why.append("does not name the parameter")
        if "hint:" not in text:
            why.append("no hint")
        if len(text) > 1500 or text.count("\n") > 4:
            why.append(f"too long ({len(text)} characters, {text.count(chr(10))} lines)")
        if not isinstance(exc, ValueError):
            why.append("not a ValueError")
    except Exception as exc:  # noqa: BLE001
        why.append(f"raised {type(exc).__name__}: {str(exc)[:120]}")
    else:
        if refused:
            why.append("accepted")
    if ex.parameters != before and refused:
        why.append("changed the parameters")
    if dirs["started"]:
        why.append(f"started {dirs['started']}")
    if _left(dirs):
        why.append(f"left {_left(dirs)[:3]}")
    return why


def _fmt(failures) -> str:
    return "\n".join(f"  {what!r:.60}: {', '.join(why)}" for what, why in failures)


# ------------------------------------------------------------------------------ the table

def test_every_parameter_is_a_target():
    """The table holds every job flag of submit and render, and the Executor takes exactly the
    table's Python parameters (a broken table would make the cases below vacuous)."""
    names = {o.name for o in PYTHON_OPTIONS}
    assert {"nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "time", "partition", "account", "qos",
            "constraint", "name", "timeout", "exclusive", "sched_arg", "template", "array_parallelism"} <= names
    ex = hpcring.Executor(site="local")
    ex.update_parameters(**{o.name: GOOD[o.kind](o) for o in PYTHON_OPTIONS})
    assert set(ex.parameters) == names
    assert all(o.kind in ("int", "float", "time", "text", "bool", "list") for o in PYTHON_OPTIONS)


def test_the_cli_reads_the_same_table():
    """Every CLI option of the table is a flag of submit and render with the table's bounds (typer's
    min/max, which the strict reading checks), and the request has one field per option."""
    import typer.main
    from dataclasses import fields
    cmd = typer.main.get_command(app)
    for command in ("submit", "render"):
        params = {p.name: p for p in cmd.commands[command].params}
        for o in jobopts.CLI_OPTIONS:
            p = params[o.name]
            assert o.flag in p.opts, (command, o.name, p.opts)
            if o.kind == "int":
                info = p.type_descriptor.parameter_info
                assert (info.min, info.max) == (o.lo, o.hi), (command, o.name)
    assert {f.name for f in fields(jobopts.JobRequest)} == {"script", "args"} | {o.name for o in jobopts.CLI_OPTIONS}


@pytest.mark.parametrize("option", PYTHON_OPTIONS, ids=lambda o: o.name)
def test_bad_parameter_value(option, sandbox):
    bad, odd = mutations(option)
    failures = [(v, why) for v in bad if (why := problems(option, v, sandbox))]
    failures += [(v, why) for v in odd if (why := problems(option, v, sandbox, refused=False))]
    assert not failures, f"{option.name}: {len(failures)} of {len(bad) + len(odd)} values mishandled:\n{_fmt(failures)}"


INT_OPTIONS = [o for o in PYTHON_OPTIONS if o.kind == "int"]
TEXT_OPTIONS = [o for o in PYTHON_OPTIONS if o.kind in ("text", "time")]


@settings(max_examples=80, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(option=st.sampled_from(INT_OPTIONS),
       case=st.one_of(st.tuples(st.just("below"), st.integers(max_value=-1)),
                      st.tuples(st.just("above"), st.integers(min_value=10**6, max_value=2**200)),
                      st.tuples(st.just("float"), st.floats(allow_nan=True, allow_infinity=True)),
                      st.tuples(st.just("text"), st.text(max_size=12)),
                      st.tuples(st.just("bool"), st.booleans())))
def test_random_bad_numbers(option, case, sandbox):
    kind, value = case
    if kind == "below" and option.lo <= value:
        return
    if kind == "above" and value <= option.hi:
        return
    why = problems(option, value, sandbox)
    assert not why, f"{option.name}={value!r} ({kind}): {', '.join(why)}"


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(option=st.sampled_from(TEXT_OPTIONS),
       value=st.tuples(st.text(max_size=8), st.characters(codec="ascii", categories=["Cc"]), st.text(max_size=8))
       .map("".join))
def test_random_control_characters(option, value, sandbox):
    why = problems(option, value, sandbox)
    assert not why, f"{option.name}={value!r}: {', '.join(why)}"


def test_all_or_nothing(sandbox):
    ex = hpcring.Executor(site="local")
    ex.update_parameters(nodes=2)
    with pytest.raises(InvalidParameterError, match="tasks_per_node"):
        ex.update_parameters(nodes=3, tasks_per_node=0)
    assert ex.parameters == {"nodes": 2}
    ex.update_parameters(nodes=None)       # None takes a value back
    assert ex.parameters == {}


# ------------------------------------------------------------------------------ unknown names

CLI_ONLY = [o.name for o in OPTIONS if not o.python]


@pytest.mark.parametrize("name", CLI_ONLY + sorted(SUBMITIT_NAMES) + ["foo", "Nodes", "tasks-per-node", "n"])
def test_unknown_parameter(name, sandbox):
    ex = hpcring.Executor(site="local")
    with pytest.raises(InvalidParameterError) as info:
        ex.update_parameters(**{name: 1})
    text = str(info.value)
    assert repr(name) in text and isinstance(info.value, ValueError)
    assert all(o.name in text for o in PYTHON_OPTIONS), text            # the valid ones, as submitit lists them
    if name in SUBMITIT_NAMES:
        assert "submitit's" in text, text
    if name in CLI_ONLY:
        assert BY_NAME[name].python_hint in text, text
    assert ex.parameters == {}


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
       .filter(lambda n: n not in BY_NAME and not keyword.iskeyword(n)))
def test_random_unknown_names(name, sandbox):
    with pytest.raises(InvalidParameterError, match=re.escape(repr(name))):
        hpcring.Executor(site="local").update_parameters(**{name: 1})


@pytest.mark.parametrize("kwargs", [{"site": ""}, {"site": " "}, {"site": "a\nb"}, {"site": 5}, {"folder": ""},
                                    {"folder": "a\x1bb"}, {"folder": 5}, {"folder": ["x"]}])
def test_bad_constructor_values(kwargs, sandbox):
    with pytest.raises(InvalidParameterError) as info:
        hpcring.Executor(**kwargs)
    assert f"Executor({next(iter(kwargs))}=" in str(info.value) and "hint:" in str(info.value)


# ------------------------------------------------------------------------------ the same as the CLI

SITE = "slurm-tcp"     # partitions cpu (max 16 nodes, 3 days, no GPU) and gpu (4 nodes, 2 GPUs), 32 CPUs per node

# (parameter, Python value, the flag's words); values the site or the bounds refuse included
SAME = [
    *[("nodes", v, [str(v)]) for v in (0, 1, 16, 17, 100000, 100001)],
    *[("tasks_per_node", v, [str(v)]) for v in (0, 1, 4, 32, 33, 1024, 1025)],
    *[("gpus_per_node", v, [str(v)]) for v in (-1, 0, 1, 64, 65)],
    *[("cpus_per_task", v, [str(v)]) for v in (0, 1, 8, 33, 4096, 4097)],
    *[("time", v, [str(v)]) for v in (90, 0, -5, "99:99", "1:00:00", "3-00:00:00", "3-00:00:01", "abc", "0",
                                      "UNLIMITED")],
    *[("partition", v, [v]) for v in ("gpu", "cpu", "nope")],
    ("account", "proj-1", ["proj-1"]), ("qos", "high", ["high"]), ("constraint", "skylake&ib", ["skylake&ib"]),
    ("name", "my run", ["my run"]), ("name", "caf\u00e9", ["caf\u00e9"]),
    *[("timeout", v, [repr(v)]) for v in (0.0, 0.5, 300.0, 604800.0, 604801.0, 1e-9)],
    ("exclusive", True, None), ("exclusive", False, None),
    ("sched_arg", ["--mem=4G"], ["--mem=4G"]), ("sched_arg", ["--signal=B:USR1@60"], ["--signal=B:USR1@60"]),
    ("template", str(ROOT / "templates" / "slurm.sh.j2"), [str(ROOT / "templates" / "slurm.sh.j2")]),
    ("template", "/nonexistent/t.sh.j2", ["/nonexistent/t.sh.j2"]),
    ("template", HELLO, [HELLO]),
    ("container_image", "/img.sif", ["/img.sif"]), ("no_container", True, None),
    ("no_node_history", True, None),
    ("dependency", "afterok:38", ["afterok:38"]), ("dependency", "afterany:38:39", ["afterany:38:39"]),
    ("dependency", "before:38", ["before:38"]), ("after", ["38"], ["38"]), ("after", ["x"], ["x"]),
]


def _cli_words(name, value, words) -> list[str]:
    flag = BY_NAME[name].flag
    if name == "exclusive":
        return ["--exclusive" if value else "--shared"]
    if words is None:
        return [flag]
    return [w for word in words for w in (flag, word)]


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text))


@pytest.mark.parametrize("name,value,words", SAME, ids=lambda x: repr(x)[:30])
def test_flag_and_parameter_mean_the_same(cli, name, value, words, sandbox, monkeypatch):
    monkeypatch.setattr(typer.core, "HAS_RICH", False)      # click's plain usage errors
    result = cli("render", "--site", SITE, *_cli_words(name, value, words), HELLO, catch_exceptions=False)
    ex = hpcring.Executor(site=SITE)
    try:
        ex.update_parameters(**{name: value})
        script, error = ex.render(HELLO), None
    except HpcringError as exc:
        script, error = None, str(exc)
    if result.exit_code == 0:
        assert error is None, f"the flag was accepted, the parameter refused: {error}"
        assert script == result.stdout
    else:
        assert error is not None, f"the flag was refused ({result.output.strip()[:300]}), the parameter accepted"
        cli_facts = _numbers(result.output.replace(HELLO, "").replace(str(ROOT), ""))
        py_facts = _numbers(error.replace(HELLO, "").replace(str(ROOT), ""))
        assert py_facts >= cli_facts - {"2"}, (result.output, error)    # '2': click's exit/usage words
