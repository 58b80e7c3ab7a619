#!/usr/bin/env bash
# `make test-scale`: the multi-host system test (tests/scale/). Redis and PostgreSQL run in one
# Linux network namespace and a Celery worker in each of two others; 5,000 jobs go through
# them. The test builds and removes the namespaces and servers itself (nothing is left on the
# machine's own network), so it needs root and `ip netns`. Extra arguments (or PYTEST_ARGS)
# go to pytest; the exit status is pytest's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

is_root || die "make test-scale builds Linux network namespaces (ip netns): run it as root"

# The binaries the test starts inside the namespaces.
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
# tests/scale/test_rabbitmq_failover.py: three RabbitMQ nodes (epmd comes with erlang-base).
[[ -x ${RABBITMQ_SBIN:-/usr/lib/rabbitmq/bin}/rabbitmq-server ]] || missing+=(rabbitmq-server)
if [[ ${#missing[@]} -gt 0 ]]; then apt_install "${missing[@]}"; fi
ip netns list >/dev/null || die "\`ip netns\` does not work on this machine"

export BACKLOT_SCALE_TEST=1   # tests/scale is collected only when asked for
export PATH="$PWD/.venv/bin:$PATH"

# PYTEST_ARGS is split on whitespace (no globbing); arguments to this script are kept as given.
read -r -a args <<<"${PYTEST_ARGS:-}"
args+=("$@")
log "pytest tests/scale ${args[*]}"
exec .venv/bin/pytest tests/scale "${args[@]}"
