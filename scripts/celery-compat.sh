#!/usr/bin/env bash
# `make test-celery-compat`: Celery's own integration suite against Backlot (docs/celery-compat.md).
# The sdist of the installed Celery is fetched once (pip download, cached in .data/celery-sdist),
# its t/integration extracted into .data/celery-compat/celery-<version>/ and run on real
# `celery -A config worker` processes of this project, twice: tasks declared with @job, and as
# the control with Celery's shared_task (tests/celery_compat/). Prints both counts and every test
# whose outcome differs, writes them to .data/celery-compat/result.json, and exits 1 when a test
# passes in the control and not under @job while docs/celery-compat.md does not list it.
#
#   scripts/celery-compat.sh [--reuse-services] [--half job|control|both] [--against-baseline]
#                            [--broker redis|amqp] [PYTEST_ARGS...]
#
# Each half runs each of Celery's files as a shard of its own (test_canvas.py as two, see
# CELERY_COMPAT_SPLIT), all at once (they mostly wait on
# results): one pytest, one worker and one Redis per shard (ports from 16390 up, under
# .data/celery-compat/redis-*; Celery's tests use fixed Redis keys and count a worker's replies,
# so shards cannot share one), and one PostgreSQL database for all: its own cluster (:29334,
# .data/pg-celery-compat), or with --reuse-services the server DATABASE_URL names (scripts/test.sh
# exports it), where it uses a database of its own, backlot_celery_compat. What it started, it
# stops. CELERY_COMPAT_PARALLEL=0 runs the shards one after another.
# --half job|control: run one half; the comparison then uses the other half's last outcomes in
# .data/celery-compat/ when there are some (their time is printed), else for @job alone the
# committed control baseline tests/celery_compat/control-<celery version>.json; with
# --against-baseline (make test-celery-compat-job, CI's half) always that baseline.
# A test that passes in the control, fails under @job and is not listed is run once more under
# @job on its own (up to CELERY_COMPAT_RERUN_MAX=10 of them): passing then, it is reported flaky.
# CELERY_COMPAT_TIMEOUT: seconds per test (default 60); CELERY_COMPAT_FILES: Celery's test files
# (default "test_tasks.py test_canvas.py test_inspect.py").
# --broker amqp (or CELERY_COMPAT_BROKER=amqp): RabbitMQ is the broker (BROKER_URL=amqp://...)
# while each shard's Redis keeps Backlot's limits and counters and Celery's tests' own keys: a
# private node of its own (:12672, .data/celery-compat/rabbitmq, started fresh and stopped at
# the end), one vhost per shard (Celery's pidbox replies and the default queue would be shared
# otherwise). Its outcomes go to .data/celery-compat/amqp/, its baseline is
# tests/celery_compat/control-amqp-<celery version>.json, and its known differences are the
# "Known differences on RabbitMQ" of docs/celery-compat.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

COMPAT_REDIS_PORT=16390
COMPAT_PG_DATA=.data/pg-celery-compat
COMPAT_PG_PORT=29334
COMPAT_DB=backlot_celery_compat
# The AMQP variant's node: 12672 keeps its distribution port (+20000: 32672) below Linux's
# ephemeral range, where a client connection's own port could hold it; epmd on 11372.
COMPAT_AMQP_PORT=12672
COMPAT_AMQP_DATA=.data/celery-compat/rabbitmq
COMPAT_AMQP_USER=backlot
# test_tasks.py on RabbitMQ as three shards run at once: the whole file took 3 min 42 s of tests
# in one (its longest, the stamped-header revokes of a complex canvas, 84-88 s in either half;
# test_retry 45 s, the two send_task tests 24 s each, all the rest 72 s).
COMPAT_AMQP_TASKS_SPLIT="test_tasks.py::test_tasks::test_revoked_by_headers_complex_canvas
test_tasks.py::test_tasks::test_retry,test_tasks::test_send_task_without_ignore_result_stores_result,test_tasks::test_send_task_without_ignore_result_uses_task_ignore_result"
OUT=.data/celery-compat
DOC=docs/celery-compat.md
ROOT=$PWD
PY=$ROOT/.venv/bin/python
[[ -x $PY ]] || die "no .venv: run make venv first"

reuse=0
baseline_only=0
halves=(job control)
broker=${CELERY_COMPAT_BROKER:-redis}
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --reuse-services) reuse=1; shift ;;
        --against-baseline) baseline_only=1; shift ;;
        --broker)
            [[ $# -ge 2 ]] || die "--broker needs redis or amqp"
            broker=$2
            shift 2 ;;
        --half)
            [[ $# -ge 2 ]] || die "--half needs job, control or both"
            case $2 in
                job) halves=(job) ;;
                control) halves=(control) ;;
                both) halves=(job control) ;;
                *) die "--half takes job, control or both, not '$2'" ;;
            esac
            shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
case $broker in
    redis) variant="" default_files="test_tasks.py test_canvas.py test_inspect.py" ;;
    amqp) variant=amqp- default_files=test_tasks.py OUT=$OUT/amqp COMPAT_DB=${COMPAT_DB}_amqp ;;
    *) die "--broker takes redis or amqp, not '$broker'" ;;
esac
read -r -a files <<<"${CELERY_COMPAT_FILES:-$default_files}"
[[ ${#files[@]} -gt 0 ]] || die "CELERY_COMPAT_FILES names no file"

redis_dirs=()   # the Redis servers we started (their data dirs), stopped on exit
started_pg=0
started_amqp=0
cleanup() {
    local rc=$? dir
    trap - EXIT INT TERM
    # Shards still running (an interrupt): end each one's pytest (the child of the shard's
    # subshell, by its parent's PID), which stops its worker, then the subshell.
    for pid in "${shard_pids[@]:-}"; do
        [[ -n $pid ]] || continue
        pkill -TERM -P "$pid" 2>/dev/null || true
        kill -TERM "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    for dir in "${redis_dirs[@]:-}"; do
        [[ -n $dir ]] && { bash scripts/services.sh redis-down "$dir" || true; }
    done
    if [[ $started_pg -eq 1 ]]; then bash scripts/services.sh postgres-down "$COMPAT_PG_DATA" || true; fi
    if [[ $started_amqp -eq 1 ]]; then bash scripts/services.sh rabbitmq-down "$COMPAT_AMQP_DATA" || true; fi
    exit "$rc"
}
shard_pids=()
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$OUT"
begin=$SECONDS

if [[ $reuse -eq 1 ]]; then
    [[ -n ${DATABASE_URL:-} ]] ||
        die "--reuse-services needs DATABASE_URL (the PostgreSQL scripts/test.sh started)"
    DATABASE_URL=$("$PY" -m tests.celery_compat.run dburl "$DATABASE_URL" "$COMPAT_DB")
else
    if ! bash scripts/services.sh postgres-status "$COMPAT_PG_DATA" >/dev/null 2>&1; then
        started_pg=1   # set first: an interrupted start is still cleaned up
    fi
    # 29334 lies below Linux's ephemeral port range (32768-60999), where a client connection's
    # own port can hold a server's for a while (scripts/bench.sh); a failed start is retried.
    for attempt in 1 2 3 4; do
        if bash scripts/services.sh postgres-up "$COMPAT_PG_DATA" "$COMPAT_PG_PORT"; then break; fi
        [[ $attempt -lt 4 ]] || die "PostgreSQL did not start on port $COMPAT_PG_PORT"
        log "retrying in 3 s"
        sleep 3
    done
    DATABASE_URL=postgres://backlot@127.0.0.1:$COMPAT_PG_PORT/$COMPAT_DB
fi
# The broker is each shard's Redis unless run_shard names a RabbitMQ vhost: a BROKER_URL of the
# caller's environment must not leak into the Redis variant (config/settings.py reads it).
export DATABASE_URL DJANGO_SETTINGS_MODULE=config.settings PYTHONUNBUFFERED=1 BROKER_URL=
export PATH="$ROOT/.venv/bin:$PATH"

# What shard N uses: redis_url N (its own Redis), broker_url N (a RabbitMQ vhost of its own, or
# empty: the broker is its Redis), database_url N (on RabbitMQ a database of its own, see below).
redis_url() { echo "redis://127.0.0.1:$((COMPAT_REDIS_PORT + $1))/0"; }
broker_url() {
    if [[ $broker == amqp ]]; then
        echo "amqp://$COMPAT_AMQP_USER:$COMPAT_AMQP_USER@127.0.0.1:$COMPAT_AMQP_PORT/compat-$1"
    fi
}
database_url() {
    if [[ $broker == amqp ]]; then echo "${DATABASE_URL}_$1"; else echo "$DATABASE_URL"; fi
}

# shard_up N: start (or reuse our own, left running) shard N's Redis and empty it; on RabbitMQ,
# give it a fresh copy of the migrated database. A Redis port that answers but is not ours is
# someone else's: refuse it rather than flush it.
shard_up() {
    local url dir=$OUT/redis-$1
    url=$(redis_url "$1")
    if ! bash scripts/services.sh redis-status "$dir" >/dev/null 2>&1 &&
        "$PY" -m tests.celery_compat.run ping "$url"; then
        die "a Redis not started by this script answers on ${url%/*}; stop it or free the port"
    fi
    redis_dirs+=("$dir")
    bash scripts/services.sh redis-up "$url" "$dir"
    "$PY" -m tests.celery_compat.run flushdb "$url"
    # On RabbitMQ each shard runs a relay (delays and retries wait in the ledger, and it
    # publishes them when due: tests/celery_compat/harness.py), and a relay publishes every due
    # row of its database to its own vhost: shards sharing a database would take each other's.
    if [[ $broker == amqp ]]; then
        "$PY" -m tests.celery_compat.run clonedb "$(database_url "$1")" "$COMPAT_DB" >&2
    fi
}

# amqp_up COUNT: a fresh private RabbitMQ node with vhosts compat-0 .. compat-(COUNT-1), each
# the user's. A node of ours left running (an interrupted run) is stopped first, so no queue
# keeps an earlier run's messages; a broker on the port that is not ours is refused.
amqp_up() {
    local count=$1 node epmd_port
    if bash scripts/services.sh rabbitmq-status "$COMPAT_AMQP_DATA" >/dev/null 2>&1; then
        bash scripts/services.sh rabbitmq-down "$COMPAT_AMQP_DATA"
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$COMPAT_AMQP_PORT") 2>/dev/null; then
        die "something not started by this script listens on :$COMPAT_AMQP_PORT; stop it or free the port"
    fi
    rm -rf "$COMPAT_AMQP_DATA/mnesia"
    started_amqp=1   # set first: an interrupted start is still cleaned up
    bash scripts/services.sh rabbitmq-up "$(broker_url 0)" "$COMPAT_AMQP_DATA"
    # One rabbitmqctl call for every vhost (each CLI call boots an Erlang VM, ~1.5 s here); the
    # import is asynchronous, so amqp-wait opens a connection to each vhost before going on.
    read -r node _ _ epmd_port <"$COMPAT_AMQP_DATA/node"
    "$PY" -m tests.celery_compat.run amqp-definitions "$COMPAT_AMQP_USER" "$count" >"$OUT/vhosts.json"
    HOME=$ROOT/$COMPAT_AMQP_DATA ERL_EPMD_PORT=$epmd_port \
        /usr/lib/rabbitmq/bin/rabbitmqctl -q -n "$node" import_definitions "$ROOT/$OUT/vhosts.json" >/dev/null
    local urls=() i
    for ((i = 0; i < count; i++)); do urls+=("$(broker_url "$i")"); done
    "$PY" -m tests.celery_compat.run amqp-wait "${urls[@]}"
}

log "database $COMPAT_DB at ${DATABASE_URL%/*}"
if [[ $broker == amqp ]]; then
    # Created empty on every run: the shards' copies must hold no job of an earlier run, which
    # their relays would publish again.
    "$PY" -m tests.celery_compat.run clonedb "$DATABASE_URL" template1
else
    "$PY" -m tests.celery_compat.run createdb "$DATABASE_URL"
fi
"$PY" manage.py migrate --noinput >"$OUT/migrate.log" 2>&1 || { cat "$OUT/migrate.log" >&2; die "migrate failed"; }
tree=$("$PY" -m tests.celery_compat.run prepare "$OUT")
log "Celery's suite in $tree: ${files[*]} (per-test timeout ${CELERY_COMPAT_TIMEOUT:-60} s)"

# run_shard NAME DECORATOR N [PYTEST_ARGS...]: one pytest of Celery's files on a worker of its
# own, with shard N's services (shard_up N first); outcomes-NAME.json, pytest-NAME.log,
# worker-NAME.log (relay-NAME.log); pytest's exit status in NAME.rc.
run_shard() {
    local name=$1 decorator=$2 number=$3 shard_rc=0 host port
    shift 3
    read -r host port < <("$PY" -m tests.celery_compat.run hostport "$(redis_url "$number")")
    rm -f "$OUT/outcomes-$name.json"
    # pytest-django would take over the database (the suite's own setup is its conftest's);
    # pytest-rerunfailures, where installed, would rerun Celery's flaky tests five times.
    (
        cd "$tree"
        # Celery's tasks and tests reach Redis themselves (tasks.py get_redis_connection).
        REDIS_URL=$(redis_url "$number") REDIS_HOST=$host REDIS_PORT=$port \
            BROKER_URL=$(broker_url "$number") DATABASE_URL=$(database_url "$number") \
            CELERY_COMPAT_DECORATOR=$decorator \
            CELERY_COMPAT_OUTCOMES=$ROOT/$OUT/outcomes-$name.json \
            CELERY_COMPAT_LOG_DIR=$ROOT/$OUT \
            PYTHONPATH="$PWD:$ROOT" \
            exec "$PY" -m pytest -p no:django -p no:cacheprovider -p no:rerunfailures -c pytest.ini --rootdir . -q "$@"
    ) >"$OUT/pytest-$name.log" 2>&1 || shard_rc=$?
    echo "$shard_rc" >"$OUT/$name.rc"
}

# The shards of a half: one per file, and more for a file named in CELERY_COMPAT_SPLIT: each
# entry FILE::NODE[,NODE...] (a NODE is a class, or CLASS::TEST) is a shard of those tests, and
# the rest of the file one more. Default: test_canvas.py::test_chord, the longest class; on
# RabbitMQ also test_tasks.py's longest tests beside the rest of the file
# (COMPAT_AMQP_TASKS_SPLIT).
read -r -d '' -a splits <<<"${CELERY_COMPAT_SPLIT-test_canvas.py::test_chord${variant:+ $COMPAT_AMQP_TASKS_SPLIT}}" || true
# The rest leaves the split tests out by CELERY_COMPAT_DESELECT (tests/celery_compat/harness.py).
shard_names=()
shard_args=()
shard_deselect=()
for file in "${files[@]}"; do
    rest=""
    for split in "${splits[@]}"; do
        [[ ${split%%::*} == "$file" ]] || continue
        IFS=, read -r -a nodes <<<"${split#*::}"
        selection=""
        for node in "${nodes[@]}"; do
            selection+=" t/integration/$file::$node"
        done
        first=${nodes[0]}
        shard_names+=("${file%.py}-${first##*::}")
        shard_args+=("${selection# }")
        shard_deselect+=("")
        rest+=$selection
    done
    shard_names+=("${file%.py}")
    shard_args+=("t/integration/$file")
    shard_deselect+=("${rest# }")
done

# On RabbitMQ: a vhost for each (half, shard), and one for the rerun of unlisted differences.
if [[ $broker == amqp ]]; then
    amqp_up $((${#halves[@]} * ${#shard_names[@]} + 1))
fi

# Every (half, shard) runs at once, unless CELERY_COMPAT_PARALLEL=0.
names=()
number=0
for half in "${halves[@]}"; do
    decorator=$half
    [[ $half == control ]] && decorator=shared_task
    for i in "${!shard_names[@]}"; do
        name=$half-${shard_names[$i]}
        read -r -a selection <<<"${shard_args[$i]}"
        shard_up "$number"
        names+=("$name")
        rm -f "$OUT/$name.rc"
        amqp=$(broker_url "$number")
        deselect=${shard_deselect[$i]}
        log "shard $name: ${shard_args[$i]}${deselect:+ without ${deselect//t\/integration\//}}, tasks declared with $decorator, Redis $(redis_url "$number")${amqp:+, broker $amqp}"
        if [[ ${CELERY_COMPAT_PARALLEL:-1} == 0 ]]; then
            CELERY_COMPAT_DESELECT=$deselect run_shard "$name" "$decorator" "$number" "${selection[@]}" "${args[@]}"
        else
            CELERY_COMPAT_DESELECT=$deselect run_shard "$name" "$decorator" "$number" "${selection[@]}" "${args[@]}" &
            shard_pids+=("$!")
        fi
        number=$((number + 1))
    done
done
for pid in "${shard_pids[@]:-}"; do
    [[ -n $pid ]] && { wait "$pid" || true; }
done
shard_pids=()

rc=0
for half in "${halves[@]}"; do
    parts=()
    for name in "${names[@]}"; do
        [[ $name == "$half"-* ]] || continue
        shard_rc=$(cat "$OUT/$name.rc" 2>/dev/null || echo "?")
        log "shard $name: pytest exit $shard_rc; $(tail -n 1 "$OUT/pytest-$name.log")"
        if [[ ! $shard_rc =~ ^[01]$ ]]; then
            rc=2
            tail -n 20 "$OUT/pytest-$name.log" >&2
        fi
        [[ -f $OUT/outcomes-$name.json ]] && parts+=("$OUT/outcomes-$name.json")
    done
    rm -f "$OUT/outcomes-$half.json"
    if [[ ${#parts[@]} -gt 0 ]]; then
        "$PY" -m tests.celery_compat.run merge "$OUT/outcomes-$half.json" "${parts[@]}"
    fi
done

# The control's outcomes: this run's, or an earlier run's here, or the committed baseline for
# this Celery version (tests/celery_compat/control-<version>.json) when only @job ran.
control=$OUT/outcomes-control.json
if [[ ! " ${halves[*]} " == *" control "* ]]; then
    baseline=tests/celery_compat/control-$variant$("$PY" -c 'import celery; print(celery.__version__)').json
    if [[ $baseline_only -eq 1 && ! -f $baseline ]]; then
        die "--against-baseline: no committed control baseline $baseline for this Celery version"
    fi
    if [[ $baseline_only -eq 0 && -f $control ]]; then
        log "the control's outcomes are from an earlier run ($(date -r "$control" '+%F %T'))"
    elif [[ -f $baseline ]]; then
        control=$baseline
        log "the control's outcomes are the committed baseline $baseline"
    fi
fi
if [[ -f $OUT/outcomes-job.json && -f $control ]]; then
    if [[ ! " ${halves[*]} " == *" job "* ]]; then
        log "the @job half's outcomes are from an earlier run ($(date -r "$OUT/outcomes-job.json" '+%F %T'))"
    fi
    compare=("$PY" -m tests.celery_compat.run compare "$OUT/outcomes-job.json" "$control" "$DOC" "$OUT/result.json"
        --broker "$broker")
    cmp_rc=0
    "${compare[@]}" >"$OUT/compare.log" 2>&1 || cmp_rc=$?
    # A test that passes in the control and failed under @job, not listed: run those again
    # under @job on their own (at most CELERY_COMPAT_RERUN_MAX of them, default 10), so one
    # flaky failure is told apart from a difference.
    mapfile -t unlisted < <("$PY" -m tests.celery_compat.run unlisted "$OUT/result.json")
    if [[ $cmp_rc -eq 1 && ${#unlisted[@]} -le ${CELERY_COMPAT_RERUN_MAX:-10} ]]; then
        log "running the ${#unlisted[@]} unlisted difference(s) again under @job"
        shard_up "$number"
        run_shard job-rerun job "$number" "${unlisted[@]}"
        cmp_rc=0
        "${compare[@]}" --rerun "$OUT/outcomes-job-rerun.json" >"$OUT/compare.log" 2>&1 || cmp_rc=$?
    fi
    cat "$OUT/compare.log"
    if [[ $cmp_rc -ne 0 ]]; then rc=$cmp_rc; fi
else
    log "only the ${halves[*]} half ran and the other has no outcomes in $OUT: nothing to compare"
fi
log "celery-compat${variant:+ on RabbitMQ}: $((SECONDS - begin)) s"
exit "$rc"
