"""Generated bad input: every flag of every command, every registered HPCRING_*
variable, job ids and hostlists, mutated by type.

The targets are read from the program itself, so a flag or variable added later is covered without
touching this file: the flags by walking the click command tree typer builds from the app, the
variables by walking :data:`hpcring.config.envvars.VARS`. Each target gets every mutation of its
type (wrong type, bool for a number, NaN/inf, negative, huge, underscores, non-ASCII digits,
control characters, very long) from a fixed catalogue, plus random ones drawn by hypothesis. For
each bad value:

* a non-zero exit (2, a usage error, for flags and variables);
* one message, and it names the field (the flag, the variable, or the argument's value);
* no traceback;
* nothing started: no job submitted, no rank or process spawned, no job record, job folder or
  file written (starters are replaced by a tripwire; state, job and working folders are empty).

Values that are unusual but not wrong (unicode text in a free-text option) only have to be handled
cleanly: no traceback. Fixed regressions (values once mishandled) run at the end, a few through real
processes.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import pytest
import typer
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.core import TyperOption

from hpcring.cli.main import app
from hpcring.config import envvars
from hpcring.config.jobspec import ENV_VARS as JOB_ENV_VARS
from helpers.site_fields import schema_fields, write_site

ROOT = Path(__file__).resolve().parents[2]
HELLO = str(ROOT / "examples" / "hello.py")
LONG = 5000

# ------------------------------------------------------------------------------ the catalogue

INT_BAD = ["abc", "1.5", "1e3", "0x10", "true", "yes", "nan", "inf", "-inf", "1_0", "1_000", "\uff11\uff10",
           "\u0663", "1\x002", "1\n2", "\x1b[31m1", "", "1 2", "-1", "99999999999999999999999",
           "1" + "0" * LONG]
FLOAT_BAD = ["abc", "true", "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400", "-1e400", "1_0", "1_0.5",
             "\uff11", "1\n", "1,5", "", "0x1p3", "1" + "0" * LONG, "-1"]
# Empty and blank: never a value (`--site ""` used to mean the default site, `--template ""` the bundled one)
BLANK = ["", " ", "   "]
TEXT_BAD = ["a\nb", "a\rb", "tab\there", "\x1b[31mred", "a\x00b", "bell\x07", "del\x7f", "x" * LONG] + BLANK
TEXT_ODD = ["\u00fcn\u00efc\u00f8d\u00e9", "\u540d\u524d", "\U0001f600", "\u202eevil", "-"]
SIZE_BAD = ["1e400", "nan", "inf", "-1", "1_0", "\uff18", "99999999999999999999", "64Q", "", "8G5", "1" * LONG,
            "9G", "abc", "1\n"]
JOB_ID_BAD = ["1" * LONG, "a" * 201, "*", "?", "[1]", "../../etc/passwd", "/tmp/x", "a\nb", "\x1b[2J", "",
              "-1", " ", "1 2", "\u0661\u0662", "j\u00f6b", "a\x00b"]
HOSTLIST_BAD = ["n[3-1]", "n[", "a]b", "n[1-2]\x07", "n\x1b[31m", "n[\u0661-\u0663]", "n[1_0]", "n[0-99999999]",
                "n[1-99999999999999999999]", "n[a-b]", "n[,]"]
# Numbers longer than Python's int() converts (4300 digits): refused before conversion.
HOSTLIST_TOO_MANY_DIGITS = ["n[1-" + "9" * LONG + "]", "n" + "9" * LONG]
SCRIPT_BAD = ["/nonexistent/train.py", str(ROOT / "examples"), "a\nb.py", "x" * LONG + ".py", ""]

# Options whose value is one of a few words: any other word is wrong, unicode included.
CHOICES = {("bench", "--collective"), ("bench", "--backend"), ("bench", "--dtype"), ("bench", "--op"),
           ("bench", "--memory"), ("stacks", "--method")}
SIZES = {("bench", "--minbytes"), ("bench", "--maxbytes")}

# A valid invocation of each command, around the one bad value: (before, after). Options go
# first (`run` takes nothing after its command); required arguments come after. A command not
# listed gets no arguments, which is right for most; one with a required argument fails its
# cases loudly, so it gets added here.
BASE = {
    ("submit",): ([], [HELLO]),          # the site: HPCRING_SITE=local (the sandbox), so --site stays free
    ("render",): ([], [HELLO]),
    ("logs",): ([], ["1"]),
    ("cancel",): ([], ["1"]),
    ("stacks",): ([], ["1"]),
    ("timeline",): ([], ["1"]),
    ("report",): ([], ["1"]),
    ("run",): ([], ["--", "true"]),
    ("sites", "show"): ([], ["local"]),
    ("hostlist", "expand"): ([], ["n1"]),
    ("hostlist", "compress"): ([], ["n1"]),
    ("devcluster", "exec"): ([], ["node1", "--", "true"]),
}


def _walk(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if subs:
        for name, sub in sorted(subs.items()):
            yield from _walk(sub, path + (name,))
    else:
        yield path, cmd


COMMANDS = list(_walk(typer.main.get_command(app)))


@dataclass(frozen=True)
class Target:
    path: tuple[str, ...]
    opt: str                 # the long flag
    names: tuple[str, ...]   # every spelling, any of which names the field in a message
    kind: str                # int, float, text, choice, size
    lo: float | None
    hi: float | None

    @property
    def id(self) -> str:
        return " ".join(self.path) + " " + self.opt


def _option_targets() -> list[Target]:
    out = []
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if not isinstance(p, TyperOption) or p.is_flag:
                continue
            desc = p.type_descriptor
            long = max(p.opts, key=len)
            key = (path[-1], long)
            if desc.annotation is int:
                kind = "int"
            elif desc.annotation is float:
                kind = "float"
            elif desc.annotation is str or get_args(desc.annotation) == (str,):
                kind = "choice" if key in CHOICES else "size" if key in SIZES else "text"
            else:
                raise AssertionError(f"{key}: option of a type this generator does not know ({desc.annotation})")
            info = desc.parameter_info
            out.append(Target(path, long, tuple(p.opts), kind, info.min, info.max))
    return out


TARGETS = _option_targets()


def mutations(t: Target) -> tuple[list[str], list[str]]:
    """(values that must be refused, values that must merely not crash) for target ``t``."""
    if t.kind == "int":
        bad = list(INT_BAD)
        if t.lo is not None and t.lo > 0:
            bad.append(str(int(t.lo) - 1))
        if t.hi is not None:
            bad.append(str(int(t.hi) + 1))
        return bad, []
    if t.kind == "float":
        bad = list(FLOAT_BAD)
        if t.lo is not None:
            bad.append(repr(float(t.lo) / 2 if t.lo > 0 else float(t.lo) - 1))
        if t.hi is not None:
            bad += [repr(float(t.hi) * 2), "1e300"]
        return bad, []
    if t.kind == "size":
        return SIZE_BAD + TEXT_BAD, []
    if t.kind == "choice":
        return TEXT_BAD + TEXT_ODD + ["nope", "1"], []
    return list(TEXT_BAD), list(TEXT_ODD)


# ------------------------------------------------------------------------------ running one case

class Started(Exception):
    """Raised by every replaced starter: something tried to submit, spawn or start."""


class Tripwire:
    """While a case runs, everything that starts work (submission, ranks, processes, the dev
    cluster, a rank's bootstrap, exec) records its name and raises :class:`Started` instead."""

    def __init__(self):
        import hpcring
        import hpcring.allocation
        import hpcring.bench.run
        import hpcring.devcluster.cluster
        import hpcring.submit
        self.started: list[str] = []
        self.targets = [(hpcring.submit, "submit"), (hpcring.allocation, "run"), (hpcring.bench.run, "spawn_local"),
                        (hpcring.bench.run, "run_as_rank"), (hpcring, "init"), (hpcring.devcluster.cluster, "up"),
                        (hpcring.devcluster.cluster, "down"), (hpcring.devcluster.cluster, "node_exec_argv"),
                        (subprocess, "Popen"), (os, "execvp"), (os, "fork")]
        self._mp = None

    def _trip(self, name):
        def starter(*a, **kw):
            self.started.append(name)
            raise Started(name)
        return starter

    def __enter__(self):
        self.started.clear()
        self._environ = dict(os.environ)     # a command may set variables (doctor's own secret)
        self._mp = pytest.MonkeyPatch()
        for mod, name in self.targets:
            self._mp.setattr(mod, name, self._trip(f"{mod.__name__}.{name}"))
        # plain usage errors: the same words as rich's boxes at a fraction of the time (the
        # subprocess regressions below see the real, boxed output)
        self._mp.setattr(typer.core, "HAS_RICH", False)
        return self

    def __exit__(self, *exc):
        self._mp.undo()
        if os.environ != self._environ:
            os.environ.clear()
            os.environ.update(self._environ)


TRIPWIRE = Tripwire()


@pytest.fixture
def sandbox(local_env, monkeypatch):
    """Empty state, job and working folders; the environment without the developer's HPCRING_*."""
    monkeypatch.chdir(local_env["cwd"])
    return local_env


def _files(dirs) -> list[str]:
    """What a case left behind: job records, job folders, anything in the working folder."""
    left = [str(p) for p in dirs["state"].rglob("*") if p.is_file()]
    left += [str(p) for p in dirs["jobs"].rglob("*")] + [str(p) for p in dirs["cwd"].rglob("*")]
    return left


def _messages(out: str) -> int:
    """Error messages in ``out``: hpcring's ``error:`` lines and click's usage errors (``Error:``
    plain, a box with rich)."""
    return sum(1 for ln in out.splitlines() if ln.startswith(("error:", "Error:"))) + out.count("\u2500 Error \u2500")


@pytest.fixture(scope="session")
def invoke(cli):
    """One in-process run with the tripwire set: (result, what it tried to start)."""
    def run(argv, env=None):
        with TRIPWIRE:
            result = cli(*argv, env=env, catch_exceptions=True)
        return result, list(TRIPWIRE.started)
    return run


def problems_of(result, names, dirs, started, *, code=None, refused=True) -> list[str]:
    """Everything wrong with how one bad value was handled (empty: handled cleanly)."""
    out = result.output
    exc = result.exception
    why = []
    if "Traceback" in out:
        why.append("traceback in output")
    if exc is not None and not isinstance(exc, (SystemExit, Started)):
        why.append(f"raised {type(exc).__name__}: {str(exc)[:120]}")
    if not refused:
        return why
    if result.exit_code == 0 or isinstance(exc, Started):
        why.append("accepted")
    elif code is not None and result.exit_code != code:
        why.append(f"exit {result.exit_code}, not {code}")
    if not isinstance(exc, Started) and result.exit_code != 0:
        if _messages(out) != 1:
            why.append(f"{_messages(out)} error messages")
        if not any(n in out for n in names):
            why.append(f"no mention of {names[0]}")
    if started:
        why.append(f"started {started}")
    left = _files(dirs)
    if left:
        why.append(f"left {left[:3]}")
    return why


def run_option(invoke, t: Target, value: str, dirs, refused=True) -> list[str]:
    before, after = BASE.get(t.path, ([], []))
    result, started = invoke([*t.path, *before, t.opt, value, *after])
    return problems_of(result, t.names, dirs, started, code=2, refused=refused)


def _fmt(failures) -> str:
    return "\n".join(f"  {what!r:.60}: {', '.join(why)}" for what, why in failures)


# ------------------------------------------------------------------------------ flags

def test_every_command_and_flag_is_a_target():
    """The walk found the commands and flags (a broken walk would make every test below vacuous)."""
    ids = {t.id for t in TARGETS}
    assert {"submit --nodes", "render --time", "bench --maxbytes", "bench --stepfactor", "run --nodes",
            "stacks --timeout", "status --last", "logs --rank", "devcluster up --nodes", "doctor --bw-seconds",
            "timeline --output", "report --html"} <= ids
    assert len(TARGETS) >= 50 and all(t.kind in ("int", "float", "text", "choice", "size") for t in TARGETS)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_bad_flag_value(invoke, target, sandbox):
    bad, odd = mutations(target)
    failures = [(v, why) for v in bad if (why := run_option(invoke, target, v, sandbox))]
    failures += [(v, why) for v in odd if (why := run_option(invoke, target, v, sandbox, refused=False))]
    assert not failures, f"{target.id}: {len(failures)} of {len(bad) + len(odd)} values mishandled:\n{_fmt(failures)}"


NUMBER_TARGETS = [t for t in TARGETS if t.kind in ("int", "float")]


def _not_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(target=st.sampled_from(NUMBER_TARGETS),
       case=st.one_of(
           st.tuples(st.just("huge"), st.integers(min_value=2**63, max_value=2**200).map(str)),
           st.tuples(st.just("negative"), st.integers(max_value=-1).map(str)),
           st.tuples(st.just("underscore"), st.integers(min_value=10, max_value=10**6)
                     .map(lambda n: f"{str(n)[0]}_{str(n)[1:]}")),
           st.tuples(st.just("nan/inf"), st.sampled_from(["nan", "inf", "-inf", "NAN", "+inf", "infinity"])),
           st.tuples(st.just("text"), st.text(min_size=1, max_size=20).filter(_not_a_number))))
def test_random_bad_numbers(invoke, target, case, sandbox):
    kind, value = case
    if kind == "huge" and target.kind == "float" and target.hi is None:
        return      # an unbounded float (doctor --timeout) is bounded by the command that uses it
    why = run_option(invoke, target, value, sandbox)
    assert not why, f"{target.id} {value!r} ({kind}): {', '.join(why)}"


TEXT_TARGETS = [t for t in TARGETS if t.kind in ("text", "choice", "size")]


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(target=st.sampled_from(TEXT_TARGETS),
       value=st.tuples(st.text(max_size=8), st.characters(codec="ascii", categories=["Cc"]), st.text(max_size=8))
       .map("".join))
def test_random_control_characters_in_text_flags(invoke, target, value, sandbox):
    why = run_option(invoke, target, value, sandbox)
    assert not why, f"{target.id} {value!r}: {', '.join(why)}"


# ------------------------------------------------------------------------------ arguments

@pytest.mark.parametrize("cmd", ["status", "logs", "cancel", "stacks", "timeline", "report"])
def test_bad_job_id(invoke, cmd, sandbox):
    failures = []
    for value in JOB_ID_BAD:
        result, started = invoke([cmd, "--", value])
        names = ("job id", "JOB", "timeline files for") + ((value,) if value.strip() else ())
        if why := problems_of(result, names, sandbox, started):
            failures.append((value, why))
    assert not failures, f"{cmd}: {len(failures)} of {len(JOB_ID_BAD)} job ids mishandled:\n{_fmt(failures)}"


def test_bad_hostlist(invoke, sandbox):
    failures = []
    for value in HOSTLIST_BAD:
        result, started = invoke(["hostlist", "expand", "--", value])
        if why := problems_of(result, ("hostlist",), sandbox, started, code=1):
            failures.append((value, why))
    for value in ("a\x07", "b\x1b[0m", "\x00"):
        result, started = invoke(["hostlist", "compress", "--", "n1", value])
        if why := problems_of(result, ("host",), sandbox, started, code=1):
            failures.append((value, why))
    assert not failures, _fmt(failures)


@pytest.mark.parametrize("value", HOSTLIST_TOO_MANY_DIGITS, ids=["range", "suffix"])
def test_hostlist_number_too_long_to_convert(invoke, value, sandbox):
    result, started = invoke(["hostlist", "expand", "--", value])
    why = problems_of(result, ("hostlist",), sandbox, started, code=1)
    assert not why, why


# `hpcring nodes clear NODE...`: a name that is no host name is refused before the site's history
# is touched (an unknown but valid name is exit 1: "not in the node history", tests/unit/test_nodehistory.py)
NODE_BAD = [v for v in JOB_ID_BAD if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", v)] + \
    ["n;rm -rf /", "n o", "$(id)", "-", ".n", "n\u00e9", "n" * 254]


def test_bad_node_name(invoke, sandbox):
    failures = []
    for value in NODE_BAD:
        for site in ("local", "devcluster"):
            result, started = invoke(["nodes", "clear", "--site", site, "--", value])
            if why := problems_of(result, ("no host name", "none was named", "node"), sandbox, started, code=2):
                failures.append((value, why))
    assert not failures, _fmt(failures)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(min_size=1, max_size=30).filter(lambda s: not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", s)))
def test_random_bad_node_names(invoke, sandbox, value):
    result, started = invoke(["nodes", "clear", "--site", "devcluster", "--", value])
    assert not problems_of(result, ("no host name", "none was named", "node"), sandbox, started, code=2), result.output


@pytest.mark.parametrize("cmd", [["render"], ["submit", "--dry-run"], ["submit"]])
def test_bad_script(invoke, cmd, sandbox):
    failures = []
    for value in SCRIPT_BAD:
        result, started = invoke([*cmd, "--site", "local", "--", value])
        if why := problems_of(result, ("script",), sandbox, started, code=2):
            failures.append((value, why))
    assert not failures, _fmt(failures)


# ------------------------------------------------------------------------------ site keys that name a path

SITE_FIELDS = schema_fields()
PATH_FIELDS = [f for f in SITE_FIELDS if f.path_key]
_PATH_LIKE = re.compile(r"(?:^|_)(?:dir|path|file|template|python|workdir|hpcring)$")
BLANK_YAML = ['""', "''", '" "', '"   "']


def test_every_key_that_names_a_path_is_declared_one():
    """A site key named like a path is declared as one (schema.PATH), so the cases below cover a new
    one the day it is added."""
    named = {f.dotted for f in SITE_FIELDS
             if f.kind == "str" and isinstance(f.path[-1], str) and _PATH_LIKE.search(f.path[-1])}
    assert named <= {f.dotted for f in PATH_FIELDS}, named - {f.dotted for f in PATH_FIELDS}
    assert {"job_dir", "template", "python", "container.workdir", "remote.workdir",
            "remote.hpcring"} <= {f.dotted for f in PATH_FIELDS}


@pytest.mark.parametrize("field", PATH_FIELDS, ids=lambda f: f.dotted)
def test_empty_path_in_a_site_file(invoke, field, sandbox, tmp_path):
    """An empty or blank path key (``job_dir: ""`` was the folder hpcring started in, ``template: ""``
    the bundled template) stops validate, render and submit with one message naming the file, the
    line and the key; HPCRING_JOB_DIR (set in the sandbox) does not hide it."""
    failures = []
    for i, raw in enumerate(BLANK_YAML):
        folder = tmp_path / f"site{i}"
        folder.mkdir()
        site, lines = write_site(folder, "slurm", field, raw)
        for argv in (["sites", "validate", str(site)], ["render", "--site", str(site), HELLO],
                     ["submit", "--site", str(site), HELLO]):
            result, started = invoke(argv)
            why = problems_of(result, (field.dotted,), sandbox, started, code=1)
            named = re.findall(re.escape(str(site)) + r":(\d+) (\S+): empty", result.output)
            if len(named) != 1 or int(named[0][0]) not in lines or named[0][1] != field.dotted:
                why.append(f"names {named}, want one of lines {sorted(lines)} and key {field.dotted}")
            if result.stdout:
                why.append("rendered something")
            if why:
                failures.append((f"{argv[0]} {raw}", why))
    assert not failures, f"{field.dotted}:\n{_fmt(failures)}"


# ------------------------------------------------------------------------------ templates

TEMPLATES = ROOT / "templates"
SITE_OF = {"slurm": "slurm-tcp", "lsf": "lsf-summit", "local": "local"}     # a bundled site per scheduler
_STARTS_RANKS = re.compile(r"launch_command\(|\bcommand\b")


def not_templates(folder: Path, scheduler: str) -> dict[str, Path]:
    """Readable files that are not job-script templates: files of this repository, binary and empty
    files, a shell script that starts no rank, and the scheduler's bundled template with its
    interpreter line, or every line that starts the ranks, taken out."""
    own = (TEMPLATES / f"{scheduler}.sh.j2").read_text().splitlines(keepends=True)
    made = {
        "empty": b"",
        "binary": bytes(range(256)) * 4,
        "latin-1": "#!/bin/bash\n# caf\xe9\n{{ command }}\n".encode("latin-1"),
        "plain shell": b"#!/bin/bash\necho hello\n",
        "no shebang": b"{{ command }}\n",
        "blank first line": b"\n#!/bin/bash\n{{ command }}\n",
        "undefined and no ranks": b"#!/bin/bash\n{{ nodes }}\n",
        "bundled without its shebang": "".join(own[1:]).encode(),
        "bundled without its launch": "".join(ln for ln in own if not _STARTS_RANKS.search(ln)).encode(),
    }
    out = {name: folder / f"{i}.sh.j2" for i, name in enumerate(made)}
    for name, path in out.items():
        path.write_bytes(made[name])
    for path in (ROOT / "README.md", ROOT / "examples" / "hello.py", ROOT / "site_configs" / "local.yaml",
                 ROOT / "pyproject.toml", *sorted((TEMPLATES / "partials").glob("*.j2"))):
        out[str(path.relative_to(ROOT))] = path
    return out


@pytest.mark.parametrize("scheduler", sorted(SITE_OF))
def test_a_file_that_is_no_template(invoke, scheduler, sandbox, tmp_path):
    """--template FILE, FILE readable but no job-script template: render, submit --dry-run and
    submit stop with one message naming --template and saying what a template is; nothing is
    rendered, submitted or written."""
    folder = tmp_path / "templates"
    folder.mkdir()
    failures = []
    for name, path in not_templates(folder, scheduler).items():
        for cmd in (["render"], ["submit", "--dry-run"], ["submit"]):
            result, started = invoke([*cmd, "--site", SITE_OF[scheduler], "--template", str(path), HELLO])
            why = problems_of(result, ("--template",), sandbox, started, code=1)
            if not re.search(r"is not a job-script template|not a job-script template", result.output):
                why.append("does not say it is no job-script template")
            if "hint:" not in result.output:
                why.append("no hint")
            if result.stdout:
                why.append("rendered something")
            if why:
                failures.append((f"{' '.join(cmd)} {name}", why))
    assert not failures, _fmt(failures)


@pytest.mark.parametrize("site", sorted(p.stem for p in (ROOT / "site_configs").glob("*.yaml")))
def test_the_bundled_templates_are_templates(invoke, site, sandbox):
    """Every bundled site's own template, given as --template, renders exactly what it renders
    without the flag."""
    from hpcring.config.site import load_site
    from hpcring.schedulers.render import SCHEDULER_TEMPLATES
    template = TEMPLATES / SCHEDULER_TEMPLATES[load_site(site).config.scheduler]
    plain, _ = invoke(["render", "--site", site, HELLO])
    given, _ = invoke(["render", "--site", site, "--template", str(template), HELLO])
    assert plain.exit_code == 0 and plain.stdout.startswith("#!"), plain.output
    assert given.exit_code == 0 and given.stdout == plain.stdout, given.output


# ------------------------------------------------------------------------------ environment

def env_mutations(v: envvars.Var) -> tuple[list[str], list[str]]:
    """(values that must be refused, values that must merely not crash) for variable ``v``.
    Whitespace around a value is stripped (as a shell user expects) and an environment string
    cannot hold NUL, so control characters sit inside the value."""
    if v.kind in ("int", "float"):
        bad = [x for x in (INT_BAD if v.kind == "int" else FLOAT_BAD) if x.strip() == x and x and "\x00" not in x]
        if v.lo is not None:
            bad.append(str(int(v.lo) - 1) if v.kind == "int" else repr(float(v.lo) - 1))
        if v.hi is not None:
            bad.append(str(int(v.hi) + 1) if v.kind == "int" else repr(float(v.hi) * 2))
        return bad, []
    if v.kind == "bool":
        return ["maybe", "2", "yes please", "\uff11", "tru", "y\x07es", "1_0", "x" * LONG], []
    if v.kind == "choice":
        return ["nope", "\u00fcn\u00efc\u00f8d\u00e9", "ri\x07ng", "x" * LONG], []
    if v.kind == "time":
        return ["abc", "0", "-5", "UNLIMITED", "1_0", "\uff11\uff10", "99999999999", "1:2:3:4", "1\x072"], []
    if v.kind == "metrics":
        return (["on", "http", "http:9400", "http::9400", "http:host:0", "http:host:65536", "http:host:94_00",
                 "http:a b:1", "textfile:", "ftp:x", "\u00fcn\u00efc\u00f8d\u00e9", "http:h:\uff19", "a\x07b",
                 "x" * LONG],
                ["OFF", "http:127.0.0.1:9400", "http:[::1]:9400", "textfile:/var/lib/\u00fcn\u00efc\u00f8d\u00e9"])
    bad = ["a\x07b", "a\x1b[31mb", "a\nb", "a\tb"] + (["x" * LONG] if v.max_len is not None else [])
    return bad, ["\u00fcn\u00efc\u00f8d\u00e9", "\u540d\u524d"]


ENV_CASES = [(v, value, True) for v in envvars.VARS for value in env_mutations(v)[0]] + \
            [(v, value, False) for v in envvars.VARS for value in env_mutations(v)[1]]


@pytest.mark.parametrize("var", envvars.VARS, ids=lambda v: v.name)
def test_empty_environment_value_is_unset(var):
    """An empty (or blank) variable is an unset one, as most tools read it: the default, no error.
    (An empty *flag* is an error: see BLANK in the flag cases.)"""
    for value in BLANK:
        envvars.check_environ({var.name: value})
        assert envvars.get(var.name, {var.name: value}) == var.default


@pytest.mark.parametrize("name", sorted({*JOB_ENV_VARS.values(), "HPCRING_SITE"}))
def test_empty_job_variable_renders_as_unset(invoke, name, sandbox):
    """HPCRING_SITE="" and every job-setting variable set empty render the very script they render
    unset: the default site, the site's or built-in value."""
    unset, _ = invoke(["render", HELLO], env={name: None})
    empty, started = invoke(["render", HELLO], env={name: ""})
    assert unset.exit_code == 0 and unset.stdout.startswith("#!"), unset.output
    assert empty.exit_code == 0 and empty.stdout == unset.stdout and not started, empty.output


def test_every_registered_variable_is_a_target():
    assert {v.name for v, _, _ in ENV_CASES} == set(envvars.REGISTRY)


@pytest.mark.parametrize("var", envvars.VARS, ids=lambda v: v.name)
def test_bad_environment_value(invoke, var, sandbox):
    """Every value through the checker that every command, the rank entry and hpcring.init() call
    first; the first few also through a real command (the wiring is the same for all)."""
    failures = []
    cases = [(value, refused) for v, value, refused in ENV_CASES if v is var]
    for i, (value, refused) in enumerate(cases):
        why = []
        if i < 3 or not refused:
            result, started = invoke(["hostlist", "expand", "n1"], env={var.name: value})
            why = problems_of(result, (var.name,), sandbox, started, code=2, refused=refused)
        try:
            envvars.check_environ({var.name: value})
            if refused:
                why.append("check_environ accepted it")
        except envvars.UsageError as exc:
            if not refused:
                why.append(f"check_environ refused it: {exc}")
            elif var.name not in str(exc) or "hint:" not in str(exc) or len(str(exc)) > 1000:
                why.append(f"check_environ's message lacks the name or a hint, or is too long: {str(exc)[:200]}")
        if why:
            failures.append((value, why))
    assert not failures, f"{var.name}:\n{_fmt(failures)}"


# ------------------------------------------------------------------------------ fixed regressions

@pytest.fixture(scope="session")
def hpcring(hpcring):
    """The conftest subprocess runner without the developer's own HPCRING_* variables."""
    return functools.partial(hpcring, drop_hpcring_env=True, timeout=60)


REGRESSIONS = [
    # (argv, environment, exit code, words the message must contain)
    (["bench", "--json", "/nonexistent/dir/x.json"], {}, 2, ["--json", "/nonexistent/dir"]),
    (["bench", "-b", "1e400"], {}, 2, ["--minbytes"]),
    (["bench", "-f", "nan"], {}, 2, ["--stepfactor"]),
    (["bench", "-n", "2", "-e", "99999999999999999999"], {}, 2, ["--maxbytes", "8589934592"]),
    (["status", "1" * LONG], {}, 2, ["not a job id", "5000 characters"]),
    (["status"], {"HPCRING_STATE_DIR": "/dev/null"}, 2, ["HPCRING_STATE_DIR"]),
    (["render", HELLO, "--site", "devcluster"], {"HPCRING_NODES": "1_0"}, 2, ["HPCRING_NODES", "underscores"]),
    (["render", "/nonexistent/train.py", "--site", "devcluster"], {}, 2, ["does not exist"]),
    (["submit", str(ROOT / "examples"), "--site", "local", "--dry-run"], {}, 2, ["is a directory"]),
    (["run", "-N", "1_0", "--", "true"], {}, 2, ["--nodes", "underscores"]),
    (["nodes", "list", "--site", "devcluster"], {"HPCRING_BAD_NODE_DAYS": "0"}, 2, ["HPCRING_BAD_NODE_DAYS"]),
    (["render", HELLO, "--site", "devcluster"], {"HPCRING_BAD_NODE_BLAMES": "2.5"}, 2, ["HPCRING_BAD_NODE_BLAMES"]),
    (["submit", HELLO, "--site", "devcluster", "--no-node-history"], {"HPCRING_BAD_NODE_BLAMES": "-1"}, 2,
     ["HPCRING_BAD_NODE_BLAMES"]),
]


@pytest.mark.parametrize("argv,env,code,words", REGRESSIONS[:4] + REGRESSIONS[5:7],
                         ids=lambda x: " ".join(x)[:40] if isinstance(x, list) else None)
def test_regression_subprocess(hpcring, argv, env, code, words, tmp_path):
    """The regressions through a real process, in an empty folder: exit code, message, no
    traceback, no rank started (no barrier report), nothing left behind."""
    env = {"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_JOB_DIR": str(tmp_path / "jobs"), **env}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    p = hpcring(*argv, env=env, cwd=cwd)
    out = p.stdout + p.stderr
    assert p.returncode == code, out
    assert "Traceback" not in out and "barrier" not in out and "COLLECTIVE" not in out, out
    for w in words:
        assert w in out, out
    assert not list(cwd.iterdir()) and not (tmp_path / "jobs").exists(), list(cwd.iterdir())


@pytest.mark.parametrize("argv,env,code,words", REGRESSIONS, ids=lambda x: " ".join(x)[:40] if isinstance(x, list) else None)
def test_regression_in_process(invoke, argv, env, code, words, sandbox):
    result, started = invoke(argv, env=env or None)
    out = result.output
    assert result.exit_code == code, out
    assert "Traceback" not in out and _messages(out) == 1, out
    for w in words:
        assert w in out, out
    assert not started and not _files(sandbox)


@pytest.mark.parametrize("cmd", ["logs", "cancel"])
def test_long_job_id_to_logs_and_cancel(invoke, cmd, sandbox):
    result, _ = invoke([cmd, "7" * LONG])
    assert result.exit_code == 2 and "not a job id" in result.output and "Traceback" not in result.output
    assert len(result.output) < 1000                   # the value is cut, not echoed 5000 characters long


def test_standalone_bench_leaves_no_run_folder(hpcring, tmp_path):
    """A real standalone run with tiny sizes: the table, exit 0, and no empty run<pid> folder in
    HPCRING_JOB_DIR or the working folder."""
    jobs, cwd = tmp_path / "jobs", tmp_path / "cwd"
    jobs.mkdir()
    cwd.mkdir()
    p = hpcring("bench", "-n", "2", "-b", "8", "-e", "16", "--iters", "1", "--warmup", "0",
                 env={"HPCRING_JOB_DIR": str(jobs), "HPCRING_STATE_DIR": str(tmp_path / "state")}, cwd=cwd,
                 timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Avg bus bandwidth" in p.stdout
    assert not list(jobs.iterdir()) and not list(cwd.iterdir()), (list(jobs.iterdir()), list(cwd.iterdir()))


def test_results_that_cannot_be_written_are_reported_after_the_run(tmp_path):
    """--json checked up front can still fail at the end (the folder removed meanwhile): rank 0
    returns the error to raise after the final barrier instead of dying before it."""
    from hpcring.bench.options import BenchOptions
    from hpcring.bench.run import _write_results
    from hpcring.errors import HpcringError
    folder = tmp_path / "out"
    folder.mkdir()
    opts = BenchOptions(json=str(folder / "r.json")).check()
    folder.rmdir()
    lines = []
    err = _write_results(opts, {"rows": []}, lines.append)
    assert isinstance(err, HpcringError) and "--json" in str(err) and "hint:" in str(err)
    assert lines == []
