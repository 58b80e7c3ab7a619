#!/usr/bin/env bash
# `make bench`: a benchmark Redis (:6392) and PostgreSQL (:54332) under .data/, and a RabbitMQ
# (:5692, BENCH_AMQP_URL) when a chosen case needs one (--cases amqp), then the benchmark suite
# (python -m benchmarks). Services started here are stopped afterwards, whatever happens; the
# exit status is the suite's. Arguments (or BENCH_ARGS) go to the suite, e.g.
# BENCH_ARGS="--cases drain_pg,latency".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

BENCH_REDIS_URL=redis://127.0.0.1:6392/0
BENCH_REDIS_DATA=.data/redis-bench
BENCH_PG_DATA=.data/pg-bench
BENCH_PG_PORT=54332
# Not 5672 (a default broker), 5682 (make test's): the suite purges its queues.
BENCH_AMQP_URL=amqp://guest:guest@127.0.0.1:5692//
BENCH_AMQP_DATA=.data/rabbitmq-bench

started_redis=0
started_pg=0
started_rabbitmq=0

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ $started_redis -eq 1 ]]; then bash scripts/services.sh redis-down "$BENCH_REDIS_DATA" || true; fi
    if [[ $started_pg -eq 1 ]]; then bash scripts/services.sh postgres-down "$BENCH_PG_DATA" || true; fi
    if [[ $started_rabbitmq -eq 1 ]]; then bash scripts/services.sh rabbitmq-down "$BENCH_AMQP_DATA" || true; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p .data

# BENCH_ARGS is split on whitespace (no globbing); arguments to this script are kept as given.
read -r -a args <<<"${BENCH_ARGS:-}"
args+=("$@")

if ! bash scripts/services.sh redis-status "$BENCH_REDIS_DATA" >/dev/null 2>&1; then
    started_redis=1   # set first: an interrupted start is still cleaned up
fi
bash scripts/services.sh redis-up "$BENCH_REDIS_URL" "$BENCH_REDIS_DATA"
if ! bash scripts/services.sh redis-status "$BENCH_REDIS_DATA" >/dev/null 2>&1; then
    started_redis=0   # an already-running Redis not started by us was used
fi

if ! bash scripts/services.sh postgres-status "$BENCH_PG_DATA" >/dev/null 2>&1; then
    started_pg=1
fi
# 54332 lies in Linux's ephemeral port range: a client connection elsewhere may hold it for a
# moment ("Address already in use"), so a failed start is tried again.
for attempt in 1 2 3 4; do
    if bash scripts/services.sh postgres-up "$BENCH_PG_DATA" "$BENCH_PG_PORT"; then break; fi
    [[ $attempt -lt 4 ]] || die "PostgreSQL did not start on port $BENCH_PG_PORT"
    log "retrying in 3 s"
    sleep 3
done

# RabbitMQ only for the cases that compare the brokers (not in the default run): its boot takes
# 6-10 s, and an idle node would only add to the other cases' foreign CPU.
if .venv/bin/python -m benchmarks --needs-amqp "${args[@]}"; then
    if ! bash scripts/services.sh rabbitmq-status "$BENCH_AMQP_DATA" >/dev/null 2>&1; then
        started_rabbitmq=1
    fi
    bash scripts/services.sh rabbitmq-up "$BENCH_AMQP_URL" "$BENCH_AMQP_DATA"
    if ! bash scripts/services.sh rabbitmq-status "$BENCH_AMQP_DATA" >/dev/null 2>&1; then
        started_rabbitmq=0   # an already-running RabbitMQ not started by us was used
    fi
    export BENCH_AMQP_URL
fi

export DATABASE_URL="postgres://backlot@127.0.0.1:$BENCH_PG_PORT/backlot"
export REDIS_URL="$BENCH_REDIS_URL"
export PATH="$PWD/.venv/bin:$PATH"

log "python -m benchmarks ${args[*]}"
.venv/bin/python -m benchmarks "${args[@]}"
