"""templates/ and site_configs/ ship inside the wheel: build it, install it in a fresh venv, render."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_renders_from_installed_package(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = wheels.glob("hpcring-*.whl")
    import zipfile
    names = zipfile.ZipFile(whl).namelist()
    assert "hpcring/templates/slurm.sh.j2" in names and "hpcring/templates/partials/env.sh.j2" in names
    assert "hpcring/site_configs/devcluster.yaml" in names
    assert "hpcring/rank_site/sitecustomize.py" in names      # hpcring run's rank hooks in CMD's Python
    # the Hydra launcher, in the namespace package every Hydra plugin shares (which it must not own)
    assert "hydra_plugins/hpcring_launcher/hpcring_launcher.py" in names and "hydra_plugins/__init__.py" not in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(whl)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HPCRING_SITE_DIRS")}
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "train.py").write_text("print('hi')\n")     # render refuses a script that does not exist
    r = subprocess.run([str(venv / "bin" / "hpcring"), "render", "train.py", "--site", "devcluster", "--nodes", "3"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=3" in r.stdout and "--mpi=pmix" in r.stdout
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "from hpcring.resources import templates_dir; print(templates_dir())"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=60)
    assert str(venv) in r.stdout, r.stdout + r.stderr
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "hpcring", "sites", "list"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=60)
    assert r.returncode == 0 and "lsf-summit" in r.stdout
