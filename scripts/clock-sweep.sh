#!/usr/bin/env bash
# The clock sweep: the tests whose outcome depends on the date, the weekday, the time of day or
# DST (marked `clock`) run once per fixed clock: each weekday of one week (Mon 29 Dec 2025 to
# Sun 4 Jan 2026, at times where New York's date and UTC's differ, or just past midnight, or at
# midday) and both America/New_York DST change days of 2026. One line per clock with its result
# and duration; exits non-zero naming each clock that failed (its log: .data/clock-sweep/).
#
# A clock is a fixed offset from the real time (computed when its run starts), so time goes on
# ticking: pytest, the Celery workers and beats it spawns, and a redis-server of the sweep's own
# (the Lua scripts read redis.call('TIME') and compare it with Python's time) all run with
# scripts/clock-shift.c preloaded (LD_PRELOAD, BACKLOT_CLOCK_OFFSET), which moves their wall
# clock and nothing else; that file says why it is not libfaketime. PostgreSQL keeps the real
# clock (the code takes every timestamp from Python): the sweep uses the running test
# PostgreSQL of DATABASE_URL (scripts/test.sh exports it), in a database of its own
# (backlot_clock, made afresh by the first clock). Everything started here is stopped by PID.
#
#   bash scripts/clock-sweep.sh                 every clock, pytest -m clock
#   CLOCKS="wed dst-fall" bash scripts/clock-sweep.sh tests/reports   some clocks, other tests
#
# Arguments replace the selection (-m clock over the files that use the mark). Redis listens on
# BACKLOT_CLOCK_REDIS_PORT (default: the test Redis port + 4, so 6394).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

# name|the instant (local time in America/New_York with its UTC offset)|why this one
ALL_CLOCKS=(
    "mon|2025-12-29 23:30 -0500|23:30 in New York, already Tuesday 04:30 in UTC"
    "tue|2025-12-30 19:30 -0500|00:30 UTC on Wednesday, still Tuesday evening in New York"
    "wed|2025-12-31 23:30 -0500|New Year's Eve in New York, 2026 already in UTC"
    "thu|2026-01-01 12:00 -0500|midday on New Year's Day"
    "fri|2026-01-02 00:30 -0500|just past midnight in New York (05:30 UTC)"
    "sat|2026-01-03 19:30 -0500|00:30 UTC on Sunday, still Saturday in New York"
    "sun|2026-01-04 12:00 -0500|midday on Sunday"
    "dst-spring|2026-03-08 01:30 -0500|30 min before New York springs forward (02:00 EST -> 03:00 EDT)"
    "dst-fall|2026-11-01 01:30 -0500|the second 01:30 in New York, 30 min after falling back"
)

DATA=.data/clock-sweep
SHIM_SRC=scripts/clock-shift.c
SHIM=$DATA/clock-shift.so
REDIS_PORT=${BACKLOT_CLOCK_REDIS_PORT:-$((${BACKLOT_TEST_REDIS_PORT:-6390} + 4))}
REDIS_URL_CLOCK=redis://127.0.0.1:$REDIS_PORT/0

[[ -n ${DATABASE_URL:-} ]] || die "DATABASE_URL is not set: run the sweep from scripts/test.sh, or export the test PostgreSQL's URL"
# The same server and user, another database (Django's test database is test_backlot_clock).
CLOCK_DATABASE_URL=${DATABASE_URL%/*}/backlot_clock

redis_pid=""
stop_redis() {
    if [[ -n $redis_pid ]]; then
        kill -TERM "$redis_pid" 2>/dev/null || true
        if ! wait_pid_gone "$redis_pid" 20; then kill -KILL "$redis_pid" 2>/dev/null || true; fi
        wait "$redis_pid" 2>/dev/null || true
        redis_pid=""
    fi
}
trap stop_redis EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$DATA"
if ! command -v cc >/dev/null 2>&1; then apt_install gcc libc6-dev; fi
if ! command -v redis-server >/dev/null 2>&1; then apt_install redis-server; fi
if [[ ! -f $SHIM || $SHIM_SRC -nt $SHIM ]]; then
    cc -O2 -Wall -Wextra -Werror -shared -fPIC -o "$SHIM.tmp" "$SHIM_SRC" -ldl
    mv -f "$SHIM.tmp" "$SHIM"
fi
: >"$DATA/redis.log"
shim_path=$(realpath "$SHIM")
export PATH="$PWD/.venv/bin:$PATH"

if [[ $# -gt 0 ]]; then
    selection=("$@")
else
    # Only the files that use the mark: collecting the whole suite nine times would cost more
    # than some clocks' tests.
    mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.clock\b' tests | sort)
    [[ ${#files[@]} -gt 0 ]] || die "no test uses the clock mark"
    selection=(-m clock "${files[@]}")
fi

# run_at_clock WHEN LOG PYTEST_ARGS...: the sweep's Redis and pytest, both with the wall clock
# moved to WHEN (the offset is taken now; from then on the shifted clock ticks with the real one).
run_at_clock() {
    local when=$1 log_file=$2
    shift 2
    stop_redis
    local offset=$(($(date -d "$when" +%s) - $(date +%s)))
    local clock_env=(LD_PRELOAD="$shim_path" BACKLOT_CLOCK_OFFSET="$offset")
    env "${clock_env[@]}" redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" \
        --appendonly no --dir "$PWD/$DATA" --logfile "$PWD/$DATA/redis.log" --daemonize no &
    redis_pid=$!
    for _ in $(seq 50); do
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
        pid_alive "$redis_pid" || die "the sweep's redis-server exited; see $DATA/redis.log"
        sleep 0.1
    done
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 || die "the sweep's redis-server does not answer on :$REDIS_PORT"
    env "${clock_env[@]}" DATABASE_URL="$CLOCK_DATABASE_URL" REDIS_URL="$REDIS_URL_CLOCK" \
        .venv/bin/pytest -p no:cacheprovider -q "$@" >"$log_file" 2>&1
}

wanted=${CLOCKS:-}
failed=()
first=1
sweep_start=$SECONDS
for spec in "${ALL_CLOCKS[@]}"; do
    IFS='|' read -r name when why <<<"$spec"
    if [[ -n $wanted && " $wanted " != *" $name "* ]]; then continue; fi
    log_file=$DATA/$name.log
    if redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
        die "a Redis already answers on 127.0.0.1:$REDIS_PORT (BACKLOT_CLOCK_REDIS_PORT moves the sweep's)"
    fi

    db_args=(--reuse-db)
    if [[ $first -eq 1 ]]; then db_args+=(--create-db); fi
    first=0
    started=$SECONDS
    rc=0
    run_at_clock "$when" "$log_file" "${db_args[@]}" "${selection[@]}" || rc=$?
    rerun_note=""
    if [[ $rc -ne 0 ]]; then
        # A failed test runs once more from the same instant: a fault of the date fails again,
        # one of a loaded machine's timing (CI once lost one test of one clock, with no log
        # left to read) does not, and is reported by name either way.
        mapfile -t failed_ids < <(sed -nE 's/^(FAILED|ERROR) ([^ ]+).*/\2/p' "$log_file" | sort -u)
        if [[ ${#failed_ids[@]} -gt 0 ]]; then
            cp "$log_file" "$DATA/$name.first.log"
            rc=0
            run_at_clock "$when" "$log_file" --reuse-db "${failed_ids[@]}" || rc=$?
            rerun_note=" (failed once, passed from the same instant again: ${failed_ids[*]}; first log: $DATA/$name.first.log)"
        fi
    fi
    stop_redis
    took=$((SECONDS - started))
    summary=$(grep -E ' in [0-9.]+s' "$log_file" | tail -n 1 | sed -E 's/^=+ | =+$//g' || true)
    local_time=$(TZ=America/New_York date -d "$when" '+%a %Y-%m-%d %H:%M %Z')
    utc_time=$(TZ=UTC date -d "$when" '+%a %H:%M UTC')
    if [[ $rc -eq 0 ]]; then
        printf '[clock] %-10s %s = %s  ok      %3ds  %s%s\n' "$name" "$local_time" "$utc_time" "$took" "$summary" "$rerun_note"
        if [[ -n $rerun_note ]]; then
            sed -n '/= FAILURES =\|= ERRORS =/,$p' "$DATA/$name.first.log" | tail -n 60 | sed 's/^/[clock]     first run: /' || true
        fi
    else
        printf '[clock] %-10s %s = %s  FAILED  %3ds  %s (%s)\n' "$name" "$local_time" "$utc_time" "$took" "${summary:-exit $rc}" "$why"
        # The log stays on the machine; CI's output is all a later session reads.
        sed -n '/= FAILURES =\|= ERRORS =/,$p' "$log_file" | tail -n 120 | sed 's/^/[clock]     /' || true
        failed+=("$name")
    fi
done

log "clock sweep: $((SECONDS - sweep_start)) s"
if [[ ${#failed[@]} -gt 0 ]]; then
    die "the tests failed under the clock(s): ${failed[*]} (logs: $DATA/<clock>.log)"
fi
