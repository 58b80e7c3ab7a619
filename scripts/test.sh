#!/usr/bin/env bash
# `make test`: the lint gate (scripts/lint.sh), then a test Redis (:6390), PostgreSQL (:54329)
# and RabbitMQ (:5682, BACKLOT_TEST_AMQP_URL) under .data/ and pytest; as root, the multi-host
# test (tests/scale) too.
# Services started here are stopped afterwards, whatever happens; the exit status is
# pytest's. Extra arguments (or PYTEST_ARGS) go to pytest.
# Then, on the same services, the Tasks-backend tests and the platform smoke test run again on
# Django 6 from .venv-django6 (scripts/venv-django6.sh); a failure there fails the run too. It
# runs when pytest got no arguments (CI's `make test`); BACKLOT_DJANGO6=1 or 0 forces it on/off.
# Before it, the clock sweep (scripts/clock-sweep.sh), on the same condition.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

# BACKLOT_TEST_REDIS_PORT / BACKLOT_TEST_PG_PORT / BACKLOT_TEST_AMQP_PORT move the services (a
# second checkout's run beside a first one's services); CI uses the defaults.
TEST_REDIS_URL=redis://127.0.0.1:${BACKLOT_TEST_REDIS_PORT:-6390}/0
TEST_REDIS_DATA=.data/redis-test
TEST_PG_DATA=.data/pg
TEST_PG_PORT=${BACKLOT_TEST_PG_PORT:-54329}
# The node also takes epmd on the port - 1300 and distribution on the port + 20000
# (scripts/services.sh); it boots in about 8 s.
TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:${BACKLOT_TEST_AMQP_PORT:-5682}//
TEST_RABBITMQ_DATA=.data/rabbitmq-test
STATUS_FILE=.data/pytest.status   # the run's own exit status, for a look after make (which reports 2)

started_redis=0
started_pg=0
started_rabbitmq=0

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ $started_redis -eq 1 ]]; then bash scripts/services.sh redis-down "$TEST_REDIS_DATA" || true; fi
    if [[ $started_pg -eq 1 ]]; then bash scripts/services.sh postgres-down "$TEST_PG_DATA" || true; fi
    if [[ $started_rabbitmq -eq 1 ]]; then bash scripts/services.sh rabbitmq-down "$TEST_RABBITMQ_DATA" || true; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p .data
rm -f "$STATUS_FILE"

# The lint gate runs first and fails the run, but the tests still run: one pass shows both.
lint_rc=0
bash scripts/lint.sh || lint_rc=$?

if ! bash scripts/services.sh redis-status "$TEST_REDIS_DATA" >/dev/null 2>&1; then
    started_redis=1   # set first: an interrupted start is still cleaned up
fi
bash scripts/services.sh redis-up "$TEST_REDIS_URL" "$TEST_REDIS_DATA"
if ! bash scripts/services.sh redis-status "$TEST_REDIS_DATA" >/dev/null 2>&1; then
    started_redis=0   # an already-running Redis not started by us was used
fi

if ! bash scripts/services.sh postgres-status "$TEST_PG_DATA" >/dev/null 2>&1; then
    started_pg=1
fi
bash scripts/services.sh postgres-up "$TEST_PG_DATA" "$TEST_PG_PORT"

if ! bash scripts/services.sh rabbitmq-status "$TEST_RABBITMQ_DATA" >/dev/null 2>&1; then
    started_rabbitmq=1
fi
bash scripts/services.sh rabbitmq-up "$TEST_AMQP_URL" "$TEST_RABBITMQ_DATA"
if ! bash scripts/services.sh rabbitmq-status "$TEST_RABBITMQ_DATA" >/dev/null 2>&1; then
    started_rabbitmq=0   # an already-running RabbitMQ not started by us was used
fi

# System tools the tests drive for real: ffprobe (media), Pango (WeasyPrint), Chromium (admin).
missing=()
command -v ffprobe >/dev/null 2>&1 || missing+=(ffmpeg)
ldconfig -p 2>/dev/null | grep -q libpangoft2-1.0 || missing+=(libpango-1.0-0 libpangoft2-1.0-0 fonts-dejavu-core)
# tests/system/test_browser.py launches exactly /usr/bin/chromium (Debian's; never `playwright install`).
[[ -x /usr/bin/chromium ]] || missing+=(chromium fonts-dejavu-core)
# tests/system/test_prometheus_rules.py runs promtool over deploy/prometheus (Debian ships it in `prometheus`).
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [[ ${#missing[@]} -gt 0 ]]; then apt_install "${missing[@]}"; fi

export DATABASE_URL="postgres://backlot@127.0.0.1:$TEST_PG_PORT/backlot"
export REDIS_URL="$TEST_REDIS_URL"
export BACKLOT_TEST_AMQP_URL="$TEST_AMQP_URL"
export PATH="$PWD/.venv/bin:$PATH"

# tests/scale builds Linux network namespaces: it needs root and `ip netns` (CI has both).
if is_root && command -v ip >/dev/null 2>&1 && ip netns list >/dev/null 2>&1; then
    export BACKLOT_SCALE_TEST=1
else
    log "not root or no \`ip netns\`: tests/scale (multi-host) left out; run \`make test-scale\` as root"
fi

# PYTEST_ARGS is split on whitespace (no globbing); arguments to this script are kept as given.
read -r -a args <<<"${PYTEST_ARGS:-}"
args+=("$@")
# The suite runs in BACKLOT_TEST_PROCESSES pytest-xdist processes (default 2, one a core here:
# most of a test's time is waiting on its workers, Redis and PostgreSQL, so two overlap), a
# file's tests in one process (tests/conftest.py groups them; tests/settings.py gives each
# process its own Redis database and media folder). BACKLOT_TEST_PROCESSES=1: one process, as
# before. The slowest 20 tests are listed at the end.
processes=${BACKLOT_TEST_PROCESSES:-2}
xdist=()
if [[ $processes -gt 1 ]]; then xdist=(-n "$processes" --dist loadgroup); fi
log "pytest ${xdist[*]} --durations=20 ${args[*]}"
rc=0
.venv/bin/pytest "${xdist[@]}" --durations=20 "${args[@]}" || rc=$?

# The clock sweep: the `clock` tests (whose outcome depends on the date, the weekday, the time of
# day or DST) under nine fixed clocks, each weekday and New York's two DST days
# (scripts/clock-sweep.sh; about 2.5 min on 2 cores). Like the Django 6 run, only when pytest got
# no arguments (CI's make test); BACKLOT_CLOCK_SWEEP=1 or 0 forces it on/off.
clock_sweep=${BACKLOT_CLOCK_SWEEP:-auto}
if [[ $clock_sweep == auto ]]; then
    if [[ ${#args[@]} -eq 0 ]]; then clock_sweep=1; else clock_sweep=0; fi
fi
if [[ $clock_sweep == 1 ]]; then
    clock_rc=0
    bash scripts/clock-sweep.sh || clock_rc=$?
    if [[ $clock_rc -ne 0 ]]; then
        log "the clock sweep failed (exit $clock_rc; see above)"
        if [[ $rc -eq 0 ]]; then rc=1; fi
    fi
else
    log "clock sweep left out (pytest got arguments, or BACKLOT_CLOCK_SWEEP=0)"
fi

# Django 6 (built-in django.tasks): the suite stays on 5.2; these files prove the Tasks
# backend and enqueue → worker → dead letter → replay on 6 (workers start from the same venv:
# tests/conftest.py runs sys.executable), and the ledger's row preparation against Django 6's
# own (tests/jobs/ledger/test_values.py). Measured on 2 cores: 46 tests in about 50 s, plus about
# 60 s to build the venv from PyPI the first time (8 s after a pyproject change, 0.4 s when current).
django6=${BACKLOT_DJANGO6:-auto}
if [[ $django6 == auto ]]; then
    if [[ ${#args[@]} -eq 0 ]]; then django6=1; else django6=0; fi
fi
if [[ $django6 == 1 ]]; then
    dj6_rc=0
    bash scripts/venv-django6.sh >/dev/null || dj6_rc=$?
    if [[ $dj6_rc -eq 0 ]]; then
        log "Django 6: pytest tests/jobs/flow/test_tasks_backend.py tests/jobs/flow/test_django6_smoke.py tests/jobs/ledger/test_values.py ($(.venv-django6/bin/python -m django --version))"
        # A database of its own (test_backlot_django6, made afresh): the main run's test
        # database may still be held by its last workers' connections when this starts.
        DATABASE_URL="postgres://backlot@127.0.0.1:$TEST_PG_PORT/backlot_django6" \
            PATH="$PWD/.venv-django6/bin:$PATH" .venv-django6/bin/pytest --create-db \
            tests/jobs/flow/test_tasks_backend.py tests/jobs/flow/test_django6_smoke.py \
            tests/jobs/ledger/test_values.py || dj6_rc=$?
    fi
    if [[ $dj6_rc -ne 0 ]]; then
        log "the Django 6 run failed (exit $dj6_rc; see above)"
        if [[ $rc -eq 0 ]]; then rc=1; fi
    fi
else
    log "Django 6 run left out (pytest got arguments, or BACKLOT_DJANGO6=0; BACKLOT_DJANGO6=1 runs it)"
fi
if [[ $rc -eq 0 && $lint_rc -ne 0 ]]; then
    log "tests passed but the lint gate failed (see the ruff/mypy output above)"
    rc=1
fi
echo "$rc" >"$STATUS_FILE"
exit "$rc"
