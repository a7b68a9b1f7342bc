"""The test suite's shape, read from its source: one CLI runner of each kind (the `cli` and `hpcring`
fixtures of tests/conftest.py), shared code through fixtures and tests/helpers rather than imports of
other test modules, no sys.path edits in test files, in-process unit tests, and docstrings and
comments that say what is tested rather than which issue asked for it."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Files other engineers were changing when the runners were unified; each still holds a runner of
# its own, to be moved onto the conftest fixtures by whoever finishes it (then drop it from here).
OWN_RUNNER_ALLOWED: dict[str, str] = {}

# The one sys.path edit: the LSF emulator runs on the system python, outside pytest and the venv.
SYS_PATH_ALLOWED = {"lsf_emulation/lsfemu.py"}

# tests/unit files whose source names a rank launch; each is refused before any rank starts, which a
# reading of the source cannot tell apart from a real launch, so they are listed with the reason.
UNIT_LAUNCH_ALLOWED = {
    "unit/test_bad_input.py": "`hpcring run` with bad input: refused before any rank starts",
}

LAUNCHERS = ("mpirun", "srun", "salloc")


def _sources() -> list[tuple[str, ast.Module, str]]:
    out = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if "__pycache__" in rel:
            continue
        text = path.read_text()
        out.append((rel, ast.parse(text, filename=str(path)), text))
    return out


SOURCES = _sources()


def _is_conftest(rel: str) -> bool:
    return rel.rsplit("/", 1)[-1] == "conftest.py"


def _const(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _sequences(tree: ast.AST):
    """Every list/tuple literal's elements and every call's positional arguments (argv shapes)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            yield node.elts
        elif isinstance(node, ast.Call):
            yield node.args


def cli_runner_calls(tree: ast.AST) -> list[int]:
    """Lines that build a typer/click CliRunner."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == "CliRunner")
        or (isinstance(n.func, ast.Attribute) and n.func.attr == "CliRunner"))]


def subprocess_runners(tree: ast.AST) -> list[str]:
    """Functions (or lambdas) that take ``*args`` and run ``python -m hpcring *args``: a copy of the
    `hpcring` fixture."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or fn.args.vararg is None:
            continue
        star = fn.args.vararg.arg
        for seq in _sequences(fn):
            for i in range(len(seq) - 2):
                a, b, c = seq[i:i + 3]
                if (_const(a), _const(b)) == ("-m", "hpcring") and isinstance(c, ast.Starred) \
                        and isinstance(c.value, ast.Name) and c.value.id == star:
                    found.append(f"{getattr(fn, 'name', 'lambda')} (line {fn.lineno})")
    return found


def imports_of_test_modules(tree: ast.AST) -> list[int]:
    """Lines that import a test module of this suite (``from test_x import``, ``import test_x``,
    ``unit.test_x``); a library's own test utilities (``hydra.test_utils``) are not ours."""
    def is_test_module(name: str | None) -> bool:
        parts = (name or "").split(".")
        ours = parts[0].startswith("test_") or parts[0] in ("unit", "integration", "devcluster", "helpers", "workers")
        return ours and any(part.startswith("test_") for part in parts)
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and is_test_module(n.module):
            lines.append(n.lineno)
        elif isinstance(n, ast.Import) and any(is_test_module(a.name) for a in n.names):
            lines.append(n.lineno)
    return lines


def _is_sys_path(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and \
        isinstance(node.value, ast.Name) and node.value.id == "sys"


def sys_path_additions(tree: ast.AST) -> list[int]:
    """Lines that add to sys.path: insert/append/extend, ``+=``, or a new list assigned to it.
    (Putting back a saved copy with ``sys.path[:] = saved`` adds nothing and is not counted.)"""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and _is_sys_path(n.func.value) \
                and n.func.attr in ("insert", "append", "extend"):
            lines.append(n.lineno)
        elif isinstance(n, ast.AugAssign) and _is_sys_path(n.target):
            lines.append(n.lineno)
        elif isinstance(n, ast.Assign) and any(_is_sys_path(t) for t in n.targets):
            lines.append(n.lineno)
    return lines


def rank_launches(tree: ast.AST) -> list[int]:
    """Lines whose argv starts ranks: ``hpcring run`` (a subprocess, or the `hpcring` fixture's
    first word), or a launcher (mpirun, srun, salloc) as the first word of a subprocess argv."""
    lines = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Call):
            continue
        func = n.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "hpcring" and n.args and _const(n.args[0]) == "run":
            lines.append(n.lineno)
        if name not in ("run", "Popen", "check_call", "check_output", "call") or not n.args:
            continue
        argv = n.args[0]
        if not isinstance(argv, ast.List) or not argv.elts:
            continue
        words = [_const(e) for e in argv.elts]
        if words[0] in LAUNCHERS or any(words[i:i + 3] == ["-m", "hpcring", "run"] for i in range(len(words))):
            lines.append(n.lineno)
    return lines


ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def issue_citations(tree: ast.AST, text: str) -> list[int]:
    """Lines of docstrings and comments that cite an issue by number ("issue" and a number)."""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(n, clean=False)
            if doc and ISSUE.search(doc):
                lines.append(n.body[0].lineno)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and ISSUE.search(tok.string):
            lines.append(tok.start[0])
    return lines


# ------------------------------------------------------------------------------ the checks, on the suite

def test_the_cli_runners_are_the_conftest_fixtures():
    copies = {rel: (cli_runner_calls(tree), subprocess_runners(tree)) for rel, tree, _ in SOURCES
              if not _is_conftest(rel)}
    copies = {rel: c for rel, c in copies.items() if c[0] or c[1]}
    unexpected = {rel: c for rel, c in copies.items() if rel not in OWN_RUNNER_ALLOWED}
    assert not unexpected, ("use the `cli` (in-process) or `hpcring` (subprocess) fixture of tests/conftest.py "
                            f"instead of a runner of its own: {unexpected}")
    stale = {rel for rel in set(OWN_RUNNER_ALLOWED) - set(copies) if (TESTS / rel).exists()}
    assert not stale, f"allowed but no runner there any more: drop {stale} from the list"


def test_no_test_module_imports_another():
    found = {rel: lines for rel, tree, _ in SOURCES if (lines := imports_of_test_modules(tree))}
    assert not found, f"share through a conftest fixture or tests/helpers, not a test module: {found}"


def test_at_most_the_one_sys_path_edit():
    found = {rel: lines for rel, tree, _ in SOURCES if (lines := sys_path_additions(tree))}
    assert set(found) <= SYS_PATH_ALLOWED, f"tests/ is on sys.path through the root conftest: {found}"
    assert sum(len(v) for v in found.values()) <= 1, found


def test_unit_tests_start_no_ranks():
    found = {rel: lines for rel, tree, _ in SOURCES if rel.startswith("unit/") and (lines := rank_launches(tree))}
    unexpected = {rel: lines for rel, lines in found.items() if rel not in UNIT_LAUNCH_ALLOWED}
    assert not unexpected, f"a test that starts ranks belongs in tests/integration: {unexpected}"
    assert not set(UNIT_LAUNCH_ALLOWED) - set(found), "allowed but it launches nothing any more: drop it"


def test_docstrings_and_comments_cite_no_issue_numbers():
    found = {rel: lines for rel, tree, text in SOURCES if (lines := issue_citations(tree, text))}
    assert not found, f"say what is tested, not which issue asked for it: {found}"


# ------------------------------------------------------------------------------ the readers catch what they must

@pytest.mark.parametrize("code,runners,cli_runners", [
    ("def hpcring(*args, env=None):\n"
     "    return subprocess.run([sys.executable, '-m', 'hpcring', *args], env=env)\n", 1, 0),
    ("def _h(*argv, env):\n    return run(sys.executable, '-m', 'hpcring', *argv, env=env)\n", 1, 0),
    ("f = lambda *a: subprocess.run([sys.executable, '-m', 'hpcring', *a])\n", 1, 0),
    ("runner = CliRunner()\n", 0, 1),
    ("r = typer.testing.CliRunner().invoke(app, [])\n", 0, 1),
    # not copies: a fixed command, a fixture built on the conftest one, a string of code
    ("def go(tmp):\n    return subprocess.run([sys.executable, '-m', 'hpcring', 'status'])\n", 0, 0),
    ("def hpcring(hpcring):\n    return functools.partial(hpcring, timeout=300)\n", 0, 0),
    ("code = 'r = CliRunner().invoke(app, [])'\n", 0, 0),
])
def test_the_runner_reader(code, runners, cli_runners):
    tree = ast.parse(code)
    assert (len(subprocess_runners(tree)), len(cli_runner_calls(tree))) == (runners, cli_runners)


def test_the_other_readers():
    tree = ast.parse("from test_cli import x\nimport unit.test_top\nfrom hydra.test_utils import y\n"
                     "sys.path.insert(0, 'x')\nsys.path += ['y']\nsys.path[:] = saved\n"
                     "subprocess.run(['mpirun', '-np', '2', 'x'])\nhpcring('run', '--', 'true')\n"
                     "subprocess.run([sys.executable, '-m', 'hpcring', 'run', '--', 'x'])\n"
                     "subprocess.run([sys.executable, '-m', 'hpcring', 'status'])\n")
    assert imports_of_test_modules(tree) == [1, 2]
    assert sorted(sys_path_additions(tree)) == [4, 5]
    assert sorted(rank_launches(tree)) == [7, 8, 9]
    text = '"""Bad input (issue 19): flags."""\n# issues 24 and 25: arrays\n# an issue with 3 ranks\nx = 1\n'
    assert issue_citations(ast.parse(text), text) == [1, 2]


# ------------------------------------------------------------------------------ the conftest runners keep their contract

HELLO = str(TESTS.parent / "examples" / "hello.py")


def test_the_cli_fixture_lays_env_over_and_can_drop_the_developers(cli, monkeypatch):
    monkeypatch.setenv("HPCRING_SITE", "nosuchsite")
    r = cli("render", HELLO)
    assert r.exit_code == 1 and "nosuchsite" in r.stderr, r.output
    assert "nosuchsite" not in cli("render", HELLO, drop_hpcring_env=True).output
    assert "nosuchsite" not in cli("render", HELLO, env={"HPCRING_SITE": None}).output
    assert cli("render", HELLO, env={"HPCRING_SITE": "devcluster"}).exit_code == 0


def test_the_cli_fixture_catches_a_traceback_when_asked(cli):
    import typer
    app = typer.Typer()

    @app.command()
    def boom():
        raise ValueError("boom")

    assert isinstance(cli(app=app).exception, ValueError)
    with pytest.raises(AssertionError):
        cli(app=app, no_traceback=True)


def test_the_hpcring_fixture_runs_this_checkout_with_env_over(hpcring, monkeypatch):
    monkeypatch.setenv("HPCRING_SITE", "nosuchsite")
    r = hpcring("render", HELLO, timeout=60)
    assert r.returncode == 1 and "nosuchsite" in r.stderr, r.stderr
    r = hpcring("render", HELLO, env={"HPCRING_SITE": "devcluster"}, timeout=60)
    assert r.returncode == 0 and "#SBATCH" in r.stdout, r.stderr
    assert "nosuchsite" not in hpcring("render", HELLO, drop_hpcring_env=True, timeout=60).stderr
