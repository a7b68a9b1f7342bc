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
    # The three tiers side by side: the dev cluster's jobs and ranks on this machine mostly wait
    # (the scheduler, deadlines, sleeping ranks), the in-process tier mostly computes (one worker:
    # one core); none uses another's resources (the local tiers never submit to the cluster).
    # Each line is prefixed with its tier; each tier prints its own 30 slowest tests and its time.
    # (HPCRING_TEST_WORKERS > 1: the unit tier on that many pytest-xdist workers.) A unit failure
    # stops the other two at once.
    t0=$(date +%s)
    mkdir -p "$tmp"
    rm -f "$tmp".*.rc
    # A tier past its deadline (HPCRING_TIER_DEADLINE s, default 45 min; a tier takes 8-27) shows
    # what it is doing (the test's stack, the processes under it, the cluster's queue) and is
    # stopped with SIGTERM, so pytest names the test it was in and prints its summary (conftest.py;
    # a minute later SIGKILL): CI's 90
    # minutes never end in silence. (Each test has its own 15-minute ceiling too: pyproject.toml.)
    deadline=${HPCRING_TIER_DEADLINE:-2700}
    overdue() {   # overdue NAME PID: after the deadline, say what the tier is doing, then stop it
        local name=$1 pid=$2 end=$(( $(date +%s) + deadline ))
        while kill -0 "$pid" 2>/dev/null; do
            if [[ $(date +%s) -ge $end ]]; then
                {
                    echo "test.sh: the $name tier ran past ${deadline}s; what it is doing:"
                    # the test's frames, without pytest's and pluggy's own
                    timeout 30 .venv/bin/py-spy dump --pid "$pid" 2>&1 \
                        | grep -v -e '^ *$' -e '(_pytest/' -e '(pluggy/' -e '(pytest/' -e '<frozen runpy>' | head -40
                    ps -o pid,etimes,stat,args --ppid "$pid" 2>/dev/null | cut -c1-160 | head -20
                    if [[ $name == devcluster ]]; then
                        timeout 20 squeue -o '%i %T %M %D %R %j' 2>&1 | head -15
                        timeout 20 sinfo -N -h -o '%N %T %E' 2>&1 | head -10
                    fi
                } | sed "s/^/[$name] /"
                kill -TERM "$pid" 2>/dev/null || true
                for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1 >/dev/null 2>&1; done
                kill -KILL "$pid" 2>/dev/null || true
                return
            fi
            sleep 5 >/dev/null 2>&1   # holds no pipe of the tier's once this watch is stopped
        done
    }
    tier() {   # tier NAME [pytest args]: run tests/NAME, prefix its lines, write its exit status to $tmp.NAME.rc
        local r=0 name=$1 watch
        shift
        "${pytest[@]}" --basetemp="$tmp/$name" "$@" "tests/$name" > >(sed -u "s/^/[$name] /") 2>&1 &
        echo "$!" > "$tmp.$name.pid"
        overdue "$name" "$!" & watch=$!
        wait "$(cat "$tmp.$name.pid")" || r=$?
        kill "$watch" 2>/dev/null || true
        echo "test.sh: $name tier $(( $(date +%s) - t0 )) s after the start, exit $r"
        echo "$r" > "$tmp.$name.rc"
    }
    workers=${HPCRING_TEST_WORKERS:-1}
    if [[ "$workers" -gt 1 ]]; then tier unit -n "$workers" & u=$!; else tier unit & u=$!; fi
    tier integration & a=$!
    tier devcluster & b=$!
    wait "$u" || true
    if [[ "$(cat "$tmp.unit.rc" 2>/dev/null || echo 1)" != 0 ]]; then
        # the unit tier failed: stop early, as a failing first tier would (the others' pytest ends;
        # their jobs end with the dev cluster below or with this machine)
        echo "test.sh: the unit tier failed: stopping the integration and devcluster tiers"
        kill -TERM "$(cat "$tmp.integration.pid")" "$(cat "$tmp.devcluster.pid")" 2>/dev/null || true
    fi
    wait "$a" "$b" || true
    for t in unit integration devcluster; do      # the first failing tier's status
        r=$(cat "$tmp.$t.rc" 2>/dev/null || echo 1)
        [[ "$r" == 0 || "$rc" != 0 ]] || rc=$r
    done
    echo "test.sh: the tiers side by side $(( $(date +%s) - t0 )) s, exit $rc"
fi

if [[ "${HPCRING_KEEP_DEVCLUSTER:-1}" == "0" ]]; then
    .venv/bin/hpcring devcluster down || rc=1
fi
echo "test.sh: total $(( $(date +%s) - start )) s, pytest exit $rc"
exit $rc
