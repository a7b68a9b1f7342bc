"""hpcring.remote without a network: the ssh/rsync argv builders, the one line the login node's shell
runs, .hpcringignore (checked against git's own reading of the same patterns, with real rsync), the
target syntax, the site section and the --remote flag's bad input, and what the CLI forwards.
The real sshd test is tests/devcluster/test_remote_devcluster.py."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hpcring import remote, remote_ignore
from hpcring.config import remote_checks
from hpcring.errors import RemoteError, UsageError

T = remote.Target(host="login.example.org", user="alice", port=2222,
                  ssh_options=("IdentityFile=/home/a b/key", "ProxyCommand=ssh -W %h:%p jump"),
                  workdir="~/runs", hpcring="/opt/hp/bin/hpcring")
CONTROL = Path("/run/user/0/hpcring-ssh")


# -- argv builders -------------------------------------------------------------------------------

def test_ssh_argv_puts_site_options_first_then_the_shared_master_and_deadlines():
    argv = remote.ssh_argv(T, CONTROL, batch=True)
    opts = [argv[i + 1] for i, w in enumerate(argv) if w == "-o"]
    # ssh keeps an option's first value: the site's come before hpcring's defaults
    assert opts[:2] == ['IdentityFile="/home/a b/key"', "ProxyCommand=ssh -W %h:%p jump"]
    assert opts[2:] == ["ControlMaster=auto", f"ControlPath={CONTROL}/%C", f"ControlPersist={remote.CONTROL_PERSIST_S}",
                        f"ConnectTimeout={remote.CONNECT_TIMEOUT_S}", f"ServerAliveInterval={remote.ALIVE_INTERVAL_S}",
                        f"ServerAliveCountMax={remote.ALIVE_COUNT}", "BatchMode=yes"]
    assert argv[-4:] == ["-p", "2222", "-l", "alice"]
    assert "BatchMode=yes" not in remote.ssh_argv(T, CONTROL, batch=False)


def test_command_argv_ends_with_the_host_and_one_quoted_line(tmp_path):
    argv = remote.command_argv(T, CONTROL, [T.hpcring, "status", "38"], env={"HPCRING_NODES": "2"})
    assert argv[-3:-1] == ["--", "login.example.org"]
    assert shlex.split(argv[-1]) == ["env", "HPCRING_REMOTE=none", "HPCRING_NODES=2", "/opt/hp/bin/hpcring",
                                     "status", "38"]


HOSTILE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=0, max_size=20) | st.sampled_from(
    ["$(touch {m})", "`touch {m}`", "; touch {m}", "a b 'c' \"d\"", "--x=$HOME", "*", "~", "\\", "-rf", "'", '"'])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(HOSTILE, max_size=6), envval=HOSTILE)
def test_the_remote_line_runs_exactly_the_words_and_nothing_else(tmp_path, words, envval):
    """The line is run here by sh as the login node's shell would: the recorder gets each word as
    given, the folder is entered, and no word ever runs as a command."""
    marker = tmp_path / "INJECTED"
    words = [w.replace("{m}", str(marker)) for w in words]
    rec = tmp_path / "rec.py"
    rec.write_text("import os, sys, json\njson.dump([os.getcwd(), os.environ.get('HPCRING_REMOTE'), "
                   "os.environ.get('HPCRING_TIME'), sys.argv[1:]], open(sys.argv[0] + '.out', 'w'))\n")
    work = tmp_path / "d i r"
    work.mkdir(exist_ok=True)
    line = remote.remote_line([shutil.which("python3"), str(rec), *words], cd=str(work),
                              env={"HPCRING_TIME": envval})
    r = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    import json
    cwd, rem, time_, got = json.loads(Path(str(rec) + ".out").read_text())
    assert (cwd, rem, time_, got) == (str(work), "none", envval, words)
    assert not marker.exists()


def test_rsync_argv_hands_rsync_the_same_ssh_and_protected_paths():
    rules = remote_ignore.ignore_rules(["data/"])
    argv = remote.rsync_argv(T, CONTROL, Path("/home/a/proj x"), rules, "runs/proj x")
    e = argv[argv.index("-e") + 1]
    # rsync splits -e on spaces honouring quotes, as shlex does
    assert shlex.split(e) == remote.ssh_argv(T, CONTROL)
    assert "--protect-args" in argv and f"--timeout={remote.COPY_IO_TIMEOUT_S}" in argv
    assert argv[-3:] == ["--", "/home/a/proj x/", "login.example.org:runs/proj x/"]
    assert "--filter=- data/" in argv and "--delete" not in argv
    v6 = remote.Target(host="2001:db8::1")
    assert remote.rsync_argv(v6, CONTROL, Path("/p"), [], "w")[-1] == "[2001:db8::1]:w/"


@pytest.mark.parametrize("workdir,name,want", [("~/runs", "proj", "runs/proj"), ("runs/", "p", "runs/p"),
                                               ("/scratch/a", "p", "/scratch/a/p"), ("~", "p", "p")])
def test_remote_dir(workdir, name, want):
    assert remote.remote_dir(remote.Target(host="h", workdir=workdir), Path("/x") / name) == want


# -- .hpcringignore: the same files as git would leave out -----------------------------------------

TREE = ["a.py", "b.tmp", "keep.tmp", "data/x.bin", "data/keep.bin", "sub/a.py", "sub/b.tmp", "sub/data/y.bin",
        "sub/deep/c.log", "c.log", "build/out.o", "sub/build/out.o", "docs/a b.txt", "#hash.txt", "!bang.txt"]
PATTERNS = ["*.tmp", "!keep.tmp", "data/", "/data/", "data", "sub/data/", "*.log", "!sub/deep/c.log", "build",
            "/build", "**/build", "sub/**/c.log", "!data/keep.bin", "docs/a\\ b.txt", "\\#hash.txt", "\\!bang.txt",
            "# a comment", "", "   ", "*.py", "!a.py", "sub/*.py", "sub/", "!sub/", "**/data", "deep/", "a.py   ",
            "[ab].tmp", "?.py", "sub/**", "**/deep/*.log", "sub/*", "!*.bin", "/sub/deep/", "deep", "*.bin",
            "!sub/data/", "!sub/data/y.bin", "docs", "!docs/", "/*.py", "**/*.o", "!build/"]


def _git_kept(root: Path, lines: list[str]) -> set[str]:
    (root / ".gitignore").write_text("\n".join(lines) + "\n")
    r = subprocess.run(["git", "-C", str(root), "ls-files", "--others", "--exclude-standard"],
                       capture_output=True, text=True, timeout=30, check=True)
    return {p for p in r.stdout.splitlines() if p != ".gitignore"}


def _rsync_kept(root: Path, dest: Path, lines: list[str]) -> set[str]:
    rules = remote_ignore.ignore_rules(lines, defaults=())
    subprocess.run(["rsync", "-r", *[f"--filter={r}" for r in rules], "--exclude=/.gitignore", "--exclude=/.git/",
                    f"{root}/", f"{dest}/"], check=True, timeout=30)
    return {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    if not (shutil.which("git") and shutil.which("rsync")):
        pytest.skip("needs git and rsync")
    root = tmp_path_factory.mktemp("tree")
    subprocess.run(["git", "init", "-q", str(root)], check=True, timeout=30)
    for rel in TREE:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    return root


@settings(max_examples=int(os.environ.get("HPCRING_IGNORE_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.sampled_from(PATTERNS), max_size=6))
def test_ignore_rules_leave_out_what_git_leaves_out(tree, tmp_path_factory, lines):
    dest = tmp_path_factory.mktemp("copy")
    assert _rsync_kept(tree, dest, lines) == _git_kept(tree, lines), (lines, remote_ignore.ignore_rules(lines, defaults=()))


def test_defaults_and_a_reinclude(tree, tmp_path):
    rules = remote_ignore.ignore_rules(["!.venv/"])
    assert rules[0] == "+ .venv/" and "- .git/" in rules and "- __pycache__/" in rules


def test_read_ignore_refuses_what_is_no_pattern_list(tmp_path):
    assert remote_ignore.read_ignore(tmp_path) == []
    (tmp_path / ".hpcringignore").write_bytes(b"ok\n\xff\n")
    with pytest.raises(UsageError, match=r"\.hpcringignore: not UTF-8 at byte 3"):
        remote_ignore.read_ignore(tmp_path)
    (tmp_path / ".hpcringignore").write_text("a\nb\x1b[31m\n")
    with pytest.raises(UsageError, match=r"\.hpcringignore:2: a control character"):
        remote_ignore.read_ignore(tmp_path)
    (tmp_path / ".hpcringignore").write_text("x" * (2 << 20))
    with pytest.raises(UsageError, match="at most 1 MiB"):
        remote_ignore.read_ignore(tmp_path)


# -- the target ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("login", (None, "login", None)), ("alice@login.example.org", ("alice", "login.example.org", None)),
    ("a_b@10.0.0.5:2222", ("a_b", "10.0.0.5", 2222)), ("[2001:db8::1]:22", (None, "2001:db8::1", 22)),
    ("bob@[::1]", ("bob", "::1", None)), ("2001:db8::1", (None, "2001:db8::1", None))])
def test_parse_target(text, want):
    if text == "2001:db8::1":
        with pytest.raises(UsageError, match="brackets"):
            remote.parse_target(text)
        return
    assert remote.parse_target(text) == want


BAD_TARGETS = ["", " login", "-oProxyCommand=x", "a b", "login;touch x", "$(x)", "`x`", "login:0", "login:65536",
               "login:22x", "@login", "a@b@c", "[::1", "[nothost]:22", "a..b", "x" * 300, "a@-h", "login:",
               "l\nogin", "u ser@h", "user$@h", "h:22:33", "[::1]x"]


@pytest.mark.parametrize("text", BAD_TARGETS)
def test_bad_targets_are_refused_naming_the_flag(text):
    with pytest.raises(UsageError) as exc:
        remote.parse_target(text)
    assert str(exc.value).startswith(f"--remote {text!r}") and "[user@]host[:port]" in str(exc.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_accepted_target_is_safe_on_a_command_line(text):
    """Whatever text is accepted parses to parts no shell or ssh would read as anything else."""
    try:
        user, host, port = remote.parse_target(text)
    except UsageError:
        return
    for part in (user or "a", host):
        assert not part.startswith("-") and not set(part) & set(" \t\n;&|$`'\"\\<>()*?[]{}!#~%")
    assert port is None or 1 <= port <= 65535


def test_precedence_flag_over_environment_over_site(tmp_path):
    from hpcring.config.site import load_site
    site_file = tmp_path / "s.yaml"
    site_file.write_text("name: s\nscheduler: slurm\nlauncher: {kind: srun}\nremote:\n  host: site-login\n"
                         "  user: siteuser\n  port: 2200\n  ssh_options: [IdentityFile=/k]\n  workdir: /w\n")
    site = load_site(str(site_file), {})
    assert remote.resolve(None, site, {}).where == "siteuser@site-login:2200"
    env = {"HPCRING_REMOTE": "envhost"}
    t = remote.resolve(None, site, env)
    assert (t.where, t.ssh_options, t.workdir, t.source) == ("siteuser@envhost:2200", ("IdentityFile=/k",), "/w",
                                                             "environment variable HPCRING_REMOTE")
    assert remote.resolve("bob@flaghost:22", site, env).where == "bob@flaghost:22"
    assert remote.resolve("none", site, env) is None and remote.resolve(None, site, {"HPCRING_REMOTE": "none"}) is None
    assert remote.resolve(None, None, {}) is None
    assert remote.resolve(None, site, {"HPCRING_REMOTE_HPCRING": "/x/hpcring"}).hpcring == "/x/hpcring"
    with pytest.raises(UsageError, match="HPCRING_REMOTE_HPCRING"):
        remote.resolve(None, site, {"HPCRING_REMOTE_HPCRING": "hpcring;rm"})


def test_control_dir_is_private_and_refused_otherwise():
    import tempfile
    tmp_path = Path(tempfile.mkdtemp(prefix="hr-"))      # short: a socket path has 108 bytes
    d = remote.control_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert d == tmp_path / "hpcring-ssh" and (d.stat().st_mode & 0o777) == 0o700
    d.chmod(0o755)
    with pytest.raises(RemoteError, match="not a private folder"):
        remote.control_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    long = tmp_path / ("x" * 60)
    long.mkdir()
    with pytest.raises(RemoteError, match="too long"):
        remote.control_dir({"XDG_RUNTIME_DIR": str(long)})
    shutil.rmtree(tmp_path)


# -- the site section -------------------------------------------------------------------------------

def _site(tmp_path, body: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text("name: s\nscheduler: slurm\nlauncher: {kind: srun}\nremote:\n" + body)
    return p


@pytest.mark.parametrize("body,key,why", [
    ("  host: -oProxyCommand=x\n", "remote.host", "starts with '-'"),
    ("  host: 'a;b'\n", "remote.host", "not a host name"),
    ("  host: h\n  user: 'a b'\n", "remote.user", "not a login name"),
    ("  host: h\n  port: 0\n", "remote.port", "greater than or equal to 1"),
    ("  host: h\n  port: 65536\n", "remote.port", "less than or equal to 65535"),
    ("  host: h\n  port: '22'\n", "remote.port", "valid integer"),
    ("  host: h\n  ssh_options: [ControlPath=/tmp/x]\n", "remote.ssh_options.0", "hpcring keeps it private"),
    ("  host: h\n  ssh_options: [Port=22]\n", "remote.ssh_options.0", "remote.port"),
    ("  host: h\n  ssh_options: [LocalCommand=touch x]\n", "remote.ssh_options.0", "not an ssh option"),
    ("  host: h\n  ssh_options: [IdentityFile]\n", "remote.ssh_options.0", "not Key=Value"),
    ("  host: h\n  ssh_options: ['IdentityFile=\"/a\"']\n", "remote.ssh_options.0", "option parser"),
    ("  host: h\n  ssh_options: {ControlMaster: 'no'}\n", "remote.ssh_options.ControlMaster", "shares one"),
    ("  host: h\n  ssh_options: {IdentityFile: [a]}\n", "remote.ssh_options.IdentityFile", "not an ssh option"),
    ("  host: h\n  ssh_options: {Bogus: x}\n", "remote.ssh_options.Bogus", "not an ssh option"),
    ("  host: h\n  ssh_options: {IdentityFile: ' /k'}\n", "remote.ssh_options.IdentityFile", "spaces"),
    ("  host: h\n  workdir: '../x'\n", "remote.workdir", "'..'"),
    ("  host: h\n  workdir: '~bob/x'\n", "remote.workdir", "not a folder path"),
    ("  host: h\n  workdir: 'a b'\n", "remote.workdir", "not a folder path"),
    ("  host: h\n  hpcring: 'hpcring --x'\n", "remote.hpcring", "not one word"),
    ("  user: u\n", "remote.host", "required key is missing"),
    ("  host: h\n  hots: x\n", "remote.hots", "did you mean 'host'"),
])
def test_bad_site_section_is_named(cli, tmp_path, body, key, why):
    p = _site(tmp_path, body)
    r = cli("sites", "validate", str(p))
    assert r.exit_code == 1 and f"{p}:" in r.stderr and f" {key}: " in r.stderr and why in r.stderr, r.stderr


def test_good_site_section_normalises_ssh_options(tmp_path):
    from hpcring.config.site import load_site
    p = _site(tmp_path, "  host: login-1.example.org\n  ssh_options:\n    identityfile: ~/.ssh/k\n"
                        "    ProxyJump: gw\n    ServerAliveInterval: 30\n")
    assert load_site(str(p), {}).config.remote.ssh_options == ["IdentityFile=~/.ssh/k", "ProxyJump=gw",
                                                               "ServerAliveInterval=30"]
    p = _site(tmp_path, "  host: h\n  ssh_options: ['-o IdentityFile=/k', '-oProxyJump=gw', 'Compression yes']\n")
    assert load_site(str(p), {}).config.remote.ssh_options == ["IdentityFile=/k", "ProxyJump=gw", "Compression=yes"]


# -- the CLI: bad --remote, and what reaches the login node ------------------------------------------

@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.sampled_from(BAD_TARGETS[1:]) | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                                       min_size=1, max_size=12).filter(lambda s: "@@" in s or ";" in s
                                                                                      or s.startswith("-")))
def test_bad_remote_flag_and_variable_start_nothing(cli, tmp_path, monkeypatch, text):
    monkeypatch.setattr(remote, "run", lambda *a, **k: pytest.fail("ssh or rsync was started"))
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    env = {"HPCRING_STATE_DIR": str(tmp_path / "state")}
    for args, extra in ((["submit", str(script), "--remote", text], {}), (["status", "1", "--remote", text], {}),
                        (["logs", "1", "--remote", text], {}), (["cancel", "1", "--remote", text], {}),
                        (["stacks", "1", "--remote", text], {}), (["status", "1"], {"HPCRING_REMOTE": text})):
        if extra and text.strip() in ("login",):     # a variable's value is read stripped, as every HPCRING_*
            continue
        r = cli(*args, env={**env, **extra})
        assert r.exit_code == 2, (args, text, r.stdout + r.stderr)
        named = "HPCRING_REMOTE" if extra else "--remote"
        assert named in r.stderr and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert not (tmp_path / "state" / "jobs").exists() or not any((tmp_path / "state" / "jobs").iterdir())


def test_submit_forwards_every_flag_but_remote(cli, tmp_path, monkeypatch):
    seen = {}

    def fake_submit(target, script, words, *, stream):
        seen.update(target=target, script=script, words=list(words), stream=stream)
        return 3
    monkeypatch.setattr(remote, "submit", fake_submit)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("pass\n")
    site = _site(tmp_path, "  host: login\n")
    r = cli("submit", str(proj / "train.py"), "--site", str(site), "--remote", "bob@other:2022",
            "-N", "2", "--shared", "--sched-arg", "--comment=a b", "--sched-arg", "--x", "--wait",
            "--dry-run", "--", "--lr", "0.1", "$(no)",
            env={"HPCRING_STATE_DIR": str(tmp_path / "state"), "HPCRING_SITE": ""})
    assert r.exit_code == 3, r.stdout + r.stderr      # the login node's exit code
    assert seen["target"].where == "bob@other:2022" and seen["stream"] is True
    words = seen["words"]
    assert words[-5:] == ["train.py", "--", "--lr", "0.1", "$(no)"]      # the script inside the copied folder
    assert words[:2] == ["--dry-run", "--wait"]                            # submit's own options, then the job's
    assert words[2:-5] == ["--site", "s", "--nodes", "2", "--shared", "--sched-arg", "--comment=a b",
                           "--sched-arg", "--x"]                           # the site file's name, not its path


def test_job_commands_follow_their_record_or_the_flag(cli, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(remote, "forward", lambda target, words, **kw: calls.append((target.where, list(words), kw)) or 0)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("HPCRING_REMOTE", raising=False)
    monkeypatch.delenv("HPCRING_SITE", raising=False)
    remote.remember(remote.Target(host="login", user="u", port=2022), "38", "slurm-c-38")
    for args in (["status", "38"], ["logs", "slurm-c-38", "-f", "-r", "1"], ["cancel", "38"],
                 ["stacks", "38", "--full", "--timeout", "900"], ["status", "7", "--remote", "x@y"]):
        r = cli(*args)
        assert r.exit_code == 0, r.stdout + r.stderr
    assert calls[0] == ("u@login:2022", ["status", "slurm-c-38"], {"timeout": remote.COMMAND_TIMEOUT_S})
    assert calls[1] == ("u@login:2022", ["logs", "--rank", "1", "--follow", "slurm-c-38"], {"timeout": None})
    assert calls[2][1] == ["cancel", "slurm-c-38"]
    assert calls[3][1] == ["stacks", "--full", "--timeout", "900.0", "slurm-c-38"] and calls[3][2]["timeout"] == 960
    assert calls[4][:2] == ("x@y", ["status", "7"])
    r = cli("cancel", "38_4")            # one array task
    assert r.exit_code == 0 and calls[5][1] == ["cancel", "slurm-c-38_4"]
    # a job this laptop does not know stays here
    r = cli("status", "39")
    assert r.exit_code == 1 and len(calls) == 6


def test_a_plain_id_of_a_job_here_and_there_is_ambiguous(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "forward", lambda *a, **k: pytest.fail("forwarded an ambiguous id"))
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("HPCRING_REMOTE", raising=False)
    from hpcring.schedulers import base
    monkeypatch.setattr(base, "load_record", lambda ref: type("R", (), {"key": "local-38"})())
    remote.remember(remote.Target(host="login"), "38", "slurm-c-38")
    r = cli("status", "38")
    assert r.exit_code == 2 and "job 38 is ambiguous: local-38 here and slurm-c-38 on login" in r.stderr, r.stderr


@pytest.mark.parametrize("stderr,want", [
    ("ssh: connect to host h port 22: Connection refused", "cannot reach"),
    ("ssh: Could not resolve hostname h: Name or service not known", "cannot reach"),
    ("u@h: Permission denied (publickey).", "was refused"),
    ("Host key verification failed.", "was refused"),
    ("kex_exchange_identification: weird", "failed")])
def test_ssh_failures_are_told_apart(stderr, want):
    with pytest.raises(RemoteError, match=want) as exc:
        remote.check_ssh(T, remote.CommandResult(255, "", stderr), "submitting")
    assert exc.value.hint and "submitting" in str(exc.value)
    assert remote.check_ssh(T, remote.CommandResult(3, "", stderr), "x").code == 3   # the remote command's own code
    with pytest.raises(RemoteError) as exc:           # printed as it came: not twice
        remote.check_ssh(T, remote.CommandResult(255, "", stderr, streamed=True), "submitting")
    assert want in str(exc.value) and stderr not in str(exc.value) and "ssh's message above" in str(exc.value)


@pytest.mark.parametrize("env,want", [({}, False), ({"SSH_ASKPASS": "/bin/ask"}, False),
                                      ({"SSH_ASKPASS": "/bin/ask", "DISPLAY": ":0"}, True),
                                      ({"SSH_ASKPASS": "/bin/ask", "SSH_ASKPASS_REQUIRE": "force"}, True),
                                      ({"SSH_ASKPASS_REQUIRE": "force"}, False)])
def test_batch_mode_unless_someone_can_answer(env, want, monkeypatch):
    """Without a terminal, ssh runs in BatchMode (a prompt would wait forever) unless an askpass
    program would answer it."""
    assert remote.askpass(env) is want
    for k in ("SSH_ASKPASS", "SSH_ASKPASS_REQUIRE", "DISPLAY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("sys.stdin", open(os.devnull))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ("BatchMode=yes" in remote.ssh_argv(T, CONTROL)) is not want


_KEYS = st.sampled_from(["IdentityFile", "identityfile", "ProxyJump", "ControlPath", "User", "Port", "LocalCommand",
                         "Bogus", "Identity File", "-oIdentityFile", ""]) | st.text(max_size=8)
_VALUES = st.sampled_from(["~/.ssh/k", "/a b/k", " x", "x ", "", '"q"', "a\nb", "a\x1bb", "\u2028", "yes"]) | \
    st.text(max_size=8) | st.integers(-5, 70000) | st.booleans() | st.lists(st.text(max_size=3), max_size=2)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=st.dictionaries(_KEYS, _VALUES, min_size=1, max_size=3))
def test_ssh_options_mapping_is_refused_naming_the_key_or_normalised(tmp_path, options):
    """The mapping form (which the generated schema tests do not reach): each entry is refused with
    its own key named, or becomes a Key=Value ssh takes as one option."""
    from hpcring.config.schema import Remote
    from pydantic import ValidationError
    try:
        got = Remote.model_validate({"host": "h", "ssh_options": options}).ssh_options
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"]) + tuple((err.get("ctx") or {}).get("sub", ()))
        assert loc[0] == "ssh_options" and (len(loc) == 1 or loc[1] in options), (loc, options)
        return
    assert len(got) == len(options)
    for item in got:
        key, _, value = item.partition("=")
        assert key in remote_checks.SSH_KEYWORDS.values() and key.lower() not in ("controlpath", "user", "port")
        assert value and value == value.strip() and '"' not in value
        assert not any(ord(c) < 0x20 or c in "\x7f\u2028\u2029" for c in value)


def test_logs_and_stacks_without_job_follow_the_newest_job_here_or_there(cli, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(remote, "forward", lambda target, words, **kw: calls.append((target.where, list(words))) or 0)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("HPCRING_REMOTE", raising=False)
    remote.remember(remote.Target(host="old"), "1", "slurm-c-1")
    remote.remember(remote.Target(host="login"), "2", "slurm-c-2")
    for args in (["logs"], ["stacks"]):
        r = cli(*args)
        assert r.exit_code == 0 and "job slurm-c-2 on login, the newest" in r.stderr, r.stderr
    assert calls == [("login", ["logs", "slurm-c-2"]), ("login", ["stacks", "slurm-c-2"])]
    # status without JOB lists this machine's jobs
    r = cli("status")
    assert len(calls) == 2
    # a job submitted here since is the newest one
    from hpcring.schedulers import base
    base.new_record("9", "local", "local", str(tmp_path / "jobs" / "9"), 1, "x", "x.py")
    r = cli("logs")
    assert len(calls) == 2 and "on login" not in (r.stderr or ""), r.stderr     # read here, not forwarded
