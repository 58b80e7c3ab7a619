#!/usr/bin/env bash
# `make run`: Redis (started here if none answers at REDIS_URL), migrations, static
# files, a dev superuser, then web + worker + beat + flower under honcho.
# Ctrl-C (or SIGTERM to this script) stops everything it started, Redis included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

# .env (if any) fills in what the environment does not set; defaults come after.
load_dotenv .env
export PATH="$PWD/.venv/bin:$PATH"
export DEBUG="${DEBUG:-1}"
export FLOWER_BASIC_AUTH="${FLOWER_BASIC_AUTH:-admin:admin}"
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
log "flower http://127.0.0.1:5555/  (basic auth from FLOWER_BASIC_AUTH)"
# In the background so that this script sees signals at once and can forward them;
# honcho installs its own SIGINT/SIGTERM handlers and stops all its processes.
.venv/bin/honcho start -f Procfile &
honcho_pid=$!
rc=0
wait "$honcho_pid" || rc=$?
honcho_pid=""
exit "$rc"
