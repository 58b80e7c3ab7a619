#!/usr/bin/env bash
# `make bench-peers`: Backlot next to Dramatiq, RQ, Huey, Procrastinate and django-tasks'
# database backend (issue 16), same cases, same Redis and PostgreSQL, one run.
# Installs the peers into their own virtualenv (.data/venv-peers; never into .venv), starts
# its own Redis (:6393, .data/redis-peers-bench) and PostgreSQL (:29336, .data/pg-peers-bench)
# and stops what it started, whatever happens. Arguments (or PEERS_ARGS) go to
# `python -m benchmarks.peers`, e.g. --full, --scale 0.2, --sides backlot,dramatiq.
# Ports: PEERS_REDIS_PORT, PEERS_PG_PORT. Writes benchmarks/results/peers.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

REDIS_PORT=${PEERS_REDIS_PORT:-6393}
PG_PORT=${PEERS_PG_PORT:-29336}
REDIS_DATA=.data/redis-peers-bench
PG_DATA=.data/pg-peers-bench
PEERS_VENV=.data/venv-peers
# The peers' versions, pinned so that two runs compare the same code.
PEER_PACKAGES=(
    "dramatiq[redis]==2.2.1"
    "rq==2.12.0"
    "huey==3.5.4"
    "procrastinate==3.10.0"
    "django-tasks==0.12.0"
    "django-tasks-db==0.13.0"
    "Django>=5.2,<6.0"
    "psycopg[binary]>=3.2"
    "redis>=5"
    "py-spy==0.4.3"
)

started_redis=0
started_pg=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ $started_redis -eq 1 ]]; then bash scripts/services.sh redis-down "$REDIS_DATA" || true; fi
    if [[ $started_pg -eq 1 ]]; then bash scripts/services.sh postgres-down "$PG_DATA" || true; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p .data

# The peers' virtualenv, (re)installed when this list changes.
stamp=$PEERS_VENV/.installed
want=$(printf '%s\n' "${PEER_PACKAGES[@]}")
if [[ ! -x $PEERS_VENV/bin/python || ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    log "installing the peers into $PEERS_VENV"
    [[ -x $PEERS_VENV/bin/python ]] || python3 -m venv "$PEERS_VENV"
    "$PEERS_VENV/bin/python" -m pip install -q "${PEER_PACKAGES[@]}" 2>&1 | grep -v "^WARNING: Location" || true
    "$PEERS_VENV/bin/python" -c "import dramatiq, rq, huey, procrastinate, django_tasks, django_tasks_db" \
        || die "the peers did not install into $PEERS_VENV"
    echo "$want" >"$stamp"
fi

if ! bash scripts/services.sh redis-status "$REDIS_DATA" >/dev/null 2>&1; then started_redis=1; fi
bash scripts/services.sh redis-up "redis://127.0.0.1:$REDIS_PORT/0" "$REDIS_DATA"
if ! bash scripts/services.sh redis-status "$REDIS_DATA" >/dev/null 2>&1; then started_redis=0; fi

if ! bash scripts/services.sh postgres-status "$PG_DATA" >/dev/null 2>&1; then started_pg=1; fi
for attempt in 1 2 3 4; do
    if bash scripts/services.sh postgres-up "$PG_DATA" "$PG_PORT"; then break; fi
    [[ $attempt -lt 4 ]] || die "PostgreSQL did not start on port $PG_PORT"
    log "retrying in 3 s"
    sleep 3
done
# A database per PostgreSQL peer (Backlot has "backlot", which services.sh creates).
for db in peers_procrastinate peers_djtasks; do
    "$PEERS_VENV/bin/python" - "$PG_PORT" "$db" <<'PY'
import sys
import psycopg
port, db = sys.argv[1], sys.argv[2]
with psycopg.connect(f"postgres://backlot@127.0.0.1:{port}/postgres", autocommit=True) as c:
    if not c.execute("select 1 from pg_database where datname = %s", (db,)).fetchone():
        c.execute(f'create database "{db}"')
PY
done

export DATABASE_URL="postgres://backlot@127.0.0.1:$PG_PORT/backlot"
export REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
export PEERS_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/1"
export PEERS_PROCRASTINATE_URL="postgres://backlot@127.0.0.1:$PG_PORT/peers_procrastinate"
export PEERS_DJTASKS_URL="postgres://backlot@127.0.0.1:$PG_PORT/peers_djtasks"
export PATH="$PWD/.venv/bin:$PATH"

read -r -a args <<<"${PEERS_ARGS:-}"
args+=("$@")
log "python -m benchmarks.peers ${args[*]}"
.venv/bin/python -m benchmarks.peers "${args[@]}"
