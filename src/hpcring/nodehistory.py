"""Bad nodes stay out: the site's node history (``hpcring nodes``; README "Bad nodes stay out").

Every node a finished job's diagnosis blamed (:func:`hpcring.restarts.blamed`: a rank ``dead`` or
``unreachable`` on it, the host at a stalled link; ``NODE_FAIL`` named beside it) is recorded once
per job, by whoever sees the job end (``submit --wait``, ``logs --follow``, ``status``:
:func:`record_ended`; ``<job folder>/diag/node-history.json`` then says what, and a node cleared
since is not recorded again), in the site's shared state folder::

    <job_dir>/.hpcring/node-history.jsonl     one JSON object per line, one line per (job, node):
    {"node": "node2", "time": "2026-05-01T12:00:03Z", "job": "1361", "key": "slurm-devcluster-1361",
     "reason": "unreachable (rank 1)", "cause": "<the report's headline>", "user": "alice", ...}

``job_dir`` is on a filesystem every node sees and is one per cluster, so every user and job of a
site that shares it shares the history. ``time`` is when the failure was seen (the report's
trigger), UTC.

Policy (:func:`leave_out`, at ``submit``/``render``): a node blamed at least ``blames`` times
(HPCRING_BAD_NODE_BLAMES > site ``bad_nodes.blames`` > 2; 0: never) within ``days`` days
(HPCRING_BAD_NODE_DAYS > site ``bad_nodes.days`` > 7) goes into ``JobSpec.exclude``: the
scheduler's own exclusion (Slurm ``--exclude``, LSF ``select[hname!=...]``), as a restart's.
``--no-node-history`` ignores it for one job; ``hpcring nodes clear`` forgets nodes.

Concurrency: every change holds an exclusive ``flock`` on ``node-history.lock`` beside the file
(appends: one ``write`` of whole lines with ``O_APPEND``, then ``fsync``; ``clear``: a new file
renamed over the old one); readers hold it shared, so none sees half a record. A lock not had within
:data:`LOCK_TIMEOUT_S` is an error, never a hang.

Bad files: a line that is not a record (not JSON, a field missing or wrong, a line cut short by a
writer that died) makes the history untrusted: ``submit`` warns (naming the file, the line and what
to do) and leaves no node out automatically; ``nodes list`` is an error; recording still appends
(a job's blame is never lost). An unreadable or unwritable file: a warning where a job is
concerned (the job goes on), an error from ``hpcring nodes``. Nothing here prints.
"""
from __future__ import annotations

import calendar
import contextlib
import errno
import fcntl
import getpass
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from hpcring.config import envvars
from hpcring.config.text import control_character, shown
from hpcring.errors import HpcringError
from hpcring.fsutil import write_json

STATE_DIR = ".hpcring"                 # the site's shared state folder, under job_dir
FILE = "node-history.jsonl"
LOCK = "node-history.lock"
LOCK_TIMEOUT_S = 10.0
RECORDED = "node-history.json"         # in a job's diag folder: what was recorded (once per job)
MAX_BYTES = 64 << 20                   # larger is no history (a blame is ~300 bytes)
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
DAY_S = 86400.0
_FIELDS = ("node", "time", "job", "key", "reason")          # required, text
_OPTIONAL = ("cause", "user", "cluster")                    # text when present


class HistoryError(HpcringError):
    """The node history cannot be read, locked or written; the message names the file."""


class CorruptHistory(HistoryError):
    """Lines of the node history are no records (``lines``: their numbers, 1-based)."""

    def __init__(self, message: str, lines: list[int], *, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.lines = lines


@dataclass(frozen=True)
class Blame:
    node: str
    time: float                # seconds since the epoch; written as UTC text
    job: str                   # the job id
    key: str                   # the job's record name (unique across schedulers and clusters)
    reason: str                # why the node was blamed: "unreachable (rank 1)", "dead (ranks 2-3), NODE_FAIL"
    cause: str = ""            # the report's headline
    user: str = ""
    cluster: str = ""

    def line(self) -> str:
        d = {"node": self.node, "time": utc(self.time), "job": self.job, "key": self.key, "reason": self.reason,
             "cause": self.cause, "user": self.user, "cluster": self.cluster}
        return json.dumps({k: v for k, v in d.items() if v != "" or k in _FIELDS}, ensure_ascii=False) + "\n"


@dataclass(frozen=True)
class Policy:
    blames: int                # this many blames within ``days``: left out (0: never)
    days: float
    sources: tuple[str, str]   # where each came from ("default", "site NAME", "env HPCRING_...")

    def words(self) -> str:
        if not self.blames:
            return f"no node is left out automatically (blames 0 <- {self.sources[0]})"
        return (f"a node blamed {self.blames} time{'s' if self.blames > 1 else ''} within {_days(self.days)} is "
                f"left out of new jobs (blames <- {self.sources[0]}, days <- {self.sources[1]})")


@dataclass(frozen=True)
class NodeSummary:
    node: str
    recent: int                # blames within the policy's window
    total: int
    last: Blame
    excluded: bool


def utc(t: float) -> str:
    return time.strftime(TIME_FORMAT, time.gmtime(t))


def _days(days: float) -> str:
    return f"{days:g} day{'s' if days != 1 else ''}"


# ---- where, and the settings ---------------------------------------------------------------------

def history_path(root: str | os.PathLike) -> Path:
    """``<job_dir>/.hpcring/node-history.jsonl`` of the job folder root ``root``."""
    return Path(root) / STATE_DIR / FILE


def site_root(site, environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """(the site's job folder root, where its job_dir came from): HPCRING_JOB_DIR > site > default."""
    from hpcring.config.jobspec import job_dir_of, job_root  # deferred: pulls pydantic, yaml
    job_dir, source = job_dir_of(site, environ)
    return job_root(job_dir), source


def policy(site, environ: Mapping[str, str] | None = None) -> Policy:
    """HPCRING_BAD_NODE_BLAMES/_DAYS > site ``bad_nodes`` > defaults (2 blames, 7 days)."""
    conf = site.config.bad_nodes
    out, sources = [], []
    for var, key, default in (("HPCRING_BAD_NODE_BLAMES", "blames", envvars.DEFAULT_BAD_NODE_BLAMES),
                              ("HPCRING_BAD_NODE_DAYS", "days", envvars.DEFAULT_BAD_NODE_DAYS)):
        env = envvars.get(var, environ, default=None)
        if env is not None:
            out.append(env), sources.append(f"env {var}")
        elif getattr(conf, key) is not None:
            out.append(getattr(conf, key)), sources.append(f"site {site.name} bad_nodes.{key}")
        else:
            out.append(default), sources.append("default")
    return Policy(int(out[0]), float(out[1]), (sources[0], sources[1]))


def summarize(blames: list[Blame], pol: Policy, now: float | None = None) -> list[NodeSummary]:
    """One row per node, the most blamed in the window first."""
    now = time.time() if now is None else now
    since = now - pol.days * DAY_S
    by: dict[str, list[Blame]] = {}
    for b in blames:
        by.setdefault(b.node, []).append(b)
    rows = []
    for node, bs in by.items():
        recent = sum(1 for b in bs if b.time >= since)
        rows.append(NodeSummary(node, recent, len(bs), max(bs, key=lambda b: b.time),
                                bool(pol.blames) and recent >= pol.blames))
    return sorted(rows, key=lambda r: (-r.recent, -r.last.time, r.node))


# ---- reading -------------------------------------------------------------------------------------

def _fix_hint(path: Path, site_word: str | None) -> str:
    clear = f"`hpcring nodes clear --all{' --site ' + site_word if site_word else ''}`"
    return (f"delete or repair the line(s) named in {path} (one JSON record per line), or start the history "
            f"afresh with {clear} (its blames are lost)")


def parse_line(text: str) -> Blame:
    """One line of the history as a Blame; ValueError saying what is wrong with it."""
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    for k in _FIELDS + _OPTIONAL:
        v = d.get(k, "" if k in _OPTIONAL else None)
        if not isinstance(v, str) or (k in _FIELDS and not v.strip()):
            raise ValueError(f"{k!r} is missing or not text")
        if len(v) > 4096 or control_character(v):
            raise ValueError(f"{k!r} holds a control character or is too long")
    from hpcring.restarts import is_host_name  # deferred: pulls pydantic, yaml
    if not is_host_name(d["node"]):
        raise ValueError(f"node {shown(d['node'])} is no host name")
    try:
        t = float(calendar.timegm(time.strptime(d["time"], TIME_FORMAT)))
    except (ValueError, OverflowError):
        raise ValueError(f"time {shown(d['time'])} is not UTC time as {TIME_FORMAT}") from None
    return Blame(d["node"], t, d["job"], d["key"], d["reason"], d.get("cause", ""), d.get("user", ""),
                 d.get("cluster", ""))


def _parse(data: bytes, path: Path) -> tuple[list[Blame], list[tuple[int, str]]]:
    """(records, [(line number, what is wrong)]) of the file's bytes."""
    blames, bad = [], []
    lines = data.split(b"\n")
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if i == len(lines):            # no newline after it: a writer stopped in the middle
            bad.append((i, "cut short (no end of line): a writer stopped in the middle of a record"))
            continue
        try:
            blames.append(parse_line(raw.decode("utf-8")))
        except UnicodeDecodeError:
            bad.append((i, "not UTF-8 text"))
        except ValueError as exc:
            bad.append((i, str(exc)))
    return blames, bad


def _open_regular(path: Path, flags: int, what: str) -> int:
    """An fd of ``path`` that is a regular file (O_NONBLOCK: a FIFO there cannot hang us)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HistoryError(f"{what} {path} is not a regular file",
                               hint=f"remove it (hpcring makes a new one); it must be a file hpcring writes")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def _locked(folder: Path, exclusive: bool, timeout: float | None = None) -> Iterator[None]:
    """Hold ``folder/node-history.lock`` (exclusive: to change the history; shared: to read it).
    A reader that may not create or open the lock file reads without it."""
    path = folder / LOCK
    timeout = LOCK_TIMEOUT_S if timeout is None else timeout
    try:
        fd = _open_regular(path, os.O_RDWR | os.O_CREAT, "the node history's lock")
    except PermissionError:
        if exclusive:
            raise
        try:
            fd = _open_regular(path, os.O_RDONLY, "the node history's lock")
        except OSError:
            yield                      # nobody may write here either: nothing changes under us
            return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    break              # a filesystem without locks (ENOLCK, ENOSYS): appends are single writes
                if time.monotonic() >= deadline:
                    raise HistoryError(
                        f"the node history {folder / FILE} stayed locked for {timeout:g} s ({path})",
                        hint="another hpcring is changing it (on this or another node); try again. If none is, "
                             "a hung process holds the lock: find it with `fuser " + str(path) + "`") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)                   # releases the lock


def _read_bytes(path: Path) -> bytes:
    fd = _open_regular(path, os.O_RDONLY, "the node history")
    try:
        size = os.fstat(fd).st_size
        if size > MAX_BYTES:
            raise CorruptHistory(f"the node history {path} is {size >> 20} MiB, more than any history "
                                 f"(at most {MAX_BYTES >> 20} MiB)", [], hint=_fix_hint(path, None))
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _unreadable(path: Path, exc: OSError, doing: str) -> HistoryError:
    why = exc.strerror or str(exc)
    return HistoryError(f"cannot {doing} the node history {path}: {why}",
                        hint=f"the site's job_dir must be readable and writable by everyone who submits "
                             f"(check the permissions of {path.parent}), or set HPCRING_JOB_DIR to one that is")


def read(root: str | os.PathLike, site_word: str | None = None) -> list[Blame]:
    """Every record of the history under job folder root ``root`` (none yet: []); CorruptHistory
    when a line is no record, HistoryError when it cannot be read. Creates nothing when there is
    no history."""
    path = history_path(root)
    try:
        if not path.exists() and not path.is_symlink():
            return []
        with _locked(path.parent, exclusive=False):
            data = _read_bytes(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _unreadable(path, exc, "read") from None
    blames, bad = _parse(data, path)
    if bad:
        first = "; ".join(f"line {n}: {why}" for n, why in bad[:3]) + (f"; {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CorruptHistory(f"the node history {path} is corrupt: {first}", [n for n, _ in bad],
                             hint=_fix_hint(path, site_word))
    return blames


# ---- writing -------------------------------------------------------------------------------------

def append(root: str | os.PathLike, blames: list[Blame]) -> tuple[list[Blame], list[int], list[Blame]]:
    """Add ``blames`` that are not recorded yet (one per job and node: recording a job twice adds
    nothing); returns (those added, line numbers of corrupt lines kept as they are, every record
    now in the history). Raises HistoryError when the history cannot be locked or written."""
    path = history_path(root)
    try:
        path.parent.mkdir(exist_ok=True)
        with _locked(path.parent, exclusive=True):
            fd = _open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, "the node history")
            try:
                size = os.fstat(fd).st_size
                data = b""
                if size:
                    if size > MAX_BYTES:
                        raise CorruptHistory(f"the node history {path} is {size >> 20} MiB, more than any history",
                                             [], hint=_fix_hint(path, None))
                    data = os.pread(fd, size, 0)
                old, bad = _parse(data, path)
                seen = {(b.key, b.node) for b in old}
                new = []
                for b in blames:
                    if (b.key, b.node) not in seen:
                        seen.add((b.key, b.node))
                        new.append(b)
                if new:
                    # a line cut short stays on its own line: the new records never join it
                    out = (b"\n" if data and not data.endswith(b"\n") else b"") + \
                        "".join(b.line() for b in new).encode("utf-8")
                    while out:
                        out = out[os.write(fd, out):]
                    os.fsync(fd)
                return new, [n for n, _ in bad], old + new
            finally:
                os.close(fd)
    except OSError as exc:
        raise _unreadable(path, exc, "write") from None


def clear(root: str | os.PathLike, nodes: list[str] | None,
          site_word: str | None = None) -> tuple[dict[str, int], int]:
    """Forget ``nodes`` (None: every node) in the history under ``root``; returns ({node: blames
    removed} (a node not in it: 0), corrupt lines dropped). A corrupt history can only be cleared
    whole."""
    path = history_path(root)
    try:
        if not path.exists():
            return {n: 0 for n in nodes or []}, 0
        with _locked(path.parent, exclusive=True):
            data = _read_bytes(path)
            blames, bad = _parse(data, path)
            if bad and nodes is not None:
                raise CorruptHistory(f"the node history {path} is corrupt (line {bad[0][0]}: {bad[0][1]}): nodes "
                                     "cannot be cleared one by one", [n for n, _ in bad],
                                     hint=_fix_hint(path, site_word))
            gone = set(nodes) if nodes is not None else {b.node for b in blames}
            removed = {n: 0 for n in (nodes if nodes is not None else sorted(gone))}
            keep = []
            for b in blames:
                if b.node in gone:
                    removed[b.node] = removed.get(b.node, 0) + 1
                else:
                    keep.append(b)
            if any(removed.values()) or (nodes is None and data):
                _replace(path, "".join(b.line() for b in keep).encode("utf-8"))
            return removed, len(bad)
    except OSError as exc:
        raise _unreadable(path, exc, "rewrite") from None


def _replace(path: Path, data: bytes) -> None:
    """``path``'s content becomes ``data`` in one rename, with the old file's permissions (a shared
    history stays writable by the group it was)."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---- the two uses: a job ended, a job is submitted --------------------------------------------------

def blames_of(rec, oc, now: float | None = None) -> list[Blame]:
    """What the finished job ``rec`` (its outcome ``oc``) blames: its diagnosis named node-level
    faults (:func:`hpcring.restarts.blamed`). None for a job that completed or failed for its code."""
    if oc is None or oc.ok:
        return []
    from hpcring import restarts  # deferred: pulls pydantic, yaml
    v, report = restarts.blamed(rec, oc)
    if not v.restart or not v.nodes:
        return []
    reasons = restarts.node_reasons(report, v.nodes, oc.state.state)
    seen = ((report or {}).get("trigger") or {}).get("time")
    now = time.time() if now is None else now
    when = float(seen) if isinstance(seen, (int, float)) and 0 < seen <= now + DAY_S else now
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    cause = " ".join(str(v.cause).split())[:1000]
    return [Blame(n, when, rec.job_id, rec.key, reasons[n], cause if not control_character(cause) else "", user,
                  getattr(rec, "cluster", "") or "")
            for n in v.nodes if restarts.is_host_name(n)]


def record_ended(rec, oc, now: float | None = None) -> list[str]:
    """Record the nodes a finished job blamed in its site's history (once per job: a second call
    adds nothing). Returns the lines to tell the user: what was recorded, or a warning when it
    could not be (the job's own outcome is never changed by this). The local backend (one machine)
    records nothing."""
    if oc is None or oc.ok or rec.scheduler == "local" or getattr(rec, "array", None) is not None:
        return []
    diag = Path(rec.folder) / "diag"
    if not (diag / "hang-report.json").exists():
        return []                      # only a report names nodes (NODE_FAIL alone names none): no query
    if (diag / RECORDED).exists():
        return []                      # recorded already (and maybe cleared since: it stays cleared)
    root = Path(rec.folder).parent
    path = history_path(root)
    try:
        blames = blames_of(rec, oc, now)
        if not blames:
            return []
        new, bad, every = append(root, blames)
    except HistoryError as exc:
        return [f"warning: job {rec.job_id}: the blamed node(s) were not recorded in the node history: {exc.message}"
                + (f" (hint: {exc.hint})" if exc.hint else "")]
    try:
        write_json(diag / RECORDED, {"history": str(path), "blames": [json.loads(b.line()) for b in blames]}, indent=1)
    except OSError:
        pass                           # the history itself still records each (job, node) once
    out = []
    if new:
        out.append(f"job {rec.job_id}: node history ({path}): recorded " +
                   ", ".join(f"{b.node} ({b.reason})" for b in new) + "; " + _what_now(rec, new, every, now))
    if bad:
        out.append(f"warning: the node history {path} has corrupt line(s) {', '.join(map(str, bad[:5]))}: new "
                   "jobs leave no node out until it is repaired (`hpcring nodes list` says how)")
    return out


def _what_now(rec, new: list[Blame], every: list[Blame], now: float | None) -> str:
    """What the policy of the job's site now does with the nodes just recorded."""
    try:
        from hpcring.config.site import load_site  # deferred: pulls pydantic, yaml
        site = load_site(rec.site)
        pol = policy(site)
    except HpcringError:               # the job's site file moved or changed: say what is known
        return "`hpcring nodes list` shows what new jobs leave out"
    if not pol.blames:
        return f"site {site.name} leaves no node out (blames 0 <- {pol.sources[0]})"
    rows = {r.node: r for r in summarize(every, pol, now)}
    parts = []
    for node in dict.fromkeys(b.node for b in new):
        r = rows[node]
        parts.append(f"{node}: {r.recent} blame{'s' if r.recent != 1 else ''} in {_days(pol.days)}, " +
                     ("new jobs leave it out" if r.excluded else f"left out at {pol.blames}"))
    return "; ".join(parts) + " (`hpcring nodes list`)"


def leave_out(site, job, ignore: bool = False, environ: Mapping[str, str] | None = None,
              now: float | None = None) -> list[str]:
    """Add the nodes the site's history says to leave out to ``job.exclude`` (unless ``ignore``:
    ``--no-node-history``); returns the lines to print on stderr (one at most). A history that
    cannot be read or is corrupt leaves nothing out, and the line says so. The local backend has
    one machine: nothing is left out there."""
    if site.config.scheduler == "local":
        return []
    pol = policy(site, environ)
    if not pol.blames:
        return []
    from hpcring.config.jobspec import job_root  # deferred: pulls pydantic, yaml
    root = job_root(job.job_dir)
    path = history_path(root)
    word = site_word(site)
    try:
        rows = [r for r in summarize(read(root, word), pol, now) if r.excluded]
    except HistoryError as exc:
        return [f"warning: {exc.message}: no node is left out of this job automatically"
                + (f" (hint: {exc.hint})" if exc.hint else "")]
    if not rows:
        return []
    names = [r.node for r in rows]
    said = ", ".join(f"{r.node} ({r.recent} blame{'s' if r.recent > 1 else ''} in {_days(pol.days)}, last: "
                     f"{r.last.reason} in job {r.last.job})" for r in rows)
    if ignore:
        return [f"node history: not leaving out {said}: --no-node-history"]
    from hpcring.restarts import check_hosts  # deferred: pulls pydantic, yaml
    job.exclude = list(dict.fromkeys([*job.exclude, *check_hosts(names, f"node history {path}")]))
    job.sources["exclude"] = f"node history {path}"
    return [f"node history: leaving out {said}; to use them: --no-node-history (this job) or "
            f"`hpcring nodes clear {' '.join(names)}{' --site ' + word if word else ''}` ({path})"]


def site_word(site) -> str | None:
    """How to name the site on a command line: its name, or its file when it was given as one."""
    if site is None:
        return None
    return str(site.path) if site.origin == "path" else site.name
