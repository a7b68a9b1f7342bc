#!/usr/bin/env bash
# The test tiers side by side, each bounded (scripts/test.sh runs unit, integration, devcluster).
# Usage: bash scripts/run-tiers.sh TMP NAME [NAME...]     run from the checkout
#   Runs pytest on $HPCRING_TESTS_DIR/NAME (default tests/NAME) for every NAME at once, each line
#   prefixed with [NAME], its basetemp TMP/NAME, its exit status in TMP.NAME.rc. Exit status: the
#   first failing tier's (in the order named), 0 if none failed.
#   HPCRING_TEST_WORKERS  > 1: the first tier on that many pytest-xdist workers (default 1)
#   HPCRING_TIER_DEADLINE seconds a tier may take (default 2700)
#
# Side by side: the dev cluster's jobs and ranks on this machine mostly wait (the scheduler,
# deadlines, sleeping ranks), the in-process tier mostly computes (one worker: one core); none
# uses another's resources (the local tiers never submit to the cluster). Each tier prints its own
# 30 slowest tests and its time. The first tier (unit) failing stops the others at once.
#
# A tier past its deadline (a tier takes 8-27 minutes here) shows what it is doing (its test's
# stack, the processes under it, for the dev cluster the queue and the nodes) and is stopped with
# SIGTERM, which tests/conftest.py turns into pytest's Ctrl-C (it names the test it was in and
# prints its summary); SIGKILL a minute later. CI's limit is never reached in silence. Each test
# has its own 15-minute ceiling too (pytest-timeout, pyproject.toml).
set -uo pipefail
exec </dev/null
tmp=$1
shift
tests=${HPCRING_TESTS_DIR:-tests}
deadline=${HPCRING_TIER_DEADLINE:-2700}
workers=${HPCRING_TEST_WORKERS:-1}
pytest=(.venv/bin/python -u -m pytest -q -p no:cacheprovider --durations=30)   # -u: tier lines stream
t0=$(date +%s)
mkdir -p "$tmp"
rm -f "$tmp".*.rc "$tmp".*.pid

overdue() {   # overdue NAME PID: past the deadline, say what the tier is doing, then stop it
    local name=$1 pid=$2 end=$(( $(date +%s) + deadline ))
    while kill -0 "$pid" 2>/dev/null; do
        if [[ $(date +%s) -ge $end ]]; then
            {
                echo "run-tiers.sh: the $name tier ran past ${deadline}s; what it is doing:"
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
            return 0
        fi
        sleep 2 >/dev/null 2>&1   # holds no pipe of the tier's once this watch is stopped
    done
}

tier() {   # tier NAME [pytest args]: run the tier, prefix its lines, write its exit status
    local r=0 name=$1 watch pid
    shift
    "${pytest[@]}" --basetemp="$tmp/$name" "$@" "$tests/$name" > >(sed -u "s/^/[$name] /") 2>&1 &
    pid=$!
    echo "$pid" > "$tmp.$name.pid"
    overdue "$name" "$pid" & watch=$!
    wait "$pid" || r=$?
    kill "$watch" 2>/dev/null || true
    echo "run-tiers.sh: $name tier $(( $(date +%s) - t0 )) s after the start, exit $r"
    echo "$r" > "$tmp.$name.rc"
}

first=$1
if [[ "$workers" -gt 1 ]]; then tier "$first" -n "$workers" & f=$!; else tier "$first" & f=$!; fi
others=()
for name in "${@:2}"; do
    tier "$name" & others+=($!)
done
wait "$f"
if [[ "$(cat "$tmp.$first.rc" 2>/dev/null || echo 1)" != 0 ]]; then
    # the first tier failed: stop the others early (their pytest ends; their jobs end with the
    # dev cluster or with this machine)
    echo "run-tiers.sh: the $first tier failed: stopping the others"
    for name in "${@:2}"; do
        kill -TERM "$(cat "$tmp.$name.pid" 2>/dev/null)" 2>/dev/null || true
    done
fi
[[ ${#others[@]} -eq 0 ]] || wait "${others[@]}"
rc=0
for name in "$@"; do      # the first failing tier's status
    r=$(cat "$tmp.$name.rc" 2>/dev/null || echo 1)
    [[ "$r" == 0 || "$rc" != 0 ]] || rc=$r
done
echo "run-tiers.sh: the tiers side by side $(( $(date +%s) - t0 )) s, exit $rc"
exit $rc
