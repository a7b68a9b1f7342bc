"""scripts/under-load.sh: a command run N times beside K busy processes, each run's exit status and
duration, one tally line, a non-zero exit if a run failed, and no busy process left however it ends."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "under-load.sh"


def under_load(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def busy_pids(out: str) -> list[int]:
    m = re.search(r"^under-load: \d+ busy process\(es\)(?: \(pids ([\d ]+)\))?$", out, re.M)
    assert m, out
    return [int(p) for p in (m.group(1) or "").split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes; its parent (the script) has exited and init reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def gone(pids: list[int], within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_all_runs_pass():
    p = under_load("-n", "3", "-k", "2", "--", "true")
    assert p.returncode == 0, p.stderr
    runs = re.findall(r"^under-load: run (\d)/3: exit 0, \d+\.\d\d s, passed$", p.stdout, re.M)
    assert runs == ["1", "2", "3"], p.stdout
    assert p.stdout.splitlines()[-1] == "under-load: 3 runs, 3 passed, 0 failed (2 busy processes)"
    pids = busy_pids(p.stdout)
    assert len(pids) == 2 and gone(pids), pids


def test_a_failing_run_fails_the_whole():
    p = under_load("-n", "1", "-k", "1", "--", "false")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "under-load: run 1/1: exit 1," in p.stdout and "FAILED" in p.stdout
    assert p.stdout.splitlines()[-1] == "under-load: 1 run, 0 passed, 1 failed (1 busy process)"
    assert gone(busy_pids(p.stdout))


def test_the_busy_processes_run_beside_the_command(tmp_path):
    """While CMD runs, the busy processes are alive (CMD checks them through the pids printed)."""
    probe = tmp_path / "probe.sh"
    probe.write_text('for p in $(sed -n "s/.*(pids \\(.*\\))$/\\1/p" "$1"); do kill -0 "$p" || exit 7; done\n')
    out = tmp_path / "out"
    with open(out, "w") as f:
        rc = subprocess.run(["bash", str(SCRIPT), "-n", "2", "-k", "2", "--", "bash", str(probe), str(out)],
                            stdout=f, stderr=subprocess.STDOUT, timeout=60).returncode
    text = out.read_text()
    assert rc == 0 and "2 runs, 2 passed, 0 failed (2 busy processes)" in text, text


def test_arguments_reach_the_command_verbatim(tmp_path, monkeypatch):
    """CMD's words are "$@": no shell sees them (no INJECTED file, no glob, spaces kept)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "args"
    code = "import sys; open(sys.argv[1], 'w').write('|'.join(sys.argv[2:]))"
    words = ["$(touch INJECTED)", "`touch INJECTED`", "*", "a b", "; touch INJECTED", ""]
    p = under_load("-n", "1", "-k", "0", "--", sys.executable, "-c", code, str(out), *words)
    assert p.returncode == 0, p.stdout + p.stderr
    assert out.read_text() == "|".join(words)
    assert not (tmp_path / "INJECTED").exists()


@pytest.mark.parametrize("args,words", [
    (["-n", "0", "--", "true"], "-n '0'"),
    (["-n", "abc", "--", "true"], "-n 'abc'"),
    (["-n", "a[$(touch INJECTED)]", "--", "true"], "is not a number of runs"),   # never reaches arithmetic
    (["-k", "-1", "--", "true"], "-k '-1'"),
    (["-k", "999", "--", "true"], "-k '999'"),
    (["-n", "2"], "no command"),
    (["-x", "--", "true"], "unknown option -x"),
    (["-n"], "-n needs a value"),
])
def test_usage_errors(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    p = under_load(*args)
    assert p.returncode == 2 and words in p.stderr and "usage:" in p.stderr, p.stderr
    assert not (tmp_path / "INJECTED").exists() and not p.stdout


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_interrupted_kills_the_busy_processes_and_the_command(tmp_path, sig, code):
    marker = tmp_path / "started"        # holds the command's pid once it runs
    proc = subprocess.Popen(["bash", str(SCRIPT), "-n", "5", "-k", "2", "--", "sh", "-c",
                             'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec sleep 30', str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a pytest-xdist worker ignores SIGINT, and a shell
                            # started with a signal ignored cannot trap it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 20
        while not marker.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the command never started"
            time.sleep(0.02)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, out + err
    assert f"stopped by SIG{sig.name[3:]}" in err
    pids = busy_pids(out)
    assert len(pids) == 2 and gone(pids), pids
    assert gone([int(marker.read_text())]), "the command is still running"
