#!/usr/bin/env bash
# `make run`: Redis (started here if none answers at REDIS_URL), migrations, static
# files, a dev superuser, then the Procfile (web, a worker per queue, beat, relay, flower)
# under honcho.
# Ctrl-C (or SIGTERM to this script) stops everything it started, Redis included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

# .env (if any) fills in what the environment does not set; defaults come after.
load_dotenv .env
export PATH="$PWD/.venv/bin:$PATH"
export DEBUG="${DEBUG:-1}"
# Laptop-sized workers (the Procfile's defaults are production sizes): 6 pool processes in
# all, enough to see every queue move on 2 cores. .env or the environment can raise them.
export WORKER_DEFAULT_CONCURRENCY="${WORKER_DEFAULT_CONCURRENCY:-1}"
# One short-job worker per core, as docker-compose.yml's deploy.replicas.
export WORKER_DEFAULT_REPLICAS="${WORKER_DEFAULT_REPLICAS:-2}"
export WORKER_EMAILS_CONCURRENCY="${WORKER_EMAILS_CONCURRENCY:-2}"
export WORKER_REPORTS_CONCURRENCY="${WORKER_REPORTS_CONCURRENCY:-1}"
export WORKER_MEDIA_CONCURRENCY="${WORKER_MEDIA_CONCURRENCY:-1}"
export FLOWER_PORT="${FLOWER_PORT:-5555}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
# honcho hands PORT to the first Procfile entry (web); the others get PORT+100, +200...
export PORT="${PORT:-8000}"
# DATABASE_URL is left as it is: unset means SQLite under .data/.

REDIS_DATA=.data/redis
started_redis=0
honcho_pid=""

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n $honcho_pid ]] && kill -0 "$honcho_pid" 2>/dev/null; then
        kill -TERM "$honcho_pid" 2>/dev/null || true
        wait "$honcho_pid" 2>/dev/null || true
    fi
    if [[ $started_redis -eq 1 ]]; then
        bash scripts/services.sh redis-down "$REDIS_DATA" || rc=1
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p .data
# Flower's login: FLOWER_BASIC_AUTH if set, else a random password generated once into
# .data/flower-auth (mode 600) and printed when it is made; never a shared default.
FLOWER_AUTH_FILE=.data/flower-auth
if [[ -z ${FLOWER_BASIC_AUTH:-} ]]; then
    if [[ ! -s $FLOWER_AUTH_FILE ]]; then
        (umask 077 && printf 'admin:%s\n' "$(.venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(18))')" >"$FLOWER_AUTH_FILE")
        log "flower login generated: $(<"$FLOWER_AUTH_FILE")  (kept in $FLOWER_AUTH_FILE)"
    fi
    FLOWER_BASIC_AUTH=$(<"$FLOWER_AUTH_FILE")
    export FLOWER_BASIC_AUTH
fi

if bash scripts/services.sh redis-status "$REDIS_DATA" >/dev/null 2>&1; then
    was_running=1
else
    was_running=0
fi
bash scripts/services.sh redis-up "$REDIS_URL" "$REDIS_DATA"
if [[ $was_running -eq 0 ]] && bash scripts/services.sh redis-status "$REDIS_DATA" >/dev/null 2>&1; then
    started_redis=1
fi

.venv/bin/python manage.py migrate --noinput
.venv/bin/python manage.py seed_demo
.venv/bin/python manage.py collectstatic --noinput
.venv/bin/python manage.py ensure_superuser

log "web http://127.0.0.1:$PORT/  (admin /admin/, API /api/, /health/, /metrics)"
if [[ -s $FLOWER_AUTH_FILE && $FLOWER_BASIC_AUTH == "$(<"$FLOWER_AUTH_FILE")" ]]; then
    log "flower http://127.0.0.1:$FLOWER_PORT/  (login in $FLOWER_AUTH_FILE)"
else
    log "flower http://127.0.0.1:$FLOWER_PORT/  (login from FLOWER_BASIC_AUTH)"
fi
# In the background so that this script sees signals at once and can forward them;
# honcho installs its own SIGINT/SIGTERM handlers and stops all its processes.
.venv/bin/honcho start -f Procfile -c "worker-default=$WORKER_DEFAULT_REPLICAS" &
honcho_pid=$!
rc=0
wait "$honcho_pid" || rc=$?
honcho_pid=""
exit "$rc"
