#!/usr/bin/env bash
# Everything, from a fresh Debian 12 machine as root: system packages (Slurm, MariaDB, munge,
# Open MPI), the venv with test extras, the real dev cluster, then the whole test suite.
# Usage: bash scripts/test.sh [pytest args...]
#   HPCRING_KEEP_DEVCLUSTER=0  bring the dev cluster down afterwards (CI does)
set -euo pipefail
exec </dev/null
cd "$(dirname "$0")/.."
start=$(date +%s)

bash scripts/install-system-deps.sh
EXTRAS=test,mpi,cuda12 bash scripts/install.sh
# CPU torch for the torch.distributed (gloo, env://) tests; this machine kind ships its wheel.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
# Lightning (6 s, <1 MB plus small deps) for the Trainer(strategy=DDPStrategy("hpcring")) test.
.venv/bin/python -m pip install -q --disable-pip-version-check lightning==2.6.6

# The Debian image the container test runs ranks in (about 1 min; cached in /var/cache, so free
# on a rerun).
bash scripts/build-ci-image.sh || echo "test.sh: the CI image did not build; the container test retries and says why"

t0=$(date +%s)
.venv/bin/hpcring devcluster up --share "$PWD"
echo "test.sh: devcluster up took $(( $(date +%s) - t0 )) s"

rc=0
# Test files that ranks read must be visible on every node: /tmp is node-private there.
tmp=/srv/hpcring/pytest-tmp
pytest=(.venv/bin/python -u -m pytest -q -p no:cacheprovider --durations=30)   # -u: tier lines stream
if [[ $# -gt 0 ]]; then
    "${pytest[@]}" --basetemp="$tmp" "$@" || rc=$?
else
    # the three tiers side by side, each bounded (scripts/run-tiers.sh)
    bash scripts/run-tiers.sh "$tmp" unit integration devcluster || rc=$?
fi

if [[ "${HPCRING_KEEP_DEVCLUSTER:-1}" == "0" ]]; then
    .venv/bin/hpcring devcluster down || rc=1
fi
echo "test.sh: total $(( $(date +%s) - start )) s, pytest exit $rc"
exit $rc
