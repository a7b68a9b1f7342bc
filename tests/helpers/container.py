"""The CI image for the container tests (scripts/build-ci-image.sh) and the binds that bring the
checkout's venv into it; shared by test_container_devcluster.py and test_container_local.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = Path(os.environ.get("HPCRING_CI_IMAGE", "/var/cache/hpcring-ci-image"))
SHARED = Path("/srv/hpcring")


def interpreter_prefix() -> Path | None:
    """Where the venv's interpreter lives, if the image lacks it (None: Debian's, in the image too)."""
    return None if os.path.realpath(sys.executable).startswith("/usr/bin/") else Path(sys.base_prefix)


def mounts(*more: str) -> list[str]:
    """The checkout (its .venv and editable install), the shared folder, the interpreter's prefix."""
    out = [str(ROOT), str(SHARED), *more]
    prefix = interpreter_prefix()
    if prefix is not None:
        out.append(str(prefix))
    return out


def ci_image(*more_mounts: str) -> Path:
    """The built image (built now when absent or of an older recipe) with mount points for
    :func:`mounts`; skips with the reason when it cannot be had."""
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
    for path in mounts(*more_mounts):
        (IMAGE / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return IMAGE
