"""The node-local checks in a child process: ``python -m hpcring.preflight.local --gpus N``.

Importing torch (seconds of CPU with the GIL held) and talking to GPUs run here, not in a thread
of the task: the task's probe listener and probes keep the interpreter to themselves (a thread
importing torch starved them into timeouts on a busy node), and a child stuck in a CUDA call can be
killed at the deadline. Prints one line, ``MARKER`` + JSON ``{"versions": ..., "gpu": ...}``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from hpcring.preflight import checks

MARKER = "hpcring-preflight-local "


def run_local_checks(gpus: int, timeout: float) -> dict:
    """``{"versions", "gpu"}`` from the child, or ``{"error"}`` (it failed, or did not finish within
    ``timeout`` seconds and was killed). Never raises."""
    if timeout <= 0:
        return {"error": "no time left for the version/GPU checks"}
    try:
        p = subprocess.Popen([sys.executable, "-m", "hpcring.preflight.local", "--gpus", str(gpus)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    except OSError as e:
        return {"error": f"cannot start the version/GPU checks: {e.strerror or e}"}
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        try:    # bounded too: a child of the check (nvidia-smi, say) may still hold its pipes
            p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return {"error": f"the version/GPU checks did not finish within {timeout:.0f} s (killed)"}
    for line in reversed(out.splitlines()):
        if line.startswith(MARKER):
            try:
                data = json.loads(line[len(MARKER):])
            except ValueError:
                break
            if isinstance(data, dict):
                data["seconds"] = round(time.monotonic() - t0, 3)
                return data
    tail = (err.strip().splitlines() or ["no output"])[-1][:200]
    return {"error": f"the version/GPU checks failed (exit {p.returncode}): {tail}"}


def main() -> int:
    gpus = int(sys.argv[sys.argv.index("--gpus") + 1]) if "--gpus" in sys.argv else 0
    vers, torch = checks.versions(gpus)
    out = {"versions": vers, "gpu": checks.gpu_check(gpus, torch) if gpus > 0 else None}
    print(MARKER + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
