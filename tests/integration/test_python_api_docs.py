"""docs/python-api.md and examples/notebook.ipynb run as written on the local backend: the doc's
Python examples in order as one script, the notebook through a real Jupyter kernel (nbclient)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "python-api.md"
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A clean hpcring environment (own records and job folders) for what the examples start."""
    for k in list(os.environ):
        if k.startswith("HPCRING_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HPCRING_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HPCRING_JOB_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    work = tmp_path / "work"
    work.mkdir()
    return work


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_the_docs_table_is_current():
    from hpcring.config.jobopts import render_doc
    text = DOC.read_text()
    assert render_doc(text) == text, "regenerate it: python -m hpcring.config.jobopts docs/python-api.md"


def test_the_docs_examples_run_as_written(env):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 8
    script = env / "python_api_examples.py"
    script.write_text("\n\n".join(blocks) + "\nprint('ALL EXAMPLES RAN')\n")
    r = subprocess.run([sys.executable, str(script)], cwd=str(env), capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ALL EXAMPLES RAN"), r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "[(0, 21.0), (1, 21.0)]" in out
    assert "update_parameters(nodes=0): out of range" in out and "timeout_min is submitit's" in out
    assert "1 local0" in out and "ValueError: rank 1 is over the limit 1" in out
    assert "cannot send argument 0 (lock) to the ranks" in out and "nodes=20 exceeds partition 'cpu'" in out
    assert "cannot use the job folder /proc/no-such-folder" in out
    assert (env / "hpcring-jobs").is_dir() and not any(p.name.endswith(".pkl") for p in (env / "hpcring-jobs").iterdir())


def test_the_notebook_runs(env):
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(env)}}).execute()
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "COMPLETED [1.5, 1.5]" in text, text
    assert "[0]<stdout>:rank 0 of 2 on local0" in text and "[1]<stdout>:rank 1 of 2 on local0" in text
    assert "1 local0" in text and 'raise ValueError(f"rank {session.rank} refuses")' in text
    assert "[0, 1, 4, 9]" in text
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
