"""Plain `hpcring run` on this machine (no PMIx launcher): the rendezvous goes through the store."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import numpy as np
import hpcring.session as hs
s = hs.init(backend="ring", timeout=60)
c = s.communicator("ring")
x = c.allreduce(np.full(5, c.rank + 1, dtype=np.int64))
print(f"LOCALPMIX rank={c.rank} rendezvous={s.topology.sources.get('rendezvous')} "
      f"ok={int((x == c.size * (c.size + 1) // 2).all())}", flush=True)
"""


def test_hpcring_run_without_pmix_meets_through_the_store(tmp_path):
    script = tmp_path / "pmix_fallback_local.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMIX_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), HPCRING_RENDEZVOUS="auto", HPCRING_JOB_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "hpcring", "run", "--nodes", "1", "--tasks-per-node", "2",
                        "--", sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=240, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    rows = sorted(x[x.index("LOCALPMIX"):] for x in p.stdout.splitlines() if "LOCALPMIX" in x)
    assert rows == [f"LOCALPMIX rank={r} rendezvous=store ok=1" for r in (0, 1)], out[-4000:]
