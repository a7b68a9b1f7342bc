"""Submitting from a laptop against a real sshd.

Debian's OpenSSH server runs inside dev-cluster node1's namespaces as the login node (its own
config and host key, key-only auth, a non-default port); this machine's root namespace is the
laptop. A job submitted with ``--remote root@10.99.0.1:PORT`` is copied with rsync (honouring
.hpcringignore), runs on the dev cluster, and status/logs/cancel/stacks go through the same ssh
ControlMaster: the sshd log shows one login for all of them.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SHARED = Path("/srv/hpcring")
pytestmark = [
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists() or not shutil.which("rsync"),
                                 reason="needs openssh-server and rsync (scripts/install-system-deps.sh)")]

JOB = """\
import os, sys, time
rank = os.environ.get("RANK")
print("REMOTE-HELLO rank", rank, "cwd", os.getcwd(), flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "--sleep":
    time.sleep(float(sys.argv[2]))
"""


def _free_port() -> int:
    # a port free in node1's namespace too: nothing but this test listens on 10.99.0.1 above 20000
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return 20000 + s.getsockname()[1] % 20000


class LoginNode:
    def __init__(self, base: Path):
        from hpcring.devcluster.cluster import node_exec_argv
        self.base = base
        self.port = _free_port()
        keys = base / "laptop keys"             # a space in the identity path: quoted for ssh and rsync
        keys.mkdir(parents=True)
        self.key = keys / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)], check=True, timeout=30)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / "hostkey")], check=True,
                       timeout=30)
        (base / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
        host_pub = (base / "hostkey.pub").read_text().split()
        self.known_hosts = keys / "known_hosts"
        self.known_hosts.write_text(f"[10.99.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.log = base / "sshd.log"
        self.remote_state = base / "remote-state"
        cfg = base / "sshd_config"
        cfg.write_text(f"""Port {self.port}
ListenAddress 10.99.0.1
HostKey {base}/hostkey
PidFile {base}/sshd.pid
AuthorizedKeysFile {base}/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
LogLevel INFO
MaxStartups 20
SetEnv HPCRING_STATE_DIR={self.remote_state} HPCRING_JOB_DIR={base}/jobs
""")
        subprocess.run(node_exec_argv("node1") + ["mkdir", "-p", "-m", "0755", "/run/sshd"], check=True, timeout=30)
        self.proc = subprocess.Popen(node_exec_argv("node1") + ["/usr/sbin/sshd", "-D", "-f", str(cfg),
                                                                "-E", str(self.log)],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while "Server listening" not in (self.log.read_text() if self.log.exists() else ""):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sshd did not start: {self.log.read_text() if self.log.exists() else ''}")
            time.sleep(0.1)

    def logins(self) -> int:
        return self.log.read_text().count("Accepted publickey")

    def _sessions(self) -> list[int]:
        """This sshd's per-connection processes (children and theirs), by parent pid."""
        parents = {}
        for d in Path("/proc").iterdir():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (ValueError, OSError, IndexError):
                continue
        found, todo = [], [self.proc.pid]
        while todo:
            parent = todo.pop()
            kids = [pid for pid, ppid in parents.items() if ppid == parent]
            found += kids
            todo += kids
        return found

    def stop(self) -> None:
        for pid in self._sessions():        # a session left open (a test that failed before closing its master)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # children of the listener (session processes) are in its process group
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def login():
    base = Path(tempfile.mkdtemp(prefix="remote-login-", dir=SHARED))    # the nodes share /srv/hpcring only
    node = LoginNode(base)
    try:
        yield node
    finally:
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def laptop(login):
    """The laptop's side: a site file naming the login node, its own state and control folders."""
    home = Path(tempfile.mkdtemp(prefix="hr-lt-"))        # short: the ControlPath socket lives below it
    site = home / "devcluster.yaml"
    site.write_text((ROOT / "site_configs" / "devcluster.yaml").read_text() + f"""
remote:
  host: 10.99.0.1
  user: nobody-overridden
  ssh_options:
    IdentityFile: {login.key}
    IdentitiesOnly: "yes"
    UserKnownHostsFile: {login.known_hosts}
    GlobalKnownHostsFile: /dev/null
    StrictHostKeyChecking: "yes"
  workdir: {login.base}/work
  hpcring: {ROOT}/.venv/bin/hpcring
""")
    env = {"HPCRING_STATE_DIR": str(home / "state"), "XDG_RUNTIME_DIR": str(home)}
    yield home, site, env
    from hpcring import remote
    remote.close(remote.Target(host="10.99.0.1", user="root", port=login.port), {"XDG_RUNTIME_DIR": str(home)})
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def own_runtime(login):
    """A control folder of a test's own (no master shared with another key), whose master is closed
    at the end even when the test fails: a master left open keeps a session on the login node."""
    d = tempfile.mkdtemp(prefix="hr-own-")
    yield d
    from hpcring import remote
    remote.close(remote.Target(host="10.99.0.1", user="root", port=login.port), {"XDG_RUNTIME_DIR": d})
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def hpcring(hpcring):
    """The conftest runner without the developer's own HPCRING_* variables (the tests set the
    site and target themselves) and with a 300 s bound (ssh, rsync and a dev-cluster job)."""
    return functools.partial(hpcring, drop_hpcring_env=True, timeout=300)


def _project(login) -> Path:
    proj = login.base / "laptop" / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "data" / "big.bin").write_bytes(b"x" * 1000)
    (proj / ".git").mkdir()
    (proj / ".git" / "config").write_text("[core]\n")
    (proj / "__pycache__").mkdir()
    (proj / "__pycache__" / "a.pyc").write_bytes(b"\0")
    (proj / "sub").mkdir()
    (proj / "sub" / "ok.txt").write_text("ok")
    (proj / "x.tmp").write_text("no")
    (proj / "keep.tmp").write_text("yes")
    (proj / ".hpcringignore").write_text("# test ignores\ndata/\n*.tmp\n!keep.tmp\n")
    (proj / "remote_submit_job.py").write_text(JOB)
    return proj


def test_submit_status_logs_cancel_through_one_ssh_master(hpcring, login, laptop):
    home, site, env = laptop
    proj = _project(login)
    target = ["--site", str(site), "--remote", f"root@10.99.0.1:{login.port}"]

    r = hpcring("submit", str(proj / "remote_submit_job.py"), *target, "--nodes", "2", "--wait", env=env, timeout=420)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("REMOTE-HELLO") == 2 and "COMPLETED" in out, out
    copied = login.base / "work" / "proj"
    assert f"cwd {copied}" in out, out            # the job ran in the copy on the login node's side
    # .hpcringignore and the defaults honoured; the rest copied
    assert (copied / "remote_submit_job.py").is_file() and (copied / "sub" / "ok.txt").is_file()
    assert (copied / "keep.tmp").is_file()
    for left_out in ("data", "x.tmp", ".git", "__pycache__"):
        assert not (copied / left_out).exists(), left_out
    job = re.search(r"Submitted job (\d+) \[(\S+)\]", r.stderr).group(1)

    # the laptop knows where the job lives: no --remote needed any more
    r = hpcring("status", job, env=env)
    assert r.returncode == 0 and "COMPLETED" in r.stdout + r.stderr, r.stdout + r.stderr
    r = hpcring("logs", job, env=env)
    assert r.returncode == 0 and r.stdout.count("REMOTE-HELLO") == 2, r.stdout + r.stderr
    r = hpcring("logs", "--follow", job, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.count("REMOTE-HELLO") == 2, r.stdout + r.stderr
    # the laptop itself has no such job
    assert not any((home / "state" / "jobs").glob("*")) if (home / "state" / "jobs").exists() else True

    # a long job: submit, see it, look at its stacks, cancel it, see it cancelled
    # a job setting from the laptop's environment reaches the login node's hpcring (CLI > env > site there too)
    r = hpcring("submit", str(proj / "remote_submit_job.py"), *target, "--", "--sleep", "300",
                env={**env, "HPCRING_JOB_NAME": "remote-env-name"})
    assert r.returncode == 0, r.stdout + r.stderr
    long_job = re.search(r"Submitted job (\d+) ", r.stderr).group(1)
    deadline = time.monotonic() + 120
    while True:
        r = hpcring("logs", long_job, env=env)
        if "REMOTE-HELLO" in r.stdout or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "REMOTE-HELLO" in r.stdout, r.stdout + r.stderr
    r = hpcring("status", long_job, env=env)
    assert r.returncode == 0 and "RUNNING" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "name remote-env-name" in r.stdout, r.stdout
    r = hpcring("stacks", long_job, "--timeout", "60", env=env, timeout=200)
    assert r.returncode == 0 and "rank" in r.stdout, r.stdout + r.stderr
    r = hpcring("cancel", long_job, env=env)
    assert r.returncode == 0 and "cancel requested" in r.stderr, r.stdout + r.stderr
    deadline = time.monotonic() + 90
    while True:
        r = hpcring("status", long_job, env=env)
        if "CANCELLED" in r.stdout + r.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert "CANCELLED" in r.stdout + r.stderr, r.stdout + r.stderr

    # every ssh (rsync's too) went through one master: one login on the sshd
    assert login.logins() == 1, login.log.read_text()
    sockets = [p for p in home.joinpath("hpcring-ssh").iterdir()]
    assert len(sockets) == 1 and sockets[0].is_socket(), sockets
    assert oct(home.joinpath("hpcring-ssh").stat().st_mode & 0o777) == "0o700"


def test_unreachable_refused_and_missing_hpcring_are_named(hpcring, login, laptop, tmp_path, own_runtime):
    home, site, env = laptop
    script = tmp_path / "remote_bad_job.py"
    script.write_text("print('never')\n")
    own = {**env, "XDG_RUNTIME_DIR": own_runtime}   # no shared master with the good key
    # nothing listens on this port
    t0 = time.monotonic()
    r = hpcring("submit", str(script), "--site", str(site), "--remote", f"root@10.99.0.1:{login.port + 1}", env=own)
    assert r.returncode == 1 and "cannot reach root@10.99.0.1" in r.stderr and "hint:" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60
    # a key the login node does not accept
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30)
    bad_site = tmp_path / "devcluster.yaml"
    bad_site.write_text(site.read_text().replace(str(login.key), str(other)))
    r = hpcring("submit", str(script), "--site", str(bad_site), "--remote", f"root@10.99.0.1:{login.port}", env=own)
    assert r.returncode == 1 and "was refused" in r.stderr and "Permission denied" in r.stderr, r.stderr
    # no hpcring at that path on the login node
    r = hpcring("submit", str(script), "--site", str(site), "--remote", f"root@10.99.0.1:{login.port}",
                env={**own, "HPCRING_REMOTE_HPCRING": "/nonexistent/bin/hpcring"})
    assert r.returncode == 1 and "was not found on root@10.99.0.1" in r.stderr and "remote.hpcring" in r.stderr, \
        r.stderr


def test_a_passphrase_is_asked_for_once(hpcring, login, laptop, tmp_path, own_runtime):
    """A key with a passphrase, asked for through SSH_ASKPASS (no terminal): submit, status, logs and
    cancel ask once between them: every later ssh, rsync's too, rides the first one's master."""
    home, site, env = laptop
    keys = tmp_path / "pp"
    keys.mkdir()
    key = keys / "id_pp"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret phrase", "-f", str(key)], check=True,
                   timeout=30)
    with open(login.base / "authorized_keys", "a") as f:
        f.write((keys / "id_pp.pub").read_text())
    asked = keys / "asked"
    askpass = keys / "askpass.sh"
    askpass.write_text(f"#!/bin/sh\necho asked >> '{asked}'\necho 's3cret phrase'\n")
    askpass.chmod(0o700)
    pp_site = keys / "devcluster.yaml"
    pp_site.write_text(site.read_text().replace(str(login.key), str(key)))
    own = {**env, "XDG_RUNTIME_DIR": own_runtime, "HPCRING_STATE_DIR": str(keys / "state"),
           "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force"}
    proj = login.base / "laptop" / "pp"
    proj.mkdir(parents=True)
    (proj / "remote_pp_job.py").write_text(JOB)
    before = login.logins()
    r = hpcring("submit", str(proj / "remote_pp_job.py"), "--site", str(pp_site), "--remote",
                f"root@10.99.0.1:{login.port}", "--", "--sleep", "300", env=own)
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"Submitted job (\d+) ", r.stderr).group(1)
    for args in (("status", job), ("logs", job), ("cancel", job), ("status", job)):
        r = hpcring(*args, env=own)
        assert r.returncode == 0, (args, r.stdout + r.stderr)
    assert asked.read_text().splitlines() == ["asked"]
    assert login.logins() == before + 1
