"""The collective deadline has one owner (hpcring.config.envvars): --timeout on submit/render/run
> HPCRING_TIMEOUT > site `timeout` > 300 s, resolved once, handed down to the C comm as a value,
and separate from the bootstrap deadline of hpcring.init(timeout=)."""
from __future__ import annotations

import math

import pytest

from hpcring.config import envvars
from hpcring.config.jobspec import resolve_job
from hpcring.config.site import load_site
from hpcring.errors import UsageError

# generated bad values: each must be refused with a message naming where it came from
BAD = ["0", "-1", "-0.0", "nan", "-nan", "inf", "-inf", "abc", "", " ", "1e300", "604801", "5s", "0x10"]


def _script(tmp_path) -> str:
    p = tmp_path / "train.py"
    p.write_text("print('hi')\n")
    return str(p)


def _exported(out: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith("export HPCRING_TIMEOUT=")).split("=", 1)[1]


@pytest.mark.parametrize("cli,env,want,source", [
    (None, None, 120.0, "site local"),          # the bundled local site says 120
    (None, "45", 45.0, "env HPCRING_TIMEOUT"),
    ("7.5", "45", 7.5, "cli"),
    ("7.5", None, 7.5, "cli"),
])
def test_precedence_cli_env_site(tmp_path, cli, env, want, source):
    site = load_site("local")
    environ = {} if env is None else {"HPCRING_TIMEOUT": env}
    job = resolve_job(site, _script(tmp_path), cli={"timeout": cli}, environ=environ)
    assert (job.timeout, job.sources["timeout"]) == (want, source)


@pytest.mark.parametrize("cmd", ["render", "submit"])
def test_cli_flag_reaches_the_job_environment(cli, tmp_path, monkeypatch, cmd):
    monkeypatch.setenv("HPCRING_TIMEOUT", "45")
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    args = [cmd, _script(tmp_path), "--site", "local", "--timeout", "123456.7"]
    r = cli(*(args + (["--dry-run"] if cmd == "submit" else [])))
    assert r.exit_code == 0, r.output
    assert float(_exported(r.output)) == 123456.7      # exact: not rounded to 6 digits by :g
    r = cli(*([cmd, _script(tmp_path), "--site", "local"] + (["--dry-run"] if cmd == "submit" else [])))
    assert _exported(r.output) == "45"


@pytest.mark.parametrize("value", BAD)
def test_bad_cli_values_are_usage_errors(cli, tmp_path, value):
    r = cli("render", _script(tmp_path), "--site", "local", f"--timeout={value}")
    assert r.exit_code == 2, (value, r.output)
    assert "--timeout" in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("value", BAD)
def test_bad_values_from_every_source_name_it(tmp_path, value):
    site = load_site("local")
    with pytest.raises(UsageError, match="--timeout"):
        resolve_job(site, _script(tmp_path), cli={"timeout": value}, environ={})
    if value.strip():          # an empty variable counts as unset
        with pytest.raises(UsageError, match="HPCRING_TIMEOUT"):
            resolve_job(site, _script(tmp_path), environ={"HPCRING_TIMEOUT": value})
    for number in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(UsageError, match="timeout"):
            envvars.collective_timeout(number)


def test_communicator_gets_the_resolved_value_and_the_c_comm_takes_it(monkeypatch):
    from hpcring.bootstrap.topology import Topology
    from hpcring.collectives.api import Communicator
    monkeypatch.setenv("HPCRING_TIMEOUT", "7.25")
    topo = Topology(rank=0, size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1, hosts=("h",),
                    master_addr="127.0.0.1", job_id="1", launcher="local")
    calls = []
    real = envvars.collective_timeout
    monkeypatch.setattr(envvars, "collective_timeout", lambda *a, **k: calls.append(a) or real(*a, **k))
    with Communicator.create(topo, None, b"k" * 32, backend="ring") as comm:
        assert comm.timeout == 7.25
        assert comm.backend._comm.timeout == 7.25          # the C comm holds the value it was given
        # the environment was read once, first; then only the value was passed down and checked
        assert [a[0] if a else None for a in calls] == [None] + [7.25] * (len(calls) - 1), calls


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_native_comm_refuses_a_missing_deadline(bad):
    from hpcring import _native
    with pytest.raises(_native.NativeError, match="bad timeout"):
        _native.Comm(0, 1, [None], ["h"], bad)
    comm = _native.Comm(0, 1, [None], ["h"], 2.5)
    assert comm.timeout == 2.5
    with pytest.raises(AttributeError):     # one writer: the creator
        comm.timeout = 9.0
    comm.close()


def test_init_timeout_bounds_the_bootstrap_only(monkeypatch):
    import hpcring.session as S
    used = []

    class Fake:
        def use(self, backend, **kw):
            used.append((backend, kw))
    monkeypatch.setattr(S, "_SESSION", Fake())
    S.init("ring", timeout=5.0)
    assert used == [("ring", {})]       # the collective deadline stays HPCRING_TIMEOUT's


@pytest.mark.parametrize("value", ["0", "nan", "abc"])
def test_run_refuses_a_bad_timeout_before_creating_anything(tmp_path, monkeypatch, value):
    """`hpcring run --timeout` (and HPCRING_TIMEOUT) is refused before the run folder and its
    secret are written: nothing is left behind."""
    import tempfile

    from hpcring import allocation
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for env, flag in (({}, value), ({"HPCRING_TIMEOUT": value}, None)):
        with pytest.raises(UsageError, match="--timeout" if flag else "HPCRING_TIMEOUT"):
            allocation.run(["true"], load_site("local"), 1, 1, environ=env, timeout=flag)
    assert list(tmp_path.iterdir()) == []
