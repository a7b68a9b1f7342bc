import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """SIGTERM ends the run as Ctrl-C does: pytest names the test it was in and prints its summary.
    scripts/run-tiers.sh stops a tier past its deadline so; SIGINT would not do, as a background job of a
    script starts with SIGINT ignored. (Not in a pytest-xdist worker: its controller stops it.)"""
    # a harness may start us with signals blocked (the mask is inherited): pytest-timeout's
    # SIGALRM and the tier's SIGTERM must arrive
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM, signal.SIGTERM})
    if "PYTEST_XDIST_WORKER" not in os.environ:
        def interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        signal.signal(signal.SIGTERM, interrupt)


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """Isolate hpcring's job registry and local job counter per test."""
    d = tmp_path / "state"
    monkeypatch.setenv("HPCRING_STATE_DIR", str(d))
    return d


@pytest.fixture
def local_env(tmp_path, monkeypatch):
    """The environment without the developer's HPCRING_* variables, on the local site, with job
    records, job folders and a working folder of the test's own: {"state", "jobs", "cwd"}."""
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    dirs = {k: tmp_path / k for k in ("state", "jobs", "cwd")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(dirs["state"]))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(dirs["jobs"]))
    monkeypatch.setenv("HPCRING_SITE", "local")
    return dirs


@pytest.fixture
def site_file(tmp_path):
    """Write a site YAML and return its path."""
    def write(text: str, name: str = "site.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p
    return write


def _env_over(base: dict, env: dict | None) -> dict:
    """``base`` with ``env`` laid over it; an ``env`` value of None removes that variable."""
    out = dict(base)
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@pytest.fixture(scope="session")
def cli():
    """hpcring's CLI in this process: typer's CliRunner on ``hpcring.cli.main.app``.

    ``cli(*args, env=None, input=None, catch_exceptions=True)`` returns the click Result. ``env``
    is applied for the one call; a value of None removes that variable (as CliRunner does).
    Keyword options, so no test file needs a runner of its own:
      ``drop_hpcring_env=True``  the developer's own HPCRING_* variables are removed first (``env``
                                 may still set some);
      ``columns=N``              COLUMNS=N, for help text and tables wrapped at a known width;
      ``no_traceback=True``      asserts the output has no Traceback and nothing but SystemExit
                                 was raised (the CLI's promise for bad input);
      ``app=``                   another typer app (a sub-command's own app) instead of the main one.
    Session-scoped, so hypothesis tests can take it; it keeps no state between calls."""
    from typer.testing import CliRunner

    runner = CliRunner()

    def invoke(*args, env=None, input=None, catch_exceptions=True, drop_hpcring_env=False, columns=None,
               no_traceback=False, app=None):
        over = {k: None for k in os.environ if k.startswith("HPCRING_")} if drop_hpcring_env else {}
        if columns is not None:
            over["COLUMNS"] = str(columns)
        over.update(env or {})
        if app is None:
            from hpcring.cli.main import app       # imported when first used, not at collection
        r = runner.invoke(app, list(args), env=over, input=input, catch_exceptions=catch_exceptions)
        if no_traceback:
            assert "Traceback" not in r.output, r.output
            assert r.exception is None or isinstance(r.exception, SystemExit), r.output
        return r
    return invoke


@pytest.fixture(scope="session")
def hpcring():
    """hpcring's CLI as a subprocess: ``python -m hpcring ARGS`` with this checkout's src first on
    PYTHONPATH, stdin closed (a prompt fails instead of waiting), output captured as text.

    ``hpcring(*args, env=None, timeout=180, cwd=None, drop_hpcring_env=False)`` returns the
    CompletedProcess. ``env`` is laid over os.environ (a value of None removes that variable; it may
    override PYTHONPATH); ``drop_hpcring_env=True`` removes the developer's HPCRING_* variables
    first. ``cwd`` defaults to the checkout. ``timeout`` (seconds) bounds the call:
    subprocess.TimeoutExpired past it, never a hang. Session-scoped; it keeps no state."""
    def run(*args, env=None, timeout: float = 180, cwd=None, drop_hpcring_env=False):
        base = {k: v for k, v in os.environ.items() if not (drop_hpcring_env and k.startswith("HPCRING_"))}
        base["PYTHONPATH"] = str(ROOT / "src")
        return subprocess.run([sys.executable, "-m", "hpcring", *map(str, args)], capture_output=True, text=True,
                              env=_env_over(base, env), timeout=timeout, stdin=subprocess.DEVNULL,
                              cwd=str(cwd or ROOT))
    return run
