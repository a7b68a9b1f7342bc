#!/usr/bin/env bash
# Create .venv and install hpcring into it (editable), compiling the native core.
# Works on a fresh Debian 12 machine: installs python3-venv and a C compiler first if missing.
# Usage: bash scripts/install.sh            (extras via EXTRAS=test,mpi)
set -euo pipefail
exec </dev/null
cd "$(dirname "$0")/.."

need_apt=()
python3 -c 'import ensurepip, venv' 2>/dev/null || need_apt+=(python3-venv)
command -v gcc >/dev/null || need_apt+=(gcc)
python3 - <<'PY' 2>/dev/null || need_apt+=(python3-dev)
import sysconfig, os, sys
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PY
if [[ ${#need_apt[@]} -gt 0 ]]; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "install.sh: needs Debian packages ${need_apt[*]}; run: sudo apt-get install ${need_apt[*]}" >&2
        exit 1
    fi
    echo "install.sh: installing ${need_apt[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get -y -q -o DPkg::Lock::Timeout=300 update
    DEBIAN_FRONTEND=noninteractive apt-get -y -q -o DPkg::Lock::Timeout=300 install "${need_apt[@]}"
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
spec="."
[[ -n "${EXTRAS:-}" ]] && spec=".[${EXTRAS}]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
# Optional at run time: without libpmix hpcring meets through its own store (HPCRING_RENDEZVOUS=auto).
if ! ldconfig -p 2>/dev/null | grep -q 'libpmix\.so\.2'; then
    echo "install.sh: note: libpmix.so.2 not found; to take the rendezvous from PMIx (srun --mpi=pmix, jsrun):" \
         "apt-get install libpmix2"
fi
echo "install.sh: hpcring installed in $(pwd)/.venv (run .venv/bin/hpcring --help)"
