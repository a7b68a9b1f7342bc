#!/usr/bin/env bash
# Run a command N times with K busy processes beside it, to shake out tests that pass only on an
# idle machine (timeouts, ordering, a rank that is slow to start). Each run's exit status and
# duration, then one tally line; exit 0 only if every run passed.
#
# Usage: bash scripts/under-load.sh [-n RUNS] [-k BUSY] -- CMD [ARGS...]
#   -n RUNS   how many times to run CMD, one after another (default 10)
#   -k BUSY   busy processes (an endless shell loop each, one core apiece) beside it (default 2)
# e.g.  bash scripts/under-load.sh -n 10 -k 2 -- .venv/bin/python -m pytest -q tests/integration/test_x.py
#
# CMD runs as given ("$@": never through eval or another shell), with this script's stdin. The busy
# processes are killed however the script ends (EXIT, INT, TERM); INT or TERM also stops the
# running CMD (SIGTERM) and ends the script with 130 or 143. Exit codes: 0 every run passed, 1 a
# run failed, 2 usage.
set -uo pipefail

usage() {   # $1: the exit code
    echo "usage: bash scripts/under-load.sh [-n RUNS] [-k BUSY] -- CMD [ARGS...]" >&2
    echo "  -n RUNS  runs of CMD (default 10); -k BUSY  busy processes beside it (default 2)" >&2
    exit "$1"
}

die() {
    echo "under-load: $1" >&2
    usage 2
}

runs=10
busy=2
while getopts ":n:k:h" opt; do
    case "$opt" in
        n) runs=$OPTARG ;;
        k) busy=$OPTARG ;;
        h) usage 0 ;;
        :) die "-$OPTARG needs a value" ;;
        *) die "unknown option -$OPTARG" ;;
    esac
done
shift $((OPTIND - 1))

# Checked as text before any arithmetic: bash arithmetic would evaluate an expression such as
# 'a[$(cmd)]' given as a count.
[[ "$runs" =~ ^[0-9]{1,5}$ ]] && ((10#$runs >= 1)) || die "-n '$runs' is not a number of runs from 1 to 99999"
[[ "$busy" =~ ^[0-9]{1,3}$ ]] && ((10#$busy <= 256)) || die "-k '$busy' is not a number of busy processes from 0 to 256"
runs=$((10#$runs))
busy=$((10#$busy))
(($# > 0)) || die "no command to run (give it after --)"

busy_pids=()
cmd_pid=""

stop_busy() {
    if ((${#busy_pids[@]})); then
        kill -TERM "${busy_pids[@]}" 2>/dev/null
        wait "${busy_pids[@]}" 2>/dev/null
        busy_pids=()
    fi
}

interrupted() {   # $1: the signal, $2: the exit code
    # The command is whichever background job is not a busy process: a signal that comes between
    # the command's start and `cmd_pid=$!` (a loaded machine) must end it too.
    local pid others=()
    for pid in $(jobs -p); do
        [[ " ${busy_pids[*]} " == *" $pid "* ]] || others+=("$pid")
    done
    if ((${#others[@]})); then
        kill -TERM "${others[@]}" 2>/dev/null
        wait "${others[@]}" 2>/dev/null
    fi
    stop_busy
    echo "under-load: stopped by SIG$1 (busy processes killed)" >&2
    exit "$2"
}

trap stop_busy EXIT
trap 'interrupted INT 130' INT
trap 'interrupted TERM 143' TERM

now_us() {   # microseconds since the epoch ($EPOCHREALTIME: bash 5; its separator follows the locale)
    if [[ -n "${EPOCHREALTIME:-}" ]]; then
        local t=${EPOCHREALTIME/[.,]/}
        echo $((10#$t))
    else
        echo $(($(date +%s) * 1000000))
    fi
}

for ((i = 0; i < busy; i++)); do
    sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &
    busy_pids+=("$!")
done
printf -v shown ' %q' "$@"      # for the eye only: CMD itself runs as "$@"
echo "under-load: $runs run(s) of:$shown"
echo "under-load: $busy busy process(es)${busy_pids[*]:+ (pids ${busy_pids[*]})}"

passed=0
failed=0
for ((run = 1; run <= runs; run++)); do
    start=$(now_us)
    # in the background and waited for, so that INT and TERM reach the traps at once
    "$@" <&0 &
    cmd_pid=$!
    wait "$cmd_pid"
    rc=$?
    cmd_pid=""
    took=$(($(now_us) - start))
    if ((rc == 0)); then
        passed=$((passed + 1))
        verdict=passed
    else
        failed=$((failed + 1))
        verdict=FAILED
    fi
    printf 'under-load: run %d/%d: exit %d, %d.%02d s, %s\n' "$run" "$runs" "$rc" \
        $((took / 1000000)) $((took % 1000000 / 10000)) "$verdict"
done

stop_busy
echo "under-load: $runs run$( ((runs == 1)) || echo s), $passed passed, $failed failed ($busy busy process$( ((busy == 1)) || echo es))"
((failed == 0))
