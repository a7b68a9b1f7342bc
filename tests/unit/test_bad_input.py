"""Bad input at every edge: site configs, flags, environment variables, hostlists and
store traffic. Each case asserts a non-zero exit or the library's error class, no traceback, and a
message that names what is wrong and where, and says what to do.

CLI cases run in-process through the conftest `cli` runner (fast); a few go through a real subprocess.
"""
from __future__ import annotations

import functools
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hpcring import hostlist
from hpcring.bootstrap import auth
from hpcring.bootstrap import store_wire as st
from hpcring.bootstrap.store_client import StoreClient
from hpcring.bootstrap.store_server import StoreServer
from hpcring.netio import recv_exact
from hpcring.config import envvars
from hpcring.errors import HostlistError, HpcringError, UsageError

ROOT = Path(__file__).resolve().parents[2]
HELLO = str(ROOT / "examples" / "hello.py")


@pytest.fixture(scope="session")
def cli(cli):
    """The conftest runner without the developer's own HPCRING_* variables (they would change
    what is refused)."""
    return functools.partial(cli, drop_hpcring_env=True)


def assert_clean_failure(result, *must_contain, code=None):
    out = result.output
    assert result.exit_code != 0, f"exit 0 for bad input; output: {out!r}"
    if code is not None:
        assert result.exit_code == code, out
    assert "Traceback" not in out, out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    for word in must_contain:
        assert word in out, f"{word!r} not in {out!r}"


# ------------------------------------------------------------------------------ environment

ENV_CASES = [
    ("HPCRING_TIMEOUT", v) for v in ("abc", "nan", "inf", "-inf", "1e300", "0", "-1", "5s", "0x10")
] + [
    ("HPCRING_INIT_TIMEOUT", v) for v in ("abc", "nan", "0", "-3", "1e9")
] + [
    ("HPCRING_STORE_PORT", v) for v in ("abc", "99999", "0", "-1", "1.5", "65536", "80 81")
] + [
    ("HPCRING_BACKEND", v) for v in ("gloo", "auto", "ring;rm", "NCCL2", "ring mpi")
] + [
    ("HPCRING_SOCKBUF", "-1"), ("HPCRING_SOCKBUF", "lots"), ("HPCRING_SOCKBUF", "99999999999999"),
    ("HPCRING_RD_THRESHOLD", "-5"), ("HPCRING_RD_THRESHOLD", "1.5"),
    ("HPCRING_FLIGHT_RECORDS", "0"), ("HPCRING_FLIGHT_RECORDS", "many"),
    ("HPCRING_WATCHDOG", "maybe"), ("HPCRING_CHECK_COLLECTIVES", "2"),
    ("HPCRING_MPI_ABORT_ON_TIMEOUT", "sometimes"), ("HPCRING_STORE_LINGER", "nan"),
    ("HPCRING_STORE_LINGER", "-1"), ("HPCRING_DIAG_GRACE", "0"), ("HPCRING_ON_FAILURE", "explode"),
    ("HPCRING_VERIFY", "some"), ("HPCRING_LOCAL_GRACE_S", "inf"),
]


@pytest.mark.parametrize("name,value", ENV_CASES)
def test_bad_environment_variable(name, value):
    with pytest.raises(UsageError) as exc:
        envvars.get(name, {name: value})
    text = str(exc.value)
    assert f"{name}={value!r}" in text                  # what and where
    assert "expected" in text and f"unset {name}" in text  # what is allowed, what to do


def test_bad_env_reaches_the_real_readers(monkeypatch):
    """The same errors through the code that reads them (not only the registry)."""
    from hpcring.bootstrap.init import _store_ports
    from hpcring.bootstrap.topology import Topology
    from hpcring.config.envvars import collective_timeout
    from hpcring.diagnostics.torch_watch import pg_timeout
    from hpcring.collectives.choice import auto_backend
    for value in ("abc", "nan", "inf", "1e300"):
        monkeypatch.setenv("HPCRING_TIMEOUT", value)
        with pytest.raises(UsageError, match="HPCRING_TIMEOUT"):
            collective_timeout()
        with pytest.raises(UsageError, match="HPCRING_TIMEOUT"):
            pg_timeout("gloo")
    topo = Topology(rank=0, size=1, local_rank=0, local_size=1, node_rank=0, num_nodes=1, hosts=("h",),
                    master_addr="127.0.0.1", job_id="1", launcher="local")
    for value in ("abc", "99999"):
        with pytest.raises(UsageError, match="HPCRING_STORE_PORT"):
            _store_ports(topo, {"HPCRING_STORE_PORT": value}, (29500, 29999))
    with pytest.raises(UsageError, match="HPCRING_BACKEND='gloo'"):
        auto_backend(topo, {"HPCRING_BACKEND": "gloo"})


JOB_ENV_CASES = [
    ("HPCRING_NODES", "-1"), ("HPCRING_NODES", "abc"), ("HPCRING_NODES", "99999999999999999999999"),
    ("HPCRING_NODES", "0"), ("HPCRING_TASKS_PER_NODE", "0"), ("HPCRING_GPUS_PER_NODE", "-1"),
    ("HPCRING_CPUS_PER_TASK", "1.5"), ("HPCRING_TIME", "abc"), ("HPCRING_TIME", "0"),
    ("HPCRING_TIME", "UNLIMITED"), ("HPCRING_TIMEOUT", "nan"), ("HPCRING_TIMEOUT", "inf"),
    ("HPCRING_TIMEOUT", "-5"), ("HPCRING_JOB_NAME", "x\ntouch INJECTED"),
    ("HPCRING_ACCOUNT", "acct\nrm -rf ~"), ("HPCRING_JOB_DIR", "/tmp/a\nb"),
]


@pytest.mark.parametrize("name,value", JOB_ENV_CASES)
def test_bad_job_setting_from_environment(cli, name, value):
    r = cli("render", HELLO, "--site", "devcluster", env={name: value})
    assert_clean_failure(r, name, "hint:", code=2)


# ------------------------------------------------------------------------------ flags

FLAG_CASES = [
    (["run", "-N", "-1", "--", "true"], "'--nodes'"),
    (["run", "-N", "0", "--", "true"], "'--nodes'"),
    (["run", "--tasks-per-node", "0", "--", "true"], "'--tasks-per-node'"),
    (["run", "--nodes", "99999999999999999999999", "--", "true"], "'--nodes'"),
    (["run", "-N", "two", "--", "true"], "'--nodes'"),
    (["bench", "--ranks", "0"], "'--ranks'"),
    (["bench", "--ranks", "-3"], "'--ranks'"),
    (["bench", "--nodes", "0"], "'--nodes'"),
    (["bench", "--iters", "0"], "'--iters'"),
    (["bench", "--warmup", "-1"], "'--warmup'"),
    (["bench", "--timeout", "nan"], "'--timeout'"),
    (["bench", "--timeout", "inf"], "'--timeout'"),
    (["bench", "--timeout", "0"], "'--timeout'"),
    (["bench", "--root", "-1"], "'--root'"),
] + [
    (["render", HELLO, "--site", "devcluster", flag, value], flag)
    for flag, value in [("--nodes", "0"), ("--nodes", "-1"), ("--nodes", "99999999999999999999999"),
                        ("--nodes", "1e3"), ("--tasks-per-node", "0"), ("--tasks-per-node", "5000"),
                        ("--gpus-per-node", "-1"), ("--gpus-per-node", "1000"), ("--cpus-per-task", "0")]
] + [
    (["submit", HELLO, "--site", "devcluster", "--dry-run", "--nodes", "0"], "--nodes"),
    (["submit", HELLO, "--site", "devcluster", "--dry-run", "--tasks-per-node", "-2"], "--tasks-per-node"),
]


@pytest.mark.parametrize("args,names", FLAG_CASES, ids=lambda a: " ".join(a) if isinstance(a, list) else a)
def test_bad_flag_is_a_usage_error(cli, args, names):
    assert_clean_failure(cli(*args), names, code=2)


TEXT_FLAG_CASES = [
    ("--time", v) for v in ("0", "abc", "1:", "1-2:", "1:2:3:4", "UNLIMITED", "-5", "99999999999", "1.5", "1h")
] + [
    ("--name", "x\ntouch INJECTED"), ("--name", "a\rb"), ("--name", "tab\there"), ("--name", " "),
    ("--account", "a\nb"), ("--partition", "p\x07"), ("--qos", "q\nr"), ("--constraint", "c\x1b[31m"),
    ("--sched-arg", "--mem=1G\nrm -rf ~"),
]


@pytest.mark.parametrize("flag,value", TEXT_FLAG_CASES)
def test_bad_text_flag_never_reaches_a_job_script(cli, flag, value):
    r = cli("render", HELLO, "--site", "devcluster", flag, value)
    assert_clean_failure(r, flag if flag != "--sched-arg" else "--sched-arg", "hint:", code=2)
    assert "#SBATCH" not in r.output


def test_time_99_99_is_read_as_slurm_reads_it(cli):
    r = cli("render", HELLO, "--site", "slurm-tcp", "--time", "99:99")
    assert r.exit_code == 0, r.output
    assert "#SBATCH --time=01:41:00" in r.output


@pytest.mark.parametrize("value", ["my run", "it's; touch INJECTED", "$(touch INJECTED)", "`id`", "a\"b", "x&&y|z>w"])
def test_shell_metacharacters_are_quoted_in_the_job_script(cli, tmp_path, value):
    r = cli("render", HELLO, "--site", "devcluster", "--name", value, "--account", value,
            env={"HPCRING_JOB_DIR": str(tmp_path / "dir with space")})
    assert r.exit_code == 0, r.output
    script = r.output
    # bash parses the script without running anything we did not write (no INJECTED file)
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr
    lines = [ln for ln in script.splitlines() if ln.startswith("#SBATCH --job-name=")]
    import shlex
    assert shlex.split(lines[0].split("=", 1)[1]) == [value]
    out = [ln for ln in script.splitlines() if ln.startswith("#SBATCH --output=")][0]
    assert shlex.split(out.split("=", 1)[1]) == [str(tmp_path / "dir with space" / "%j" / "%j_0_log.out")]


def test_missing_script_and_site_are_clear(cli):
    assert_clean_failure(cli("render", "/nonexistent/train.py", "--site", "nosuchsite"), "nosuchsite", "hint:")
    assert_clean_failure(cli("submit", "/nonexistent/train.py", "--site", "local"), "/nonexistent/train.py", "hint:")
    assert_clean_failure(cli("sites", "show", "/nonexistent/site.yaml"), "/nonexistent/site.yaml", "hint:")


# ------------------------------------------------------------------------------ site configs

VALID = "name: t\nscheduler: slurm\nlauncher: {kind: srun}\n"
SITE_CASES = {
    "billion-laughs": ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
                       "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
                       "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
                       "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n", 1, "anchor"),
    "recursive-alias": (VALID + "setup: &r [*r]\n", 4, "anchor"),
    "alias-only": (VALID + "qos: *undefined\n", 4, "alias"),
    "complex-key": (VALID + "? [a, b]\n: 1\n", 4, "complex key"),
    "complex-key-map": (VALID + "? {a: 1}\n: 1\n", 4, "complex key"),
    "unknown-tag": (VALID + "qos: !custom high\n", 4, "tag"),
    "python-tag": (VALID + "qos: !!python/object/apply:os.system [ls]\n", 4, "tag"),
    "binary-tag": (VALID + "qos: !!binary aGk=\n", 4, "tag"),
    "non-utf8": (VALID + "description: caf\xe9\n", 4, "UTF-8"),
    "duplicate-key": (VALID + "name: u\n", 4, "twice"),
    "deep-nesting": (VALID + "env: " + "[" * 100 + "]" * 100 + "\n", 4, "nested"),
    "syntax-tab": (VALID + "defaults:\n\tnodes: 2\n", 5, "not valid YAML"),
    "syntax-colon": (VALID + "qos: a: b\n", 4, "not valid YAML"),
    "timeout-inf": (VALID + "timeout: .inf\n", 4, "timeout"),
    "timeout-nan": (VALID + "timeout: .nan\n", 4, "timeout"),
    "timeout-neg": (VALID + "timeout: -1\n", 4, "timeout"),
    "timeout-zero": (VALID + "timeout: 0\n", 4, "timeout"),
    "timeout-text": (VALID + "timeout: soon\n", 4, "timeout"),
    "timeout-huge": (VALID + "timeout: 1e300\n", 4, "timeout"),
    "nodes-neg": (VALID + "defaults:\n  nodes: -1\n", 5, "nodes"),
    "nodes-huge": (VALID + "defaults:\n  nodes: 99999999999999999999999\n", 5, "nodes"),
    "tasks-zero": (VALID + "defaults:\n  tasks_per_node: 0\n", 5, "tasks_per_node"),
    "time-bad": (VALID + "defaults:\n  time: soon\n", 5, "time"),
    "time-zero": (VALID + "defaults:\n  time: '0'\n", 5, "time"),
    "time-unlimited": (VALID + "defaults:\n  time: UNLIMITED\n", 5, "time"),
    "max-time-bad": (VALID + "partitions:\n  p:\n    max_time: 1:2:3:4\n", 6, "max_time"),
    "gpus-neg": (VALID + "gpus_per_node: -1\n", 4, "gpus_per_node"),
    "gpus-huge": (VALID + "gpus_per_node: 1000\n", 4, "gpus_per_node"),
    "launcher-kind": ("name: t\nscheduler: slurm\nlauncher: {kind: pdsh}\n", 3, "kind"),
    "scheduler": ("name: t\nscheduler: pbs\nlauncher: {kind: srun}\n", 2, "scheduler"),
    "unknown-key": (VALID + "nodez: 3\n", 4, "nodez"),
    "name-newline": ('name: "a\\nb"\nscheduler: slurm\nlauncher: {kind: srun}\n', 1, "name"),
    "name-space": ("name: my site\nscheduler: slurm\nlauncher: {kind: srun}\n", 1, "name"),
    "env-key": (VALID + "env:\n  'BAD-NAME': x\n", 4, "BAD-NAME"),
    "hca": (VALID + "fabric: {kind: infiniband, hcas: ['mlx5 0']}\n", 4, "hcas"),
    "fabric-kind": (VALID + "fabric: {kind: ethernet}\n", 4, "kind"),
    "not-a-mapping": ("- a\n- b\n", None, "mapping"),
    "scalar": ("just text\n", None, "mapping"),
    "missing-name": ("scheduler: slurm\nlauncher: {kind: srun}\n", 1, "name"),
    "bool-as-nodes": (VALID + "defaults:\n  nodes: yes please\n", 5, "nodes"),
}


@pytest.mark.parametrize("case", sorted(SITE_CASES))
def test_bad_site_config(cli, tmp_path, case):
    text, line, word = SITE_CASES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(text.encode("latin-1"))
    r = cli("sites", "validate", str(path))
    assert_clean_failure(r, str(path), word, "hint:")
    if line is not None:
        assert f"{path}:{line}" in r.output, r.output


def test_billion_laughs_fails_fast(cli, tmp_path):
    import time
    text = SITE_CASES["billion-laughs"][0]
    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    t0 = time.monotonic()
    assert cli("sites", "validate", str(path)).exit_code == 1
    assert time.monotonic() - t0 < 2.0


# ------------------------------------------------------------------------------ hostlists

HOSTLIST_CASES = [
    "n[]", "n[a-b]", "n[3-1]", "n[1-2-3]", "n[1,,2]", "n[1,]", "n[,1]", "n[-1]", "n[1x2]", "n[1-2]]",
    "n[[1]]", "n[0-65536]", "n[1", "a]b", "n[ 1-2]", "n[1, 2]", "n[+1]", "n[1-]", "[]",
    "n[99999999999999999999999]", "n[0-60000]x[0-60000]", "a,n[x],b", "n[1-2] m[5-4]",
]


@pytest.mark.parametrize("expr", HOSTLIST_CASES)
def test_bad_hostlist(expr):
    with pytest.raises(HostlistError) as exc:
        hostlist.expand(expr)
    assert expr.strip() in str(exc.value) or "^" in str(exc.value)


@pytest.mark.parametrize("expr", ["n[3-1]", "n[", "a]b"])
def test_bad_hostlist_cli(cli, expr):
    from hpcring.cli.hostlist_cmd import app as hl_app
    r = cli("expand", "--", expr, app=hl_app)
    assert r.exit_code == 1 and "Traceback" not in r.output and "error:" in r.output


# ------------------------------------------------------------------------------ store traffic

SECRET = b"bad-input-secret" * 2


@pytest.fixture(scope="module")
def store_server():
    srv = StoreServer("127.0.0.1", 0, secret=SECRET)
    yield srv
    srv.close()


def _session(srv):
    import secrets
    import socket
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    hello = recv_exact(s, 36)
    ns, nc = hello[4:], secrets.token_bytes(32)
    s.sendall(nc + auth.STORE.client_proof(SECRET, ns, nc))
    recv_exact(s, 32)
    return s, st.session_key(SECRET, ns, nc)


def _reply(s):
    head = recv_exact(s, 36)
    return recv_exact(s, struct.unpack(">I", head[:4])[0])


F64 = struct.Struct(">d").pack
REQUEST_CASES = {   # authenticated but malformed or hostile requests: answered with an error
    "get-nan": st.encode_request(st.OP_GET, "k", F64(math.nan)),
    "get-inf": st.encode_request(st.OP_GET, "k", F64(math.inf)),
    "get-neg-inf": st.encode_request(st.OP_GET, "k", F64(-math.inf)),
    "get-negative": st.encode_request(st.OP_GET, "k", F64(-5.0)),
    "get-huge": st.encode_request(st.OP_GET, "k", F64(1e300)),
    "get-short-args": st.encode_request(st.OP_GET, "k", b"\x00\x01"),
    "add-short-args": st.encode_request(st.OP_ADD, "k", b"\x00"),
    "unknown-op": bytes([99]) + b"\x00\x01k",
    "key-past-end": bytes([st.OP_CHECK]) + b"\xff\xff" + b"abc",
    "key-not-utf8": bytes([st.OP_CHECK]) + b"\x00\x02\xff\xfe",
    "empty-body": b"\x01",
}


@pytest.mark.parametrize("case", sorted(REQUEST_CASES))
def test_bad_store_request_gets_an_error_and_the_store_keeps_serving(store_server, case):
    s, key = _session(store_server)
    s.sendall(st.encode_frame(key, b"C", 0, REQUEST_CASES[case]))
    body = _reply(s)
    assert body[0] == st.ST_ERROR and len(body) > 10, body   # a reason comes with it
    c = StoreClient("127.0.0.1", store_server.port, SECRET, timeout=5)
    c.set(f"alive/{case}", b"1")
    assert c.get(f"alive/{case}") == b"1"


CONN_CASES = {   # dropped before anything is parsed
    "garbage-before-handshake": lambda srv: b"GET / HTTP/1.1\r\n\r\n" * 4,
    "wrong-secret": "wrong",
    "bad-mac": "badmac",
    "oversize": "oversize",
    "replay": "replay",
}


@pytest.mark.parametrize("case", sorted(CONN_CASES))
def test_hostile_connection_is_dropped(store_server, case):
    import secrets
    import socket
    before = dict(store_server.stats)
    if case in ("garbage-before-handshake", "wrong-secret"):
        s = socket.create_connection(("127.0.0.1", store_server.port), timeout=5)
        hello = recv_exact(s, 36)
        nc = secrets.token_bytes(32)
        payload = CONN_CASES[case](store_server) if callable(CONN_CASES[case]) \
            else nc + auth.STORE.client_proof(b"not the secret", hello[4:], nc)
        s.sendall(payload)
    else:
        s, key = _session(store_server)
        body = st.encode_request(st.OP_SET, "evil", b"x")
        if case == "bad-mac":
            s.sendall(st.HEADER.pack(len(body)) + b"\x00" * 32 + body)
        elif case == "oversize":
            s.sendall(st.HEADER.pack(store_server.max_frame + 1) + b"\x00" * 32)
        else:
            frame = st.encode_frame(key, b"C", 0, body)
            s.sendall(frame)
            _reply(s)
            s.sendall(frame)
    s.settimeout(5)
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass
    assert store_server.stats["frames"] - before["frames"] <= 1
    with pytest.raises(st.StoreAuthError):
        StoreClient("127.0.0.1", store_server.port, b"not the secret", timeout=2)


# ------------------------------------------------------------------------------ real processes

@pytest.fixture(scope="session")
def hpcring(hpcring):
    """The conftest subprocess runner without the developer's own HPCRING_* variables."""
    return functools.partial(hpcring, drop_hpcring_env=True, timeout=120)


def test_run_nonexistent_command_subprocess(hpcring):
    p = hpcring("run", "--", "/nonexistent/cmd")
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out
    assert "/nonexistent/cmd" in out and "hint" in out


@pytest.mark.parametrize("value", ["abc", "nan"])
def test_run_with_bad_timeout_env_subprocess(hpcring, value):
    p = hpcring("run", "--", sys.executable, "-c", "import hpcring; hpcring.init().communicator('ring')",
                 env={"HPCRING_TIMEOUT": value})
    out = p.stdout + p.stderr
    assert p.returncode == 2, out                      # refused before any rank starts
    assert "HPCRING_TIMEOUT" in out and "Traceback" not in out and "hint:" in out


def test_flag_error_subprocess(hpcring):
    p = hpcring("run", "-N", "-1", "--", "true")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--nodes" in p.stderr


def test_lsf_blaunch_line_survives_the_remote_shell(cli, tmp_path):
    """blaunch joins its words and runs them through a shell: a job_dir with a space needs (and
    gets) two levels of quoting on that line, and still arrives as one argument."""
    import shlex
    folder = tmp_path / "dir with space"
    r = cli("render", HELLO, "--site", "devcluster-lsf", "--name", "my run", env={"HPCRING_JOB_DIR": str(folder)})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("blaunch "))
    local_words = shlex.split(" ".join(ln.rstrip("\\") for ln in lines[i:i + 2]))   # the batch shell
    remote_words = shlex.split(" ".join(local_words[3:]))                          # blaunch's shell
    assert remote_words[-1] == str(folder / "%j") and remote_words[-2] == "hpcring.schedulers.lsf_task"
    assert "#BSUB -J 'my run'" in r.output


# ------------------------------------------------------------------------------ job ids, state, bench

@pytest.mark.parametrize("ref", ["38", "38_2", "local-38", "slurm-devcluster-38", "lsf-c.x-1234"])
def test_job_ids_that_can_name_a_record(ref):
    from hpcring.schedulers.base import check_job_ref
    assert check_job_ref(ref) == ref


@pytest.mark.parametrize("ref", ["", "*", "*-38", "38/..", "../38", "-38", "a b", "j\u00f6b", "1" * 201])
def test_job_ids_that_never_reach_the_filesystem(ref, state_dir):
    from hpcring.schedulers.base import load_record
    state_dir.joinpath("jobs").mkdir(parents=True)
    (state_dir / "jobs" / "local-38.json").write_text("{}")      # '*' must not match it
    with pytest.raises(UsageError, match="not a job id"):
        load_record(ref)


def test_damaged_job_record_is_an_error_naming_the_file(state_dir):
    from hpcring.schedulers.base import load_record
    (state_dir / "jobs").mkdir(parents=True)
    path = state_dir / "jobs" / "local-7.json"
    for text in ("{bad", '{"job_id": "7"}', "[]"):
        path.write_text(text)
        with pytest.raises(HpcringError, match="local-7.json cannot be read") as exc:
            load_record("7")
        assert "hint:" in str(exc.value)


@pytest.mark.parametrize("value", ["/dev/null", "/proc/version"])
def test_state_dir_that_cannot_hold_records(value, monkeypatch):
    from hpcring.schedulers.base import state_dir
    monkeypatch.setenv("HPCRING_STATE_DIR", value)
    with pytest.raises(UsageError, match="HPCRING_STATE_DIR") as exc:
        state_dir()
    assert exc.value.exit_code == 2


def test_bench_size_bounds():
    from hpcring.bench import options as bo
    assert bo.parse_size("8G") == bo.MAX_BYTES and bo.parse_size("64MiB") == 64 << 20
    for text in ("8G1", "9G", "1e400", "nan", "1_0", "\uff18", "-1", "1" * 100, ""):
        with pytest.raises(UsageError, match="--maxbytes"):
            bo.parse_size(text, "--maxbytes")
    with pytest.raises(UsageError, match="256 sizes"):
        bo.size_list(8, 64 << 20, 1.0000001)
    for factor in (float("nan"), float("inf"), 0.5, 1e6):
        with pytest.raises(UsageError, match="--stepfactor"):
            bo.size_list(8, 64, factor)
    assert bo.size_list(8, 8, 1) == [8]          # one size needs no step


def test_bench_refuses_sizes_this_machine_cannot_hold(tmp_path):
    from hpcring.bench.options import BenchOptions
    from hpcring.bench.run import check_host_memory
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4194304 kB\nMemAvailable: 1048576 kB\n")    # 1 GiB available
    check_host_memory(BenchOptions(maxbytes=64 << 20), 2, str(meminfo))        # 384 MiB: fine
    with pytest.raises(UsageError, match="1.0 GiB is available"):
        check_host_memory(BenchOptions(maxbytes=256 << 20), 2, str(meminfo))   # 1.5 GiB
    check_host_memory(BenchOptions(maxbytes=256 << 20, backend="nccl"), 2, str(meminfo))  # GPU memory


def test_bench_output_paths_are_checked_before_any_rank(tmp_path):
    from hpcring.bench.options import BenchOptions
    for path, word in ((tmp_path / "no" / "x.json", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(UsageError, match=word):
            BenchOptions(json=str(path)).check()
    with pytest.raises(UsageError, match="unknown --backend"):
        BenchOptions(backend="gloo").check()


def test_bench_plot_format_is_checked_before_the_run(tmp_path, monkeypatch):
    """A --plot suffix matplotlib cannot write used to fail on rank 0 after the whole run."""
    import types
    from hpcring.bench.options import check_plot_format
    canvas = types.SimpleNamespace(get_supported_filetypes=lambda: {"png": "PNG", "pdf": "PDF"})
    fake = types.ModuleType("matplotlib.figure")
    fake.Figure = lambda: types.SimpleNamespace(canvas=canvas)
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", fake)
    check_plot_format(str(tmp_path / "bw.pdf"))
    check_plot_format(str(tmp_path / "bw"))
    with pytest.raises(UsageError, match=r"cannot write \.docx") as exc:
        check_plot_format(str(tmp_path / "bw.docx"))
    assert ".png" in str(exc.value)


def test_bench_host_memory_check_follows_where_buffers_live(monkeypatch):
    from hpcring.bench.options import BenchOptions
    from hpcring.bench.run import _buffers_on_host
    assert _buffers_on_host(BenchOptions(backend="nccl", memory="host"))
    assert not _buffers_on_host(BenchOptions(backend="nccl"))
    assert _buffers_on_host(BenchOptions(backend="ring"))
    monkeypatch.setenv("HPCRING_BACKEND", "nccl")
    assert not _buffers_on_host(BenchOptions())
    monkeypatch.setenv("HPCRING_BACKEND", "ring")
    assert _buffers_on_host(BenchOptions())


# ------------------------------------------------------------------------------ leftovers, bounds

@pytest.mark.parametrize("report", [False, True], ids=["empty", "with-report"])
def test_local_run_leaves_its_job_folder_only_with_a_report(tmp_path, report):
    """``hpcring run`` outside an allocation: a rank that made ``<HPCRING_JOB_DIR>/run<pid>/diag``
    (torch's watch, the watchdog) and wrote nothing leaves no empty folder; a report stays."""
    from hpcring import allocation
    from hpcring.config.site import load_site
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    code = ("from hpcring import jobdir; d = jobdir.diag_dir()"
            + ("; (d / 'hang-report.txt').write_text('x')" if report else ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCRING_")}
    env["HPCRING_JOB_DIR"] = str(jobs)
    assert allocation.run([sys.executable, "-c", code], load_site("local"), 1, 1, environ=env) == 0
    left = sorted(str(p.relative_to(jobs)) for p in jobs.rglob("*"))
    run = f"run{os.getpid()}"
    assert left == ([run, f"{run}/diag", f"{run}/diag/hang-report.txt"] if report else [])


@pytest.mark.parametrize("args,words", [
    (["--timeout", "1e300"], ["--timeout", "604800"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--json", "{tmp}/no/such/folder/r.json"], ["--json", "does not exist"]),
    (["--json", "{tmp}"], ["--json", "is a folder"]),
], ids=["huge-timeout", "zero-timeout", "json-folder-missing", "json-is-a-folder"])
def test_doctor_refuses_bad_flags_before_anything_starts(cli, tmp_path, monkeypatch, args, words):
    """--timeout has declared bounds (1e300 used to fail inside init() naming "init() timeout") and
    --json is checked up front (it used to fail on rank 0 after every check had run)."""
    import hpcring
    started = []
    monkeypatch.setattr(hpcring, "init", lambda *a, **kw: started.append("init") or pytest.fail("init() ran"))
    r = cli("doctor", *(a.format(tmp=tmp_path) for a in args),
            env={"HPCRING_SECRET": None, "HPCRING_SECRET_FILE": None})   # doctor alone sets its own secret
    assert_clean_failure(r, *words, code=2)
    assert "init()" not in r.output and not started


@pytest.mark.parametrize("follow", [[], ["--follow"]], ids=["logs", "logs-follow"])
def test_logs_rank_beyond_the_job_is_a_usage_error(cli, tmp_path, state_dir, follow):
    from hpcring.schedulers.base import new_record
    new_record("7", "local", "local", str(tmp_path), 2, "x", "x.py")
    env = {"HPCRING_STATE_DIR": str(state_dir)}
    for rank in ("2", "799999"):
        r = cli("logs", "7", "--rank", rank, *follow, env=env)
        assert_clean_failure(r, f"--rank {rank}", "ranks 0-1", "hint: pass a rank from 0 to 1", code=2)
    r = cli("logs", "7", "--rank", "800000", *follow, env=env)      # beyond any job: the flag's bound
    assert_clean_failure(r, "--rank", "799999", code=2)
    assert cli("logs", "7", "--rank", "1", env=env).exit_code == 0


NO_ALLOCATION = {"SLURM_JOB_ID": None, "SLURM_JOBID": None, "LSB_JOBID": None}


@pytest.mark.parametrize("argv,ranks", [(["-N", "100000", "--tasks-per-node", "1024"], 102400000),
                                        (["-N", "257"], 257), (["--tasks-per-node", "257"], 257)])
def test_local_run_refuses_more_ranks_than_the_local_backend_starts(cli, tmp_path, monkeypatch, argv, ranks):
    """Outside an allocation every rank is a process on this machine: a typo used to fork them all."""
    from hpcring import allocation
    from hpcring.config.envvars import MAX_LOCAL_RANKS
    monkeypatch.setattr(allocation, "_start_local", lambda *a, **kw: pytest.fail("ranks started"))
    monkeypatch.setattr(allocation.tempfile, "gettempdir", lambda: str(tmp_path))
    r = cli("run", *argv, "--", "true", env=NO_ALLOCATION)
    assert_clean_failure(r, f"is {ranks} ranks", f"at most {MAX_LOCAL_RANKS}", "hint:", "allocation", code=2)
    assert not list(tmp_path.iterdir())                 # no run folder, no secret


@pytest.mark.parametrize("argv,env", [(["-N", "100000", "--tasks-per-node", "64"], {}),
                                      (["-N", "300"], {}), ([], {"HPCRING_NODES": "300"})],
                         ids=["huge", "300-nodes", "300-nodes-from-env"])
@pytest.mark.parametrize("cmd", [["submit"], ["submit", "--dry-run"]])
def test_local_site_refuses_more_ranks_than_the_local_backend_starts(cli, tmp_path, monkeypatch, cmd, argv, env):
    from hpcring import submit as lib
    monkeypatch.setattr(lib, "submit", lambda *a, **kw: pytest.fail("submitted"))
    jobs, state = tmp_path / "jobs", tmp_path / "state"
    r = cli(*cmd, "--site", "local", *argv, HELLO,
            env={"HPCRING_JOB_DIR": str(jobs), "HPCRING_STATE_DIR": str(state), **env})
    assert_clean_failure(r, "ranks", "local backend", "at most 256", "hint:", code=2)
    if env:
        assert "env HPCRING_NODES" in r.output                          # where the count came from
    assert not jobs.exists() and not list(state.rglob("*.json"))


# ------------------------------------------------------------------------------ empty values, templates

@pytest.mark.parametrize("argv", [["render", "--site", "", HELLO], ["submit", "--site", "", "--dry-run", HELLO],
                                  ["submit", "--site", "", HELLO], ["submit", "-s", " ", HELLO],
                                  ["run", "--site", "", "--", "true"]], ids=lambda a: " ".join(a[:3]))
def test_empty_site_flag_is_refused(cli, tmp_path, monkeypatch, argv):
    """`--site ""` was the default site, silently: now a usage error naming --site; nothing rendered
    or submitted."""
    from hpcring import allocation, submit as lib
    monkeypatch.setattr(lib, "submit", lambda *a, **kw: pytest.fail("submitted"))
    monkeypatch.setattr(allocation, "run", lambda *a, **kw: pytest.fail("ran"))
    r = cli(*argv, env={"HPCRING_JOB_DIR": str(tmp_path / "jobs"), "HPCRING_STATE_DIR": str(tmp_path / "state")})
    assert_clean_failure(r, "--site", "empty", "hint:", "leave --site out for the default", code=2)
    assert not r.stdout and not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("argv", [["sites", "show", ""], ["sites", "validate", "local", " "]])
def test_empty_site_argument_is_refused(cli, argv):
    assert_clean_failure(cli(*argv), "site", "is empty", "hint:", code=2)


def test_empty_site_variable_is_unset(cli):
    """HPCRING_SITE="" reads as unset (as most tools read an empty variable): the default site."""
    r = cli("render", HELLO, env={"HPCRING_SITE": ""})
    assert r.exit_code == 0 and "for site local (local.yaml)" in r.stdout, r.output


@pytest.mark.parametrize("key,raw", [("job_dir", '""'), ("job_dir", '"  "'), ("template", "''"),
                                     ("python", '""')])
def test_empty_path_key_in_site_file(cli, tmp_path, key, raw):
    """`job_dir: ""` was accepted (the folder hpcring was started in; sites validate said ok, and
    HPCRING_JOB_DIR hid it from render): now the file, line and key, and what to write."""
    path = tmp_path / "site.yaml"
    path.write_text(VALID + f"{key}: {raw}\n")
    for argv, env in ((["sites", "validate", str(path)], {}),
                      (["render", "--site", str(path), HELLO], {"HPCRING_JOB_DIR": str(tmp_path / "jobs")})):
        r = cli(*argv, env=env)
        assert_clean_failure(r, f"{path}:4 {key}: empty", "names a path", "remove the key for its default",
                             "hint:", code=1)
        assert "#SBATCH" not in r.output


@pytest.mark.parametrize("text", ["hello\n", "#!/bin/bash\necho no ranks\n", "{{ command }}\n"],
                         ids=["text", "no-launch", "no-shebang"])
@pytest.mark.parametrize("cmd", [["render"], ["submit", "--dry-run"], ["submit"]])
def test_template_that_is_no_job_script(cli, tmp_path, monkeypatch, cmd, text):
    """Any readable file was rendered as a job-script template: now it must render a script that
    starts with #! and start the ranks (launch_command or command); the error says so."""
    from hpcring import submit as lib
    monkeypatch.setattr(lib, "submit", lambda *a, **kw: pytest.fail("submitted"))
    t = tmp_path / "notes.txt"
    t.write_text(text)
    r = cli(*cmd, "--site", "devcluster", "--template", str(t), HELLO,
            env={"HPCRING_JOB_DIR": str(tmp_path / "jobs"), "HPCRING_STATE_DIR": str(tmp_path / "state")})
    assert_clean_failure(r, f"--template {t} is not a job-script template", "#!/bin/bash", "launch_command",
                         "hint:", code=1)
    assert not r.stdout and not (tmp_path / "jobs").exists()


def test_own_templates_that_are_job_scripts_still_render(cli, tmp_path):
    """A bundled template given as --template, and an own one that starts the ranks in a partial."""
    plain = cli("render", "--site", "devcluster", HELLO)
    given = cli("render", "--site", "devcluster", "--template", str(ROOT / "templates" / "slurm.sh.j2"), HELLO)
    assert plain.exit_code == 0 and given.exit_code == 0 and given.stdout == plain.stdout, given.output
    (tmp_path / "launch.j2").write_text("{{ launch_command(logs=folder ~ '/%j_%t_log') }}\n")
    (tmp_path / "mine.sh.j2").write_text("#!/bin/bash\n#SBATCH --nodes={{ job.nodes }}\n{% include 'launch.j2' %}\n")
    r = cli("render", "--site", "devcluster", "--template", str(tmp_path / "mine.sh.j2"), HELLO)
    assert r.exit_code == 0 and r.stdout.startswith("#!/bin/bash\n#SBATCH --nodes=1\nsrun "), r.output
