"""Python stacks of every thread of every rank: capture, a hook for hung ranks, parse, group, summarize.

Contract
--------
``format_all_threads() -> str``
    Every thread's Python stack, innermost frame first, in faulthandler's layout plus the thread's
    name (``Thread 0x00007f... "MainThread" (most recent call first):``). Safe from a background
    thread while the main thread is blocked in C code with the GIL released. Never raises.
``where(target=None) -> str``
    One line saying where a thread is: ``in allreduce at train.py:88 (train_step)`` when the
    innermost user frame is calling an hpcring API, else ``in load_batch at data.py:12``. ``target``
    is a frame, a ``threading.Thread``, a thread id, or None for the main thread. Never raises.
``install_signal_dump(path_or_dir, rank, *, signum=STACK_SIGNAL) -> Path | None``
    ``faulthandler.register(signum, all_threads=True, chain=False)`` appending to
    ``<diag dir>/stacks-live-rank<r>.txt``, so that a rank stuck even in C code dumps its stacks on
    ``kill -s RTMIN+6``. Idempotent; on an unwritable folder it warns once and returns None.
``parse_stacks(text) -> list[ThreadStack]``
    Threads of a faulthandler dump, of :func:`format_all_threads` or of ``py-spy dump``.
``group(stacks_by_rank) -> list[Group]`` and ``summarize(groups) -> str``
    Ranks with identical main-thread stacks, and ``ranks 0-4,6: in allreduce at train.py:88
    (train_step); rank 5: in load_batch at data.py:12``.

User code is every frame outside the hpcring package, the standard library (threading, runpy,
importlib, ...), ``<frozen ...>`` modules and site-packages; when a thread has no such frame, the
innermost frame outside hpcring stands in for it.

Signal choice: a real-time signal, SIGRTMIN+6 (:data:`STACK_SIGNAL`), that nothing else in the
stack uses. Not SIGUSR2: submitit (rank 0 checkpoints and requeues) and Slurm's
``--signal=USR2@N`` time-limit warning use it, and a dump hook there would silently disable both.
Not SIGUSR1: Lightning's SLURM requeue handler. SIGRTMIN+7 dumps the flight records
(:mod:`hpcring.diagnostics.watchdog`).
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import FrameType
from typing import IO, Mapping, Sequence, Union

from hpcring.ranks import rank_ranges, ranks_label
from hpcring.jobdir import diag_dir

__all__ = ["Frame", "ThreadStack", "Group", "STACK_SIGNAL", "live_file_name", "format_all_threads", "where",
           "locate", "install_signal_dump", "uninstall_signal_dump", "installed_signal_dump", "parse_stacks",
           "main_thread", "group", "group_line", "summarize", "rank_ranges", "format_thread"]

STACK_SIGNAL = signal.SIGRTMIN + 6
LIVE_FILE_RE = re.compile(r"stacks-live-rank(\d+)\.txt$")
_MAX_FRAMES = 100   # per thread, as faulthandler

_PKG_DIR = Path(__file__).resolve().parent.parent            # .../hpcring
_STDLIB_DIRS = tuple(sorted({str(Path(p).resolve()) for p in
                             (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if p}))
_OTHER_STDLIB = re.compile(r"/lib/python\d+\.\d+/")          # another interpreter's stdlib
_PACKAGES = re.compile(r"/(site|dist)-packages/")


@dataclass(frozen=True)
class Frame:
    """One Python frame: file as the dump names it, line (None when unknown), function name."""

    file: str
    line: int | None
    func: str

    def key(self) -> tuple[str, int | None, str]:
        """What makes two frames "the same" across dump formats (py-spy shortens file names and
        qualifies function names; faulthandler does neither)."""
        return (os.path.basename(self.file), self.line, self.func.rsplit(".", 1)[-1])


@dataclass
class ThreadStack:
    """One thread of a dump: id as written (hex or decimal), name if known, frames innermost first."""

    ident: str
    name: str | None = None
    frames: list[Frame] = field(default_factory=list)
    current: bool = False        # faulthandler: the thread that wrote the dump
    pid_thread: bool = False     # py-spy: the thread whose id is the process id (the main thread)

    def key(self) -> tuple:
        return tuple(f.key() for f in self.frames)


@dataclass
class Group:
    """Ranks whose main threads have the same stack; ``threads`` is the first rank's whole dump."""

    ranks: list[int]
    where: str
    main: ThreadStack | None
    threads: list[ThreadStack]


# ------------------------------------------------------------------------------- classification

@lru_cache(maxsize=4096)
def _is_hpcring(path: str) -> bool:
    """True when ``path`` is a file of the hpcring package (this one, or the same file under
    another install prefix: ``.../hpcring/collectives/api.py`` with that file existing here)."""
    p = path.replace("\\", "/")
    if p.startswith(str(_PKG_DIR) + "/"):
        return True
    for m in re.finditer(r"(?:^|/)hpcring/", p):
        rel = p[m.end():]
        if rel and (_PKG_DIR / rel).is_file():
            return True
    return False


@lru_cache(maxsize=4096)
def _is_library(path: str) -> bool:
    """True for the standard library, frozen modules and installed third-party packages."""
    p = path.replace("\\", "/")
    if p.startswith("<frozen"):
        return True
    if _PACKAGES.search(p) or p.startswith(tuple(d + "/" for d in _STDLIB_DIRS)) or _OTHER_STDLIB.search(p):
        return True
    if not p.startswith(("/", "<")):
        # a relative name, as py-spy writes without --full-filenames ("threading.py",
        # "concurrent/futures/thread.py"): the standard library by its top-level module name
        top = p.split("/", 1)[0]
        return (top[:-3] if top.endswith(".py") else top) in getattr(sys, "stdlib_module_names", ())
    return False


def _is_user(path: str) -> bool:
    return not _is_hpcring(path) and not _is_library(path)


def locate(frames: Sequence[Frame]) -> str:
    """The one-line location of a stack (frames innermost first); see :func:`where`."""
    if not frames:
        return "no Python frame"
    idx = next((i for i, f in enumerate(frames) if _is_user(f.file)), None)
    if idx is None:
        idx = next((i for i, f in enumerate(frames) if not _is_hpcring(f.file)), 0)
    user = frames[idx]
    at = f"{os.path.basename(user.file)}:{user.line if user.line is not None else '?'}"
    callee = frames[idx - 1] if idx > 0 else None
    if callee is not None and _is_hpcring(callee.file) and not _is_hpcring(user.file):
        return f"in {callee.func.rsplit('.', 1)[-1]} at {at} ({user.func})"
    return f"in {user.func} at {at}"


# ------------------------------------------------------------------------------------- capture

def _frames_of(frame: FrameType | None, limit: int = _MAX_FRAMES) -> list[Frame]:
    out: list[Frame] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append(Frame(code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return out


def format_thread(t: ThreadStack) -> str:
    """One thread in faulthandler's layout (with the name when known), ending in a newline."""
    head = "Current thread" if t.current else "Thread"
    name = f' "{t.name}"' if t.name else ""
    lines = [f"{head} {t.ident}{name} (most recent call first):"]
    lines += [f'  File "{f.file}", line {f.line if f.line is not None else "???"} in {f.func}' for f in t.frames]
    if not t.frames:
        lines.append("  <no Python frame>")
    return "\n".join(lines) + "\n"


def _live_threads() -> list[ThreadStack]:
    """Every thread of this process, main thread first."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    me = threading.get_ident()
    order = sorted(frames, key=lambda ident: (ident != main_id, ident))
    out = []
    for ident in order:
        stack = _frames_of(frames[ident])
        if ident == me:   # not this module's own frames
            while stack and stack[0].file == __file__:
                stack.pop(0)
        out.append(ThreadStack(f"0x{ident:016x}", names.get(ident), stack, ident == me))
    return out


def format_all_threads() -> str:
    """Every thread's Python stack (see the module doc). Never raises."""
    try:
        threads = _live_threads()
        return "\n".join(format_thread(t) for t in threads)
    except Exception as exc:  # a diagnostic must not take the rank down
        return f"<stacks unavailable: {type(exc).__name__}: {exc}>\n"


def where(target: Union[FrameType, threading.Thread, int, None] = None) -> str:
    """Where a thread is, in one line (see the module doc). Never raises.

    ``target``: a frame (used as the innermost frame), a Thread, a thread id, or None for the main
    thread. A thread that is not running gives ``thread not running``.
    """
    try:
        if isinstance(target, FrameType):
            frame = target
        else:
            ident = (threading.main_thread().ident if target is None
                     else target.ident if isinstance(target, threading.Thread) else int(target))
            if ident == threading.get_ident():
                frame = sys._getframe(1)
            else:
                frame = sys._current_frames().get(ident)
            if frame is None:
                return "thread not running"
        return locate(_frames_of(frame))
    except Exception as exc:
        return f"location unavailable ({type(exc).__name__}: {exc})"


# ---------------------------------------------------------------------------------------- hook

_hook_lock = threading.Lock()
_hooks: dict[int, tuple[Path, IO[str]]] = {}
_warned = False


def live_file_name(rank: int) -> str:
    """Name of a rank's live stack file: ``stacks-live-rank<r>.txt``."""
    return f"stacks-live-rank{int(rank)}.txt"


def _live_path(path_or_dir: str | os.PathLike | None, rank: int) -> Path:
    """None: ``<diag dir>/stacks-live-rank<r>.txt``; a directory (existing, or a name without a
    suffix): that file in it; else the path itself."""
    if path_or_dir is None:
        return diag_dir(create=False) / live_file_name(rank)
    p = Path(path_or_dir)
    if p.is_dir() or not p.suffix:
        return p / live_file_name(rank)
    return p


def install_signal_dump(path_or_dir: str | os.PathLike | None, rank: int, *,
                        signum: int = STACK_SIGNAL) -> Path | None:
    """Make ``signum`` append every thread's stack to the rank's live stack file (module doc).

    Pre: called in the rank process (any thread); ``rank`` is its global rank. Post: returns the
    file's path, or None when the file cannot be written or the platform lacks the signal (then a
    warning is issued once per process and the rank goes on without the hook). Calling again with
    the same file does nothing; with another file, the hook moves there. Never raises.
    """
    global _warned
    with _hook_lock:
        path: Path | None = None
        try:
            path = _live_path(path_or_dir, rank)
            old = _hooks.get(signum)
            if old is not None and old[0] == path:
                return path
            fh = _open_live_file(path, rank, signum)
            try:
                faulthandler.register(signum, file=fh, all_threads=True, chain=False)
            except BaseException:
                fh.close()
                raise
        except (OSError, ValueError, RuntimeError, AttributeError) as exc:
            if not _warned:
                _warned = True
                warnings.warn(f"hpcring: rank {rank} gets no stack dump on {signal_name(signum)}: cannot use "
                              f"{path if path is not None else path_or_dir} ({exc}); set HPCRING_JOB_DIR to a "
                              "writable shared folder to get one", RuntimeWarning, stacklevel=2)
            return None
        _hooks[signum] = (path, fh)
        if old is not None:
            old[1].close()
        if not _cleanup_registered:
            _register_cleanup()
        return path


_cleanup_registered = False


def _register_cleanup() -> None:
    global _cleanup_registered
    import atexit
    _cleanup_registered = True
    atexit.register(_remove_unused_live_files)


def _remove_unused_live_files() -> None:
    """At exit: a live file that got no dump is only its header; remove it, and the diag folder
    (and ``hpcring-diag/<job>`` above it) when that leaves them empty, so jobs that never hung
    leave nothing behind."""
    for path, fh in list(_hooks.values()):
        try:
            if fh.tell() > 0 and path.stat().st_size <= fh.tell() and _header_only(path):
                path.unlink()
                for d in (path.parent, path.parent.parent, path.parent.parent.parent):
                    if d.name not in ("diag", "hpcring-diag") and d.parent.name != "hpcring-diag":
                        break
                    d.rmdir()            # only if empty: OSError otherwise
        except OSError:
            continue


def _header_only(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().count("\n") <= 1


def signal_name(signum: int) -> str:
    """'SIGUSR2', or 'SIGRTMIN+6' for real-time signals (signal.Signals does not name them)."""
    if signal.SIGRTMIN < signum <= signal.SIGRTMAX:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _open_live_file(path: Path, rank: int, signum: int) -> IO[str]:
    """Open ``path`` for appending (parents created) and write a one-line header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a", encoding="utf-8")
    try:
        fh.write(f"# hpcring stack dumps of rank {rank} (pid {os.getpid()}) on "
                 f"{signal_name(signum)}, appended below\n")
        fh.flush()
    except BaseException:
        fh.close()
        raise
    return fh


def uninstall_signal_dump(signum: int = STACK_SIGNAL) -> None:
    """Undo :func:`install_signal_dump` (the signal's previous handler is restored). Never raises."""
    with _hook_lock:
        entry = _hooks.pop(signum, None)
        if entry is not None:
            faulthandler.unregister(signum)
            entry[1].close()


def installed_signal_dump(signum: int = STACK_SIGNAL) -> Path | None:
    """The live file the hook for ``signum`` writes to, or None when it is not installed."""
    entry = _hooks.get(signum)
    return entry[0] if entry else None


# ------------------------------------------------------------------------------------- parsing

_FH_HEAD = re.compile(r'^(Current thread|Thread) (0x[0-9a-fA-F]+|\d+)(?: "(.*)")? \(most recent call first\):\s*$')
_FH_STACK = re.compile(r"^Stack \(most recent call first\):\s*$")
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*?)\s*$')
_SPY_PROC = re.compile(r"^Process (\d+):")
_SPY_HEAD = re.compile(r'^Thread (0x[0-9a-fA-F]+|\d+)(?: \(([^)]*)\))?(?:: "(.*)")?\s*$')
_SPY_FRAME = re.compile(r"^ {4}(\S.*?) \((.*?)(?::(\d+))?\)\s*$")


def parse_stacks(text: str) -> list[ThreadStack]:
    """Threads of a stack dump in faulthandler's layout (also :func:`format_all_threads`'s) or
    ``py-spy dump``'s, in the order written; frames innermost first. Lines that belong to neither
    (headers, locals, ``<no Python frame>``, blank lines) are skipped. Never raises."""
    threads: list[ThreadStack] = []
    cur: ThreadStack | None = None
    pid = None
    for raw in text.splitlines():
        line = raw.rstrip("\n")
        m = _FH_HEAD.match(line)
        if m:
            cur = ThreadStack(m.group(2), m.group(3), current=m.group(1).startswith("Current"))
            threads.append(cur)
            continue
        if _FH_STACK.match(line):
            cur = ThreadStack("?", current=True)
            threads.append(cur)
            continue
        m = _SPY_PROC.match(line)
        if m:
            pid = m.group(1)
            cur = None
            continue
        m = _SPY_HEAD.match(line)
        if m:
            cur = ThreadStack(m.group(1), m.group(3), pid_thread=pid is not None and _same_id(m.group(1), pid))
            threads.append(cur)
            continue
        if cur is None:
            continue
        m = _FH_FRAME.match(line)
        if m:
            cur.frames.append(Frame(m.group(1), None if m.group(2) == "???" else int(m.group(2)), m.group(3)))
            continue
        m = _SPY_FRAME.match(line)
        if m:
            cur.frames.append(Frame(m.group(2), int(m.group(3)) if m.group(3) else None, m.group(1)))
    return threads


def _same_id(a: str, b: str) -> bool:
    try:
        return int(a, 0) == int(b, 0)
    except ValueError:
        return a == b


def main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The main thread of a parsed dump: the one named MainThread; else py-spy's thread whose id
    is the process id; else the last one (faulthandler lists threads newest first). None for an
    empty dump."""
    for t in threads:
        if t.name == "MainThread":
            return t
    for t in threads:
        if t.pid_thread:
            return t
    return threads[-1] if threads else None


# ------------------------------------------------------------------------------------ grouping

StackInput = Union[str, Sequence[ThreadStack], None]


def group(stacks_by_rank: Mapping[int, StackInput]) -> list[Group]:
    """Ranks with identical main-thread stacks, largest group first (ties: lowest rank first).

    Values are dump texts (parsed with :func:`parse_stacks`), already parsed threads, or None for
    a rank whose stack could not be collected (grouped as ``no stack collected``).
    """
    buckets: dict[object, Group] = {}
    for rank in sorted(stacks_by_rank):
        value = stacks_by_rank[rank]
        threads = parse_stacks(value) if isinstance(value, str) else list(value or [])
        main = main_thread(threads)
        if value is None:
            key, text = ("none",), "no stack collected"
        elif main is None:
            key, text = ("empty",), "no Python thread in the dump"
        else:
            key, text = main.key(), locate(main.frames)
        g = buckets.get(key)
        if g is None:
            buckets[key] = Group([rank], text, main, threads)
        else:
            g.ranks.append(rank)
    return sorted(buckets.values(), key=lambda g: (-len(g.ranks), g.ranks[0]))


def group_line(g: Group) -> str:
    """``ranks 0-4,6: in allreduce at train.py:88 (train_step)`` for one group."""
    return f"{ranks_label(g.ranks)}: {g.where}"


def summarize(groups: Sequence[Group], sep: str = "; ") -> str:
    """Every group's :func:`group_line`, joined with ``sep`` (one line for hang reports)."""
    return sep.join(group_line(g) for g in groups)
