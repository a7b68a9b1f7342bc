"""Every rank of a 3-node job inside a container image on the real dev cluster (Charliecloud's
ch-run: unprivileged, no daemon, an unpacked directory image).

The image is the CI image of scripts/build-ci-image.sh (debootstrap minbase bookworm + python3 +
numpy), cached outside the checkout (HPCRING_CI_IMAGE, default /var/cache/hpcring-ci-image) and
built here when absent (about a minute). hpcring reaches the image as a bind-mounted venv: the
checkout (which holds .venv and the editable install) and, when the venv's interpreter is not
Debian's /usr/bin/python3 (which the image has too), the interpreter's prefix, each at its own
path (docs/containers.md). pyxis, Apptainer and podman are covered by golden scripts and argv tests
(tests/unit/test_containers.py): they cannot run here.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "container_worker.py"
from helpers.container import SHARED, ci_image, mounts  # noqa: E402
from helpers.jobs import job_id_of  # noqa: E402

DEADLINE, GRACE = 8.0, 4.0



@pytest.fixture(scope="module")
def image() -> Path:
    return ci_image()


def _site(folder: Path, image: Path, base: str = "devcluster") -> Path:
    """The devcluster site (or its LSF emulation's) with a Charliecloud container section."""
    text = (ROOT / "site_configs" / f"{base}.yaml").read_text().replace(f"name: {base}", f"name: {base}-ch")
    text += ("container:\n  runtime: charliecloud\n"
             f"  image: {json.dumps(str(image))}\n"
             f"  mounts: {json.dumps(mounts())}\n")
    path = folder / f"{base}-ch.yaml"
    path.write_text(text)
    return path


def _submit(image: Path, tag: str, *args: str, timeout: float = 300, base: str = "devcluster",
            extra_env: dict | None = None) -> dict:
    folder = SHARED / "pytest-containers" / f"{tag}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    site = _site(folder, image, base)
    # ch-run refuses to start without $USER (CI may run without one)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_JOB_DIR=str(folder / "jobs"),
               HPCRING_STATE_DIR=str(folder / "state"), HPCRING_TIMEOUT=str(DEADLINE),
               HPCRING_DIAG_GRACE=str(GRACE), USER=pwd.getpwuid(os.getuid()).pw_name, **(extra_env or {}))
    cmd = [sys.executable, "-m", "hpcring", "submit", str(WORKER), "--site", str(site), "--nodes", "3",
           "--tasks-per-node", "1", "--time", "5", "--wait", "--", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=timeout,
                       stdin=subprocess.DEVNULL)
    job = job_id_of(r)
    ranks = [json.loads(line.split("CONTAINER_RANK ", 1)[1]) for line in r.stdout.splitlines()
             if "<stdout>:CONTAINER_RANK " in line]
    return {"r": r, "job": job, "ranks": sorted(ranks, key=lambda d: d["rank"]), "folder": folder,
            "script": next((folder / "jobs" / job).glob("*_submission.sh"), None)}


def test_three_nodes_inside_the_image_exact_collectives(image):
    res = _submit(image, "exact")
    r = res["r"]
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    script = res["script"].read_text() if res["script"] else ""
    assert "ch-run -b" in script and str(image) in script, script      # the job script used the runtime
    ranks = res["ranks"]
    assert [d["rank"] for d in ranks] == [0, 1, 2], out[-4000:]
    assert {d["host"] for d in ranks} == {"node1", "node2", "node3"}, ranks
    for d in ranks:
        assert d["in_image"], d                       # the image's marker file: not the host
        assert d["exact"] and d["allgather"] == [0, 1, 2], d
        assert d["secret_ok"] and d["secret_file"].startswith(str(res["folder"])), d
        assert d["nccl_ifname"] == "=eth0" and d["gloo_ifname"] == "eth0", d   # the fabric's env
        assert d["slurm_procid"] == str(d["rank"]), d
        assert d["submitit_folder"] and Path(d["submitit_folder"].replace("%j", res["job"])).is_dir(), d


def test_a_frozen_rank_inside_the_image_is_named(image):
    res = _submit(image, "frozen", "--freeze", "1")
    r = res["r"]
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert all(d["in_image"] for d in res["ranks"]) and len(res["ranks"]) == 3, out[-4000:]
    report = json.loads((res["folder"] / "jobs" / res["job"] / "diag" / "hang-report.json").read_text())
    assert "rank 1 (node2) unreachable" in report["headline"], report["headline"]
    assert "collective failure:" in out and "rank 1 (node2)" in out, out[-4000:]


def test_hpcring_run_in_an_allocation_starts_every_rank_in_the_image(image):
    folder = SHARED / "pytest-containers" / f"run-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    site = _site(folder, image)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), USER=pwd.getpwuid(os.getuid()).pw_name)
    r = subprocess.run(["salloc", "-N", "3", "--time=5", sys.executable, "-m", "hpcring", "run", "--site", str(site),
                        "--", sys.executable, str(WORKER)], capture_output=True, text=True, env=env,
                       cwd=str(ROOT), timeout=300, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    ranks = sorted((json.loads(line.split("CONTAINER_RANK ", 1)[1]) for line in r.stdout.splitlines()
                    if "<stdout>:CONTAINER_RANK " in line), key=lambda d: d["rank"])
    assert [d["rank"] for d in ranks] == [0, 1, 2], out[-4000:]
    assert {d["host"] for d in ranks} == {"node1", "node2", "node3"}, ranks
    for d in ranks:
        assert d["in_image"] and d["exact"] and d["secret_ok"], d
        assert d["cwd"] == str(ROOT) and d["nccl_ifname"] == "=eth0", d      # hpcring run starts where it was


def test_lsf_emulation_blaunch_starts_every_rank_in_the_image(image):
    """LSF differs: blaunch hands its words to a shell on each host, so the ch-run prefix is quoted
    once more (tests/lsf_emulation: bsub, blaunch over the dev cluster's nodes)."""
    emu = SHARED / f".lsf-emulation-containers-{os.getpid()}"
    emu.mkdir(parents=True, exist_ok=True)
    try:
        res = _submit(image, "lsf", base="devcluster-lsf", extra_env={
            "HPCRING_LSF_EMU_DIR": str(emu),
            "PATH": f"{ROOT / 'tests' / 'lsf_emulation' / 'bin'}:{os.environ['PATH']}"})
    finally:
        shutil.rmtree(emu, ignore_errors=True)
    r = res["r"]
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    ranks = res["ranks"]
    assert [d["rank"] for d in ranks] == [0, 1, 2], out[-4000:]
    assert {d["host"] for d in ranks} == {"node1", "node2", "node3"}, ranks
    for d in ranks:
        assert d["in_image"] and d["exact"] and d["secret_ok"] and d["nccl_ifname"] == "=eth0", d
