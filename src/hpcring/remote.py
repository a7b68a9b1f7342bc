"""Submitting from a laptop: a login node reached over ssh (docs/remote.md).

``hpcring submit --remote user@host[:port]`` (else ``HPCRING_REMOTE``, else the site's ``remote:``
section) copies the script's folder to the login node with rsync over ssh (leaving out what
``.hpcringignore`` and :data:`hpcring.remote_ignore.DEFAULT_EXCLUDES` name), runs the login
node's own ``hpcring submit`` there and passes its output and exit code on. ``status``, ``logs``,
``cancel`` and ``stacks`` go through the same ssh connection: every ssh (rsync's too) shares one
ControlMaster whose socket lives in a private 0700 folder, so a password is asked for once at most.

Nothing typed by a user reaches a shell unquoted: ssh and rsync get argv lists, the one line the
login node's shell runs is built with :func:`shlex.quote` word by word, and host, user, port and
ssh options are checked before anything starts. Every wait has a deadline (ssh ConnectTimeout and
ServerAlive keepalives, subprocess timeouts, rsync's I/O timeout).

Standard library only (the CLI imports this at start-up); the checks of host, user, port and ssh
options are :mod:`hpcring.config.remote_checks`'s, which the site schema uses too.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from hpcring.config.remote_checks import (CONTROL_PERSIST_S, TO_EOL, host_problem, hpcring_problem, port_problem,
                                          user_problem)
from hpcring.errors import RemoteError, UsageError
from hpcring.remote_ignore import ignore_rules, read_ignore
from hpcring.fsutil import write_json
from hpcring.schedulers.base import state_dir

ENV_REMOTE, ENV_REMOTE_HPCRING = "HPCRING_REMOTE", "HPCRING_REMOTE_HPCRING"
NONE = "none"                       # --remote none: run here even if the site names a login node
DEFAULT_WORKDIR = "hpcring-remote"  # relative: under the login user's home
CONNECT_TIMEOUT_S = 20          # ssh ConnectTimeout: an unreachable host fails within this
ALIVE_INTERVAL_S, ALIVE_COUNT = 15, 4    # a dead connection is noticed within about a minute
COMMAND_TIMEOUT_S = 600.0       # status, cancel, stacks, submit without --wait
COPY_TIMEOUT_S = 3600.0         # rsync as a whole; its own --timeout bounds each stall
COPY_IO_TIMEOUT_S = 120
# Job settings the login node's hpcring reads from its environment (CLI > environment > site):
# the laptop's values travel with the command, so the precedence is the same there.
FORWARDED_ENV = ("HPCRING_NODES", "HPCRING_TASKS_PER_NODE", "HPCRING_GPUS_PER_NODE", "HPCRING_CPUS_PER_TASK",
                 "HPCRING_TIME", "HPCRING_PARTITION", "HPCRING_ACCOUNT", "HPCRING_QOS", "HPCRING_CONSTRAINT",
                 "HPCRING_JOB_NAME", "HPCRING_TIMEOUT", "HPCRING_CONTAINER_IMAGE", "HPCRING_CONTAINER_MOUNTS",
                 "HPCRING_NO_CONTAINER")

TARGET_FORMS = "[user@]host[:port], e.g. alice@login.example.org or alice@10.0.0.5:2222 ([v6 address]:port)"


# -- the target --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One login node and how to reach it."""

    host: str
    user: str | None = None
    port: int | None = None
    ssh_options: tuple[str, ...] = ()     # normalised Key=Value
    workdir: str = DEFAULT_WORKDIR
    hpcring: str = "hpcring"
    source: str = ""                      # where host came from, for messages

    @property
    def where(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (f"{self.user}@" if self.user else "") + host + (f":{self.port}" if self.port else "")


def parse_target(text: str, what: str = "--remote") -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` as (user, host, port); UsageError naming ``what`` otherwise."""
    def bad(why: str) -> UsageError:
        return UsageError(f"{what} {text!r}: {why}", hint=f"write {TARGET_FORMS}, or `none` to submit here")
    if not text or text != text.strip():
        raise bad("empty, or with spaces around it")
    user, at, rest = text.rpartition("@")
    if not at:
        user, rest = None, text
    port_text = None
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise bad("an IPv6 address goes in brackets: [2001:db8::1]:22")
        port_text = tail[1:] if tail else None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"{host!r} in brackets is not an IPv6 address") from None
    elif rest.count(":") == 1:
        host, _, port_text = rest.partition(":")
    else:
        host = rest
        if ":" in host:
            raise bad("an IPv6 address goes in brackets: [2001:db8::1]:22")
    why = host_problem(host) or (user is not None and user_problem(user)) or None
    if why:
        raise bad(why)
    port = None
    if port_text is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port_text, re.ASCII) or port_problem(int(port_text)):
            raise bad(f"port {port_text!r} is not a TCP port from 1 to 65535")
        port = int(port_text)
    return user, host, port


def resolve(cli: str | None, site, environ: Mapping[str, str] | None = None) -> Target | None:
    """The login node of a command, or None to work here: ``--remote`` > HPCRING_REMOTE > the site's
    ``remote:`` section. A target from the flag or the variable keeps the site section's other
    settings (ssh options, workdir, hpcring command; user and port unless it names them)."""
    env = os.environ if environ is None else environ
    sect = getattr(getattr(site, "config", None), "remote", None)
    if cli is not None:
        text, what = cli, "--remote"
    elif (env.get(ENV_REMOTE) or "").strip():
        text, what = env[ENV_REMOTE].strip(), f"environment variable {ENV_REMOTE}"
    else:
        text, what = None, None
    if text is not None and text.lower() == NONE:
        return None
    hpcring = (env.get(ENV_REMOTE_HPCRING) or "").strip() or (sect.hpcring if sect and sect.hpcring else "hpcring")
    why = hpcring_problem(hpcring)
    if why:
        where = f"environment variable {ENV_REMOTE_HPCRING}" if env.get(ENV_REMOTE_HPCRING) else "remote.hpcring"
        raise UsageError(f"{where}: {why}",
                         hint="name the hpcring command on the login node")
    base = Target(host="", user=sect.user if sect else None, port=sect.port if sect else None,
                  ssh_options=tuple(sect.ssh_options) if sect else (),
                  workdir=(sect.workdir if sect and sect.workdir else DEFAULT_WORKDIR), hpcring=hpcring)
    if text is not None:
        user, host, port = parse_target(text, what)
        return replace(base, host=host, user=user or base.user, port=port or base.port, source=what)
    if sect is None:
        return None
    return replace(base, host=sect.host, source=f"site {site.name} (remote.host)")


# -- argv builders ---------------------------------------------------------------------------------

def control_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The private folder of ControlMaster sockets: $XDG_RUNTIME_DIR/hpcring-ssh, else
    /tmp/hpcring-ssh-UID; created 0700, and refused when someone else owns it or may enter it
    (a socket there is a logged-in connection)."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    d = Path(runtime) / "hpcring-ssh" if runtime else Path(f"/tmp/hpcring-ssh-{os.getuid()}")
    hint = f"remove {d} (or set XDG_RUNTIME_DIR to a private folder) and try again"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError as exc:
        raise RemoteError(f"cannot make the ssh control folder {d}: {exc.strerror or exc}", hint=hint) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RemoteError(f"ssh control folder {d} is not a private folder of this user (mode "
                          f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid})", hint=hint)
    # sun_path holds 108 bytes; ssh adds '/' and the 40-character %C hash (and a temporary suffix)
    if len(str(d)) > 50 or any(c.isspace() for c in str(d)):
        raise RemoteError(f"ssh control folder {d} is too long for a socket path or holds spaces",
                          hint="set XDG_RUNTIME_DIR to a short folder, e.g. /run/user/$(id -u)")
    return d


def _opt_word(option: str) -> str:
    key, _, value = option.partition("=")
    # ssh reads -o like a config line: a value with spaces needs double quotes (paths with spaces)
    if key.lower() not in TO_EOL and any(c.isspace() for c in value):
        value = f'"{value}"'
    return f"{key}={value}"


def askpass(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ssh would ask through an SSH_ASKPASS program (a GUI, an IDE) without a terminal."""
    env = os.environ if environ is None else environ
    return bool(env.get("SSH_ASKPASS")) and (env.get("SSH_ASKPASS_REQUIRE") in ("force", "prefer")
                                             or bool(env.get("DISPLAY")))


def ssh_argv(target: Target, control: Path, *, batch: bool | None = None) -> list[str]:
    """ssh with the shared master, the target's options and the deadlines, up to (not including)
    the host. ssh keeps the first value of an option, so the site's options come first and win."""
    if batch is None:          # nobody to answer a prompt: fail at once instead of waiting forever
        batch = not (sys.stdin.isatty() and sys.stderr.isatty()) and not askpass()
    argv = ["ssh"]
    for option in target.ssh_options:
        argv += ["-o", _opt_word(option)]
    argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={control}/%C",
             "-o", f"ControlPersist={CONTROL_PERSIST_S}", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
             "-o", f"ServerAliveInterval={ALIVE_INTERVAL_S}", "-o", f"ServerAliveCountMax={ALIVE_COUNT}"]
    if batch:
        argv += ["-o", "BatchMode=yes"]
    if target.port:
        argv += ["-p", str(target.port)]
    if target.user:
        argv += ["-l", target.user]
    return argv


def remote_line(words: Sequence[str], *, cd: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The one command line the login node's shell runs: every word quoted."""
    assign = [f"{k}={v}" for k, v in {ENV_REMOTE: NONE, **(env or {})}.items()]
    line = shlex.join(["env", *assign, *words])
    return f"cd {shlex.quote(cd)} && {line}" if cd else line


def command_argv(target: Target, control: Path, words: Sequence[str], *, cd: str | None = None,
                 env: Mapping[str, str] | None = None) -> list[str]:
    """ssh argv that runs ``words`` (hpcring and its arguments) on the login node. ``HPCRING_REMOTE=none``
    goes with it so a login node whose site also names a remote does not forward again."""
    return ssh_argv(target, control) + ["--", target.host, remote_line(words, cd=cd, env=env)]


def remote_dir(target: Target, local_dir: Path) -> str:
    """Where ``local_dir`` is copied: ``<workdir>/<its name>`` (relative: under the home folder)."""
    work = target.workdir[2:] if target.workdir.startswith("~/") else target.workdir
    name = local_dir.name or "root"
    return f"{work.rstrip('/')}/{name}" if work not in ("", "~") else name


def rsync_argv(target: Target, control: Path, local_dir: Path, rules: Sequence[str], dest: str) -> list[str]:
    """rsync of ``local_dir`` into ``dest`` on the login node through the shared ssh master.
    ``--protect-args``: the remote path reaches the remote rsync as it is, not through a shell."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    argv = ["rsync", "--recursive", "--links", "--perms", "--times", "--protect-args",
            f"--timeout={COPY_IO_TIMEOUT_S}", "-e", shlex.join(ssh_argv(target, control))]
    argv += [f"--filter={r}" for r in rules]
    return argv + ["--", f"{local_dir}/", f"{host}:{dest}/"]


# -- running ---------------------------------------------------------------------------------------

_UNREACHABLE = ("could not resolve", "connection refused", "no route to host", "connection timed out",
                "network is unreachable", "operation timed out", "connection closed by", "connection reset")
_AUTH = ("permission denied", "too many authentication failures", "host key verification failed",
         "no more authentication methods")


def _ssh_failure(target: Target, stderr: str, what: str, shown: bool = False) -> RemoteError:
    low = stderr.lower()
    # ssh's own words, unless they were just printed as they came (a streamed command)
    tail = "ssh's message above" if shown and stderr.strip() else " ".join(stderr.strip().splitlines()[-2:])[:300]
    if any(s in low for s in _AUTH):
        return RemoteError(f"{what}: ssh to {target.where} was refused ({tail})",
                           hint="check the user and that your key is accepted (`ssh` to it once by hand; "
                                "remote.ssh_options may name IdentityFile), or accept its host key")
    if any(s in low for s in _UNREACHABLE):
        return RemoteError(f"{what}: cannot reach {target.where} ({tail})",
                           hint=f"check the host and port (from {target.source}) and your network or VPN")
    return RemoteError(f"{what}: ssh to {target.where} failed ({tail or 'no message'})",
                       hint="run the same ssh by hand with -v to see why")


_PACKAGES = {"ssh": "openssh-client", "rsync": "rsync"}


@dataclass
class CommandResult:
    """How one ssh or rsync run ended: its exit code and output."""

    code: int
    stdout: str = ""
    stderr: str = ""
    lines: list[str] = field(default_factory=list)
    streamed: bool = False        # its output was passed on as it came


def _pump(src, dst, keep: list[str], on_line: Callable[[str], None] | None) -> None:
    for line in iter(src.readline, ""):
        keep.append(line)
        del keep[:-200]           # the tail is enough to tell why something failed
        if on_line:
            on_line(line)
        if dst is not None:
            dst.write(line)
            dst.flush()


def run(argv: list[str], *, timeout: float | None, stream: bool = False,
        on_stderr_line: Callable[[str], None] | None = None) -> CommandResult:
    """Run ``argv``; with ``stream`` its output goes on to ours as it comes (logs -f, submit --wait).
    ``timeout`` None only for streams, whose end is the job's end and whose connection is watched by
    ssh's keepalives. Raises RemoteError when ``argv[0]`` is missing or the deadline passes."""
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL if not sys.stdin.isatty() else None,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", bufsize=1)
    except FileNotFoundError:
        raise RemoteError(f"{argv[0]} is not installed on this machine",
                          hint=f"install it (Debian: apt-get install {_PACKAGES.get(argv[0], argv[0])})") from None
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout if stream else None, out, None), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr if stream else None, err, on_stderr_line),
                              daemon=True)]
    for t in pumps:
        t.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise RemoteError(f"{argv[0]} did not finish within {timeout:g} s", hint="check the login node and the "
                          "network; the shared ssh connection is dropped after a minute without answer") from None
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    for t in pumps:
        t.join(timeout=10)
    return CommandResult(code, "".join(out), "".join(err), out, streamed=stream)


def check_ssh(target: Target, res: CommandResult, what: str) -> CommandResult:
    """ssh's own failure (255) as a RemoteError with a hint; the remote command's codes pass."""
    if res.code == 255:
        raise _ssh_failure(target, res.stderr, what, shown=res.streamed)
    return res


def prepare(target: Target, control: Path, dest: str | None) -> None:
    """One round trip before anything else: log in (the one prompt, if any), make ``dest`` and find
    the login node's hpcring, so each of these fails with its own message."""
    words = f"command -v {shlex.quote(target.hpcring)} >/dev/null 2>&1 || exit 127"
    if dest:
        words = f"mkdir -p -- {shlex.quote(dest)} && {{ {words}; }}"
    argv = ssh_argv(target, control) + ["--", target.host, words]
    res = check_ssh(target, run(argv, timeout=COMMAND_TIMEOUT_S), "connecting")
    if res.code == 127:
        raise RemoteError(f"hpcring ({target.hpcring!r}) was not found on {target.where}",
                          hint="install hpcring there and set remote.hpcring (or HPCRING_REMOTE_HPCRING) to its "
                               "full path, e.g. ~/hpcring/.venv/bin/hpcring: a non-interactive ssh shell may "
                               "not read the PATH your login shell sets")
    if res.code != 0:
        raise RemoteError(f"cannot make {dest!r} on {target.where}: {res.stderr.strip()[-300:]}",
                          hint="set remote.workdir to a folder you may write there")


def copy(target: Target, control: Path, local_dir: Path, dest: str) -> CommandResult:
    rules = ignore_rules(read_ignore(local_dir))
    res = run(rsync_argv(target, control, local_dir, rules, dest), timeout=COPY_TIMEOUT_S)
    if res.code == 255 or "connection unexpectedly closed" in res.stderr:
        raise _ssh_failure(target, res.stderr, f"copying {local_dir}")
    if res.code != 0:
        hint = ("install rsync on the login node" if "command not found" in res.stderr or res.code == 127
                else "see rsync's message above")
        raise RemoteError(f"copying {local_dir} to {target.where}:{dest} failed (rsync exit {res.code}): "
                          f"{res.stderr.strip()[-300:]}", hint=hint)
    return res


def close(target: Target, environ: Mapping[str, str] | None = None) -> None:
    """Stop the shared master now (it would stop by itself after CONTROL_PERSIST_S)."""
    argv = ssh_argv(target, control_dir(environ), batch=True) + ["-O", "exit", "--", target.host]
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


# -- remote job records (so `hpcring status JOB` on the laptop knows where JOB lives) -------------

_SUBMITTED = re.compile(r"Submitted job (\S+) \[([A-Za-z0-9._-]+)\]")
_JOB_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)


def _records() -> Path:
    d = state_dir().parent / "remote"
    d.mkdir(exist_ok=True)
    return d


def remember(target: Target, job_id: str, key: str) -> None:
    if not (_JOB_REF.fullmatch(job_id) and _JOB_REF.fullmatch(key)):
        return
    data = {**asdict(target), "ssh_options": list(target.ssh_options), "job_id": job_id, "key": key,
            "submitted_at": time.time()}
    write_json(_records() / f"{key}.json", data)


def newest_remembered(than: float) -> tuple[Target, str] | None:
    """(target, record name there) of the newest job submitted from here with --remote, if it is
    newer than ``than`` (the newest job submitted here)."""
    best, when = None, than
    for p in _records().glob("*.json"):
        try:
            at = float(json.loads(p.read_text()).get("submitted_at", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if at > when:
            best, when = p.stem, at
    return recalled(best) if best else None


def recalled(job_ref: str | None) -> tuple[Target, str] | None:
    """(target, the job's name on the login node) of a job submitted from here with --remote: its
    record name or plain id, with an array task's ``_N`` kept."""
    if not job_ref or not _JOB_REF.fullmatch(job_ref):
        return None
    m = re.fullmatch(r"(.+?)(_[0-9]+)?", job_ref)
    head, task = m.group(1), m.group(2) or ""
    d = _records()
    hits = [d / f"{head}.json"] if (d / f"{head}.json").is_file() else \
        [p for p in d.glob("*.json") if p.stem.rsplit("-", 1)[-1] == head]
    if len(hits) != 1:
        return None
    try:
        data = json.loads(hits[0].read_text())
        fields_ = {k: data[k] for k in ("host", "user", "port", "workdir", "hpcring", "source")}
        target = Target(ssh_options=tuple(data["ssh_options"]), **fields_)
        return target, data["key"] + task
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- the two operations the CLI calls -----------------------------------------------------------------

def forward_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: env[k] for k in FORWARDED_ENV if (env.get(k) or "").strip()}


def submit(target: Target, script: Path, words: Sequence[str], *, stream: bool) -> int:
    """Copy the script's folder, run ``hpcring submit`` there with ``words`` (its arguments, the
    script named relative to the copy), print what it prints; returns its exit code."""
    control = control_dir()
    local_dir = script.resolve().parent
    dest = remote_dir(target, local_dir)
    prepare(target, control, dest)
    copy(target, control, local_dir, dest)
    seen: list[tuple[str, str]] = []

    def on_line(line: str) -> None:
        m = _SUBMITTED.search(line)
        if m and not seen:
            seen.append((m.group(1), m.group(2)))
            remember(target, *seen[0])     # recorded before --wait follows: Ctrl-C keeps it

    argv = command_argv(target, control, [target.hpcring, "submit", *words], cd=dest, env=forward_env())
    res = check_ssh(target, run(argv, timeout=None if stream else COMMAND_TIMEOUT_S, stream=True,
                                on_stderr_line=on_line), "submitting")
    return res.code


def forward(target: Target, words: Sequence[str], *, stream: bool = True,
            timeout: float | None = COMMAND_TIMEOUT_S) -> int:
    """Run ``hpcring WORDS`` on the login node, its output passed on; returns its exit code."""
    control = control_dir()
    argv = command_argv(target, control, [target.hpcring, *words])
    res = check_ssh(target, run(argv, timeout=timeout, stream=stream), f"hpcring {words[0]}")
    if res.code == 127 and "not found" in res.stderr:
        raise RemoteError(f"hpcring ({target.hpcring!r}) was not found on {target.where}",
                          hint="set remote.hpcring (or HPCRING_REMOTE_HPCRING) to its full path there")
    return res.code
