#!/usr/bin/env bash
# Install the Debian packages the hpcring dev cluster (`hpcring devcluster up`) and its tests need.
#
# Idempotent: packages already installed are left as they are. Safe without a terminal or stdin
# (noninteractive frontend, stdin from /dev/null). Daemons are NOT started by the packages (we set a
# policy-rc.d for the duration of the install when none exists); `hpcring devcluster up` starts its
# own copies with its own configs.
#
# Usage: sudo scripts/install-system-deps.sh
set -euo pipefail
exec </dev/null

PACKAGES=(
    slurm-wlm        # slurmctld, slurmd, srun, sbatch, sinfo, scontrol
    slurmdbd         # accounting daemon (so that sacct works)
    munge            # authentication between Slurm daemons
    mariadb-server   # storage for slurmdbd
    openmpi-bin      # mpirun, Open MPI built with PMIx (srun --mpi=pmix)
    libopenmpi-dev   # headers for mpi4py and native code
    libpmix2         # PMIx client library: HPCRING_RENDEZVOUS=pmix/auto under srun --mpi=pmix (ctypes)
    libpmix-dev      # pmix_common.h: tests/unit/test_pmix.py checks the ctypes layouts against it
    iperf3           # raw TCP throughput between nodes
    iproute2         # ip netns, veth, bridge, tc
    procps           # ps, pkill for diagnostics
    python3-venv     # virtual environments for tests
    util-linux       # nsenter, unshare, mount
    openssh-server   # sshd as a login node for the submit-from-a-laptop test (not started by the package)
    openssh-client   # ssh: submit --remote and its ControlMaster
    rsync            # submit --remote copies the script's folder with it
    charliecloud-runtime  # ch-run: ranks inside an image (tests/devcluster/test_container_devcluster.py)
    debootstrap      # builds that image (scripts/build-ci-image.sh)
    chromium         # headless browser: `hpcring report --html` pages load and show every rank (tests/integration/test_report_local.py)
)

if [[ $(id -u) -ne 0 ]]; then
    echo "install-system-deps.sh: must run as root (apt-get install needs it); try: sudo $0" >&2
    exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install-system-deps.sh: all ${#PACKAGES[@]} packages already installed"
    exit 0
fi
echo "install-system-deps.sh: installing ${missing[*]}"

export DEBIAN_FRONTEND=noninteractive
# Keep package postinst scripts from starting system copies of munge/mariadb/slurm daemons.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    created_policy=1
fi
cleanup() { if [[ $created_policy -eq 1 ]]; then rm -f "$policy"; fi; }
trap cleanup EXIT

# Wait (bounded) for another apt/dpkg run to finish instead of failing on the lock.
apt_opts=(-y -q -o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
apt-get "${apt_opts[@]}" update
apt-get "${apt_opts[@]}" install "${missing[@]}"
echo "install-system-deps.sh: done"
