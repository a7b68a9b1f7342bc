#!/usr/bin/env bash
# Fill .whl/ with the wheels the GPU test machine lacks (it has no network; see
# ../shared/notes/gpu-machine.md): submitit, pydantic with the exact pydantic-core its metadata
# names, and their small dependencies, for CPython 3.12 on manylinux x86-64. Run here (PyPI);
# .whl/ is git-ignored, so pass it to the device as carried: run(carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
get() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
# the versions installed here, so both machines run the same code
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in submitit pydantic annotated-types typing-inspection typing-extensions cloudpickle py-spy; do
    get "$pkg==$(ver "$pkg")"
done
core=$("$PY" -c "import importlib.metadata as m; print([r for r in m.requires('pydantic') if r.startswith('pydantic-core')][0].split('==')[1].split(';')[0].strip())")
get "pydantic-core==$core"
ls -1 .whl
