"""hpcring.preempted(comm) on this machine: a warning that reached one rank is agreed by every rank
at the same step (the scheduler paths: tests/devcluster/test_preemption_devcluster.py)."""
from __future__ import annotations

import os
import subprocess
import sys


def test_preempted_is_agreed_across_ranks(tmp_path):
    """One rank is warned: hpcring.preempted(comm) is True on every rank at the same step."""
    script = tmp_path / "agree.py"
    script.write_text(
        "import os, signal, numpy as np, hpcring\n"
        "from hpcring import preempt\n"
        "comm = hpcring.init().communicator('ring'); preempt.install()\n"
        "for step in range(10):\n"
        "    if comm.rank == 1 and step == 4: os.kill(os.getpid(), signal.SIGUSR2)\n"
        "    if hpcring.preempted(comm):\n"
        "        print(f'STOP rank={comm.rank} step={step} local={hpcring.preempted()}', flush=True); break\n"
        "    comm.allreduce(np.ones(4, np.float32))\n")
    r = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "3", "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, HPCRING_JOB_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    stops = sorted(line.split(":", 1)[1] for line in r.stdout.splitlines() if "STOP" in line)
    assert stops == ["STOP rank=0 step=4 local=False", "STOP rank=1 step=4 local=True",
                     "STOP rank=2 step=4 local=False"], r.stdout
