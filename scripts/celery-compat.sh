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
# .data/celery-compat/ when there are some (their time is printed).
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

rc=0
for half in "${halves[@]}"; do
    decorator=$half
    [[ $half == control ]] && decorator=shared_task
    "$PY" -m tests.celery_compat.run flushdb "$REDIS_URL"
    rm -f "$OUT/outcomes-$half.json"
    log "the $half half (tasks declared with $decorator); worker log: $OUT/worker-$decorator.log"
    half_rc=0
    (
        cd "$tree"
        CELERY_COMPAT_DECORATOR=$decorator \
            CELERY_COMPAT_OUTCOMES=$PWD/../outcomes-$half.json \
            CELERY_COMPAT_LOG_DIR=$PWD/.. \
            PYTHONPATH="$PWD:$OLDPWD" \
            "$PY" -m pytest -p no:django -p no:cacheprovider -c pytest.ini --rootdir . -q \
            "${files[@]/#/t/integration/}" "${args[@]}"
    ) >"$OUT/pytest-$half.log" 2>&1 || half_rc=$?
    tail -n 3 "$OUT/pytest-$half.log" >&2
    log "the $half half: pytest exit $half_rc (full output: $OUT/pytest-$half.log)"
    if [[ $half_rc -gt 1 ]]; then rc=2; fi
done

if [[ -f $OUT/outcomes-job.json && -f $OUT/outcomes-control.json ]]; then
    for half in job control; do
        if [[ ! " ${halves[*]} " == *" $half "* ]]; then
            log "the $half half's outcomes are from an earlier run ($(date -r "$OUT/outcomes-$half.json" '+%F %T'))"
        fi
    done
    cmp_rc=0
    "$PY" -m tests.celery_compat.run compare "$OUT/outcomes-job.json" "$OUT/outcomes-control.json" \
        "$DOC" "$OUT/result.json" || cmp_rc=$?
    if [[ $cmp_rc -ne 0 ]]; then rc=$cmp_rc; fi
else
    log "only the ${halves[*]} half ran and the other has no outcomes in $OUT: nothing to compare"
fi
log "celery-compat: $((SECONDS - begin)) s"
exit "$rc"
