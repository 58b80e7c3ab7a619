#!/usr/bin/env bash
# `make test-celery-compat`: Celery's own integration suite against Backlot (docs/celery-compat.md).
# The sdist of the installed Celery is fetched once (pip download, cached in .data/celery-sdist),
# its t/integration extracted into .data/celery-compat/celery-<version>/ and run twice on a real
# `celery -A config worker` of this project: tasks declared with @job, then the control with
# Celery's shared_task (tests/celery_compat/). Prints both counts and every test whose outcome
# differs, writes them to .data/celery-compat/result.json, and exits 1 when a test passes in the
# control and not under @job while docs/celery-compat.md does not list it.
#
#   scripts/celery-compat.sh [--reuse-services] [--half job|control|both] [PYTEST_ARGS...]
#
# Services: its own Redis (:6394) and PostgreSQL (:54334) under .data/, stopped afterwards.
# --reuse-services: the Redis and PostgreSQL that REDIS_URL and DATABASE_URL name (scripts/test.sh
# exports them), with data of its own there: database backlot_celery_compat, Redis database 8
# (CELERY_COMPAT_REDIS_DB); nothing is started or stopped.
# --half job|control: run one half; the comparison then uses the other half's last outcomes in
# .data/celery-compat/ when there are some (their time is printed), else for @job alone the
# committed control baseline tests/celery_compat/control-<celery version>.json.
# A test that passes in the control, fails under @job and is not listed is run once more under
# @job on its own (up to CELERY_COMPAT_RERUN_MAX=10 of them): passing then, it is reported flaky.
# CELERY_COMPAT_TIMEOUT: seconds per test (default 60); CELERY_COMPAT_FILES: Celery's test files
# (default "test_tasks.py test_canvas.py test_inspect.py").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

COMPAT_REDIS_URL=redis://127.0.0.1:6394/0
COMPAT_REDIS_DATA=.data/redis-celery-compat
COMPAT_PG_DATA=.data/pg-celery-compat
COMPAT_PG_PORT=54334
COMPAT_DB=backlot_celery_compat
OUT=.data/celery-compat
DOC=docs/celery-compat.md
PY=$PWD/.venv/bin/python
[[ -x $PY ]] || die "no .venv: run make venv first"

reuse=0
halves=(job control)
args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --reuse-services) reuse=1; shift ;;
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
read -r -a files <<<"${CELERY_COMPAT_FILES:-test_tasks.py test_canvas.py test_inspect.py}"

started_redis=0
started_pg=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ $started_redis -eq 1 ]]; then bash scripts/services.sh redis-down "$COMPAT_REDIS_DATA" || true; fi
    if [[ $started_pg -eq 1 ]]; then bash scripts/services.sh postgres-down "$COMPAT_PG_DATA" || true; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mkdir -p "$OUT"
begin=$SECONDS

if [[ $reuse -eq 1 ]]; then
    [[ -n ${DATABASE_URL:-} && -n ${REDIS_URL:-} ]] ||
        die "--reuse-services needs DATABASE_URL and REDIS_URL (the services scripts/test.sh started)"
    { read -r DATABASE_URL; read -r REDIS_URL; } < <(
        "$PY" -m tests.celery_compat.run urls "$DATABASE_URL" "$REDIS_URL" "$COMPAT_DB" "${CELERY_COMPAT_REDIS_DB:-8}")
else
    if ! bash scripts/services.sh redis-status "$COMPAT_REDIS_DATA" >/dev/null 2>&1; then
        started_redis=1   # set first: an interrupted start is still cleaned up
    fi
    bash scripts/services.sh redis-up "$COMPAT_REDIS_URL" "$COMPAT_REDIS_DATA"
    if ! bash scripts/services.sh redis-status "$COMPAT_REDIS_DATA" >/dev/null 2>&1; then
        started_redis=0   # an already-running Redis not started by us was used
    fi
    if ! bash scripts/services.sh postgres-status "$COMPAT_PG_DATA" >/dev/null 2>&1; then
        started_pg=1
    fi
    # 54334 lies in Linux's ephemeral port range (see scripts/bench.sh): a failed start is retried.
    for attempt in 1 2 3 4; do
        if bash scripts/services.sh postgres-up "$COMPAT_PG_DATA" "$COMPAT_PG_PORT"; then break; fi
        [[ $attempt -lt 4 ]] || die "PostgreSQL did not start on port $COMPAT_PG_PORT"
        log "retrying in 3 s"
        sleep 3
    done
    DATABASE_URL=postgres://backlot@127.0.0.1:$COMPAT_PG_PORT/$COMPAT_DB
    REDIS_URL=$COMPAT_REDIS_URL
fi
read -r redis_host redis_port < <("$PY" -c \
    'import sys; from urllib.parse import urlsplit; u = urlsplit(sys.argv[1]); print(u.hostname or "127.0.0.1", u.port or 6379)' \
    "$REDIS_URL")
export DATABASE_URL REDIS_URL
# Celery's tasks and tests reach Redis themselves (t/integration/tasks.py get_redis_connection).
export REDIS_HOST=$redis_host REDIS_PORT=$redis_port
export DJANGO_SETTINGS_MODULE=config.settings PYTHONUNBUFFERED=1
export PATH="$PWD/.venv/bin:$PATH"

log "database $COMPAT_DB, Redis $REDIS_URL"
"$PY" -m tests.celery_compat.run createdb "$DATABASE_URL"
"$PY" manage.py migrate --noinput >"$OUT/migrate.log" 2>&1 || { cat "$OUT/migrate.log" >&2; die "migrate failed"; }
tree=$("$PY" -m tests.celery_compat.run prepare "$OUT")
log "Celery's suite in $tree: ${files[*]}"

# run_half HALF OUTCOMES LOG [PYTEST_ARGS...]: one pytest run of Celery's files on a fresh worker;
# prints pytest's exit status (1: some tests failed, a test outcome; above 1: pytest broke).
run_half() {
    local half=$1 outcomes=$2 logfile=$3 decorator=$1 half_rc=0
    shift 3
    [[ $half == control ]] && decorator=shared_task
    "$PY" -m tests.celery_compat.run flushdb "$REDIS_URL"
    rm -f "$outcomes"
    (
        cd "$tree"
        CELERY_COMPAT_DECORATOR=$decorator \
            CELERY_COMPAT_OUTCOMES=$outcomes \
            CELERY_COMPAT_LOG_DIR=$ROOT/$OUT \
            PYTHONPATH="$PWD:$ROOT" \
            "$PY" -m pytest -p no:django -p no:cacheprovider -c pytest.ini --rootdir . -q "$@"
    ) >"$logfile" 2>&1 || half_rc=$?
    tail -n 3 "$logfile" >&2
    echo "$half_rc"
}

ROOT=$PWD
rc=0
for half in "${halves[@]}"; do
    log "the $half half; worker log: $OUT/worker-$half.log"
    half_rc=$(run_half "$half" "$ROOT/$OUT/outcomes-$half.json" "$OUT/pytest-$half.log" \
        "${files[@]/#/t/integration/}" "${args[@]}")
    log "the $half half: pytest exit $half_rc (full output: $OUT/pytest-$half.log)"
    if [[ ! $half_rc =~ ^[01]$ ]]; then rc=2; fi
done

# The control's outcomes: this run's, or an earlier run's here, or the committed baseline for
# this Celery version (tests/celery_compat/control-<version>.json) when only @job ran.
control=$OUT/outcomes-control.json
if [[ ! " ${halves[*]} " == *" control "* ]]; then
    baseline=tests/celery_compat/control-$("$PY" -c 'import celery; print(celery.__version__)').json
    if [[ -f $control ]]; then
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
    compare=("$PY" -m tests.celery_compat.run compare "$OUT/outcomes-job.json" "$control" "$DOC" "$OUT/result.json")
    cmp_rc=0
    "${compare[@]}" >"$OUT/compare.log" 2>&1 || cmp_rc=$?
    # A test that passes in the control and failed under @job, not listed: run those again
    # under @job on their own (at most CELERY_COMPAT_RERUN_MAX of them, default 10), so one
    # flaky failure is told apart from a difference.
    mapfile -t unlisted < <("$PY" -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["unlisted"]))' "$OUT/result.json" | sed '/^$/d')
    if [[ $cmp_rc -eq 1 && ${#unlisted[@]} -le ${CELERY_COMPAT_RERUN_MAX:-10} ]]; then
        log "running the ${#unlisted[@]} unlisted difference(s) again under @job"
        run_half job "$ROOT/$OUT/outcomes-job-rerun.json" "$OUT/pytest-job-rerun.log" "${unlisted[@]}" >/dev/null
        cmp_rc=0
        "${compare[@]}" --rerun "$OUT/outcomes-job-rerun.json" >"$OUT/compare.log" 2>&1 || cmp_rc=$?
    fi
    cat "$OUT/compare.log"
    if [[ $cmp_rc -ne 0 ]]; then rc=$cmp_rc; fi
else
    log "only the ${halves[*]} half ran and the other has no outcomes in $OUT: nothing to compare"
fi
log "celery-compat: $((SECONDS - begin)) s"
exit "$rc"
