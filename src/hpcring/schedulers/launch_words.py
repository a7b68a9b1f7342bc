"""The command that starts the ranks, as words: one request, one result, one way to write it down.

Each scheduler module has ``launch_argv(site, request) -> LaunchWords`` (``slurm.py``: srun,
``lsf.py``: jsrun, blaunch, mpirun), built from the site's launcher settings. The job-script
templates write it through the ``launch_command`` Jinja global (:meth:`LaunchWords.script`), and
``hpcring run`` executes :attr:`LaunchWords.argv`: a batch job and an interactive allocation start
their ranks with the same flags, written in one place.

Two things exist only in a job script and are marked :class:`Shell` (written as they are, never
executed from Python): the command submitit hands the template (already shell text) and the
script's ``"$HOSTFILE"``. ``hpcring run`` passes a word list and a real host file instead.

Standard library only.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from hpcring.schedulers.container import prefix


class Shell(str):
    """Text the batch script's shell expands (``"$HOSTFILE"``, an already-quoted command)."""


HOSTFILE = Shell('"$HOSTFILE"')   # the host file templates/lsf.sh.j2 makes before it launches
_OPTION = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9-]*=)(.*)\Z", re.S)


@dataclass(frozen=True)
class LaunchRequest:
    """What to start: ``nodes x tasks_per_node`` copies of ``command``.

    ``logs``: per-rank log path prefix for the launcher's own output options (Slurm's ``%j`` job
    id, ``%t`` rank; a batch script), None when output goes to the caller (``hpcring run`` tags
    it). ``size_step``: name the step's size (``hpcring run`` may use part of an allocation; a
    batch script's step is the whole job as submitted). ``hostfile``: LSF's host file for
    blaunch/mpirun, one line per slot.
    """

    nodes: int
    tasks_per_node: int
    command: tuple[str, ...] | Shell
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    logs: str | None = None
    size_step: bool = False
    hostfile: str = HOSTFILE
    container: object = None   # config.container.ContainerRun: every rank inside that image

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node

    def command_words(self) -> tuple[str, ...]:
        """The command's argv (shell text split the way the batch shell splits it), inside the
        container's runtime prefix when there is one."""
        words = tuple(shlex.split(self.command)) if isinstance(self.command, Shell) else tuple(self.command)
        return self.container_prefix() + words

    def container_prefix(self) -> tuple[str, ...]:
        return prefix(self.container, gpus=self.gpus_per_node > 0)

    def launched(self) -> tuple[tuple[str, ...], ...]:
        """What the launcher starts on each rank, as lines: the container's runtime prefix (if any,
        on a line of its own), then the command (pyxis instead adds srun options:
        :func:`schedulers.container.srun_options`)."""
        pre = self.container_prefix()
        cmd = (self.command,) if isinstance(self.command, Shell) else tuple(self.command)
        return ((pre, cmd) if pre else (cmd,))


@dataclass(frozen=True)
class LaunchWords:
    """The launcher's words, grouped in lines (how a job script breaks them; an argv ignores it)."""

    lines: tuple[tuple[str, ...], ...]

    @property
    def argv(self) -> list[str]:
        """The words as one argv, for ``subprocess``; ValueError if one is job-script-only text."""
        words = [w for line in self.lines for w in line]
        shell = [w for w in words if isinstance(w, Shell)]
        if shell:
            raise ValueError(f"job-script text {shell} cannot be executed: pass real words and a host file")
        return words

    def script(self) -> str:
        """The words as job-script text: one backslash-continued line per group, each word quoted."""
        return " \\\n  ".join(" ".join(_script_word(w) for w in line) for line in self.lines)


def _script_word(word: str) -> str:
    if isinstance(word, Shell):
        return str(word)
    m = _OPTION.match(word)   # --output=VALUE reads better with only the value quoted
    return m.group(1) + shlex.quote(m.group(2)) if m else shlex.quote(word)


def quote_path(path: str) -> str:
    """``shlex.quote`` that keeps a leading ``~`` or ``~user`` unquoted, so the shell still expands it."""
    m = re.fullmatch(r"(~[A-Za-z0-9_.-]*)(/.*)?", path, re.S)
    if not m:
        return shlex.quote(path)
    return m.group(1) + (shlex.quote(m.group(2)) if m.group(2) else "")


def submitit_command(python: str, folder: str, module: str = "submitit.core._submit") -> str:
    """What every rank runs, as job-script text: ``python -u -m MODULE FOLDER``, each word quoted
    (a job folder may hold spaces and quotes; submitit's own executors leave ``python`` bare)."""
    return f"{quote_path(python)} -u -m {module} {shlex.quote(folder)}"


def remote_shell(words: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Words for a launcher that joins its arguments and runs them through a shell on each host
    (blaunch): one more level of quoting, so each still arrives as one argument."""
    return tuple(shlex.quote(w) for w in words)
