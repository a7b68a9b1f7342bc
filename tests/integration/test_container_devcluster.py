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
WORKER = ROOT / "tests" / "container_worker.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
from helpers_jobs import cluster_up  # noqa: E402
from test_submit_devcluster import job_id_of  # noqa: E402

IMAGE = Path(os.environ.get("HPCRING_CI_IMAGE", "/var/cache/hpcring-ci-image"))
SHARED = Path("/srv/hpcring")
DEADLINE, GRACE = 8.0, 4.0

pytestmark = [pytest.mark.devcluster,
              pytest.mark.skipif(not cluster_up(), reason="dev cluster is not up (hpcring devcluster up)")]


def _interpreter_prefix() -> Path | None:
    """Where the venv's interpreter lives, if the image lacks it (None: Debian's, in the image too)."""
    real = Path(os.path.realpath(sys.executable))
    prefix = Path(sys.base_prefix)
    return None if str(real).startswith("/usr/bin/") else prefix


@pytest.fixture(scope="module")
def image() -> Path:
    if os.geteuid() != 0 and not (IMAGE / ".hpcring-image-ok").exists():
        pytest.skip(f"no CI image at {IMAGE} and building one (debootstrap) needs root: "
                    "run sudo bash scripts/build-ci-image.sh")
    if os.geteuid() == 0:   # a no-op when the cached image is of the current recipe
        r = subprocess.run(["bash", str(ROOT / "scripts" / "build-ci-image.sh"), str(IMAGE)],
                           capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, f"building the CI image failed:\n{r.stdout}\n{r.stderr}"
    if shutil.which("ch-run") is None:
        pytest.skip("ch-run is not installed (Debian package charliecloud-runtime; "
                    "scripts/build-ci-image.sh installs it)")
    # ch-run binds onto mount points that exist in the image (it is read-only to the ranks)
    for path in _mounts():
        (IMAGE / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return IMAGE


def _mounts() -> list[str]:
    out = [str(ROOT), str(SHARED)]
    prefix = _interpreter_prefix()
    if prefix is not None:
        out.append(str(prefix))
    return out


def _site(folder: Path, image: Path) -> Path:
    """The devcluster site with a Charliecloud container section."""
    text = (ROOT / "site_configs" / "devcluster.yaml").read_text().replace("name: devcluster", "name: devcluster-ch")
    text += ("container:\n  runtime: charliecloud\n"
             f"  image: {json.dumps(str(image))}\n"
             f"  mounts: {json.dumps(_mounts())}\n")
    path = folder / "devcluster-ch.yaml"
    path.write_text(text)
    return path


def _submit(image: Path, tag: str, *args: str, timeout: float = 300) -> dict:
    folder = SHARED / "pytest-containers" / f"{tag}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    site = _site(folder, image)
    # ch-run refuses to start without $USER (CI may run without one)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HPCRING_JOB_DIR=str(folder / "jobs"),
               HPCRING_STATE_DIR=str(folder / "state"), HPCRING_TIMEOUT=str(DEADLINE),
               HPCRING_DIAG_GRACE=str(GRACE), USER=pwd.getpwuid(os.getuid()).pw_name)
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
