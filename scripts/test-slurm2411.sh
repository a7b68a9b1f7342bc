#!/usr/bin/env bash
# The dev cluster's tests against Slurm 24.11, in its own world beside the 22.05 cluster (which
# this leaves alone). The first run builds the Debian trixie tree (about 1.5 min); later ones reuse it.
# Usage: bash scripts/test-slurm2411.sh [pytest args...]     (default: tests/devcluster)
#   HPCRING_KEEP_DEVCLUSTER=0  take the 24.11 cluster and its world down afterwards
set -euo pipefail
exec </dev/null
cd "$(dirname "$0")/.."
start=$(date +%s)
.venv/bin/hpcring devcluster up --slurm 24.11 --share "$PWD"
echo "test-slurm2411.sh: devcluster up --slurm 24.11 took $(( $(date +%s) - start )) s"
[[ $# -gt 0 ]] || set -- tests/devcluster
rc=0
t0=$(date +%s)
# Inside the world: its srun/sbatch/sacct are 24.11's, node1..nodeN its nodes; the variable
# HPCRING_DEVCLUSTER_SLURM=24.11 is set for the tests.
.venv/bin/hpcring devcluster login --slurm 24.11 -- .venv/bin/python -m pytest -q -p no:cacheprovider \
    --durations=30 --basetemp=/srv/hpcring/pytest-tmp-2411 "$@" || rc=$?
echo "test-slurm2411.sh: tests on Slurm 24.11 $(( $(date +%s) - t0 )) s, exit $rc"
if [[ "${HPCRING_KEEP_DEVCLUSTER:-1}" == "0" ]]; then
    .venv/bin/hpcring devcluster down --slurm 24.11 || rc=1
fi
echo "test-slurm2411.sh: total $(( $(date +%s) - start )) s, pytest exit $rc"
exit $rc
