"""Bootstrap inside real allocations on the dev cluster: salloc + hpcring run, mpirun, torch gloo.

The failure scenarios (an interface that routes nowhere, a rank that never starts) are in
test_faults_bootstrap_devcluster.py."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def topos(stdout: str) -> list[dict]:
    """Every `TOPO {...}` record, even when a launcher interleaves two ranks' lines (mpirun does)."""
    dec, out, i = json.JSONDecoder(), [], stdout.find("TOPO ")
    while i >= 0:
        obj, end = dec.raw_decode(stdout, i + len("TOPO "))
        out.append(obj)
        i = stdout.find("TOPO ", end)
    return out


def check_agreement(recs: list[dict], size: int, per_node: int) -> None:
    assert sorted(r["rank"] for r in recs) == list(range(size))
    hosts = recs[0]["hosts"]
    assert len(hosts) == size and sorted(set(hosts)) == [f"node{i}" for i in range(1, size // per_node + 1)]
    for r in recs:  # everyone agrees on the world
        assert r["hosts"] == hosts and r["master"] == recs[0]["master"] and r["size"] == size
        assert r["host"] == hosts[r["rank"]]
        assert r["interface"] == "eth0" and r["address"] == f"10.99.0.{r['host'][-1]}"
        assert r["local_size"] == per_node and 0 <= r["local_rank"] < per_node
    assert recs[0]["master"][0] == "10.99.0.1"   # rank 0's address on the verified interface


def test_salloc_hpcring_run(tmp_path):
    r = subprocess.run(["salloc", "-N", "3", "--ntasks-per-node=2", "--time=5", PY, "-m", "hpcring", "run",
                        "--site", "devcluster", "--tasks-per-node", "2", "--", PY, str(ROOT / "examples/whoami.py")],
                       capture_output=True, text=True, timeout=240, env=ENV, cwd="/srv/hpcring", stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = topos(r.stdout)
    check_agreement(recs, 6, 2)
    assert all(line.startswith("[") for line in r.stdout.splitlines())   # rank-tagged


@pytest.mark.parametrize("site_env", [{}, {"HPCRING_SITE": "local"}])
def test_salloc_hpcring_run_without_a_site(site_env):
    """No --site inside salloc: the cluster's name (SLURM_CLUSTER_NAME=devcluster) picks its site;
    the local site named explicitly gives way to srun and the automatic interface choice (its lo
    links no two nodes)."""
    r = subprocess.run(["salloc", "-N", "2", "--time=5", PY, "-m", "hpcring", "run", "--", PY,
                        str(ROOT / "examples/whoami.py")],
                       capture_output=True, text=True, timeout=240, env=dict(ENV, **site_env), cwd="/srv/hpcring",
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = topos(r.stdout)
    assert sorted(x["host"] for x in recs) == ["node1", "node2"]
    assert all(x["interface"] == "eth0" for x in recs), recs


def test_hpcring_run_names_first_failing_rank():
    r = subprocess.run(["salloc", "-N", "2", "--time=5", PY, "-m", "hpcring", "run", "--site", "devcluster",
                        "--", PY, "-c", "import os,sys,time; r=int(os.environ['RANK']); time.sleep(0.5*r); sys.exit(7 if r==1 else 0)"],
                       capture_output=True, text=True, timeout=240, env=ENV, cwd="/srv/hpcring", stdin=subprocess.DEVNULL)
    assert r.returncode == 7, r.stderr[-3000:]
    assert "rank 1 on node2" in r.stderr and "exited with code 7" in r.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_inside_allocation():
    env = dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_tcp_if_include="eth0", OMPI_MCA_oob_tcp_if_include="eth0", HPCRING_IFNAME="=eth0")
    secret = Path("/srv/hpcring") / f"mpirun-secret-{os.getpid()}"
    secret.write_text("ab" * 32)
    os.chmod(secret, 0o600)
    env["HPCRING_SECRET_FILE"] = str(secret)
    try:
        r = subprocess.run(["salloc", "-N", "3", "--ntasks-per-node=2", "--time=5", "mpirun", "--oversubscribe",
                            "-np", "6", "--map-by", "ppr:2:node", "-x", "PYTHONPATH", "-x", "HPCRING_SECRET_FILE",
                            "-x", "HPCRING_IFNAME", PY, str(ROOT / "examples/whoami.py")],
                           capture_output=True, text=True, timeout=240, env=env, cwd="/srv/hpcring",
                           stdin=subprocess.DEVNULL)
    finally:
        secret.unlink()
    assert r.returncode == 0, r.stderr[-3000:]
    recs = topos(r.stdout)
    check_agreement(recs, 6, 2)
    assert {x["launcher"] for x in recs} == {"openmpi"}


def test_torch_gloo_env_init_via_submit(tmp_path):
    pytest.importorskip("torch")
    env = dict(ENV, HPCRING_STATE_DIR=str(tmp_path / "state"))
    r = subprocess.run([PY, "-m", "hpcring", "submit", str(ROOT / "examples/torch_allreduce.py"), "--site", "devcluster",
                        "--nodes", "3", "--tasks-per-node", "1", "--wait"],
                       capture_output=True, text=True, timeout=400, env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    lines = [l for l in r.stdout.splitlines() if "TORCH " in l]
    assert len(lines) == 3 and all("ok=True" in l and "iface=eth0" in l and "master=10.99.0.1:" in l for l in lines)
