"""DDP on the ``hpcring`` torch.distributed backend across the 3 dev-cluster nodes (hpcring submit)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]



def test_ddp_on_hpcring_across_3_nodes_matches_gloo(tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_STATE_DIR=str(tmp_path / "state"))
    r = subprocess.run([sys.executable, "-m", "hpcring", "submit", str(ROOT / "tests" / "workers" / "torch_worker.py"), "ddp",
                        "--site", "devcluster", "--nodes", "3", "--tasks-per-node", "1", "--wait"],
                       capture_output=True, text=True, timeout=400, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    ok = [line for line in r.stdout.splitlines() if "ddp OK on 3 ranks" in line]
    assert len(ok) == 3, r.stdout[-3000:]
    # submit registered the backend before the script ran (the script imports nothing from hpcring)
    assert all(line.endswith("registered before the script: True") for line in ok), ok
