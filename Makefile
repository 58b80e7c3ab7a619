# Backlot developer entry points. See README.md.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Extra arguments for pytest, e.g. make test PYTEST_ARGS="-k retry -x"
PYTEST_ARGS ?=
export PYTEST_ARGS

.PHONY: help venv run test test-scale test-celery-compat test-celery-compat-job bench bench-peers lint docs services-up services-down stop clean

help:
	@echo "make run      start Redis, migrate, then web :8000, a worker per queue, beat, relay and flower :5555 (Ctrl-C stops all)"
	@echo "make test     make lint, then test Redis :6390, PostgreSQL :54329 and RabbitMQ :5682 and pytest (PYTEST_ARGS=...; as root also tests/scale), stop them"
	@echo "make test-scale  (root) tests/scale: two worker hosts in network namespaces (5,000 jobs, 600 rate-limited), a Redis Sentinel failover under load (FAILOVER_JOBS=240), a RabbitMQ node killed under load (RABBITMQ_FAILOVER_JOBS=300; PYTEST_ARGS=...)"
	@echo "make test-celery-compat  Celery's own integration suite on @job and, as the control, on shared_task; own Redis :16390 and up and PostgreSQL :29334 (COMPAT_ARGS=...; COMPAT_ARGS=--broker amqp: on RabbitMQ :12672; docs/celery-compat.md)"
	@echo "make test-celery-compat-job  its @job half only, compared with the committed control (tests/celery_compat/control-<version>.json), then its test_tasks on RabbitMQ (own node :12672; control-amqp-<version>.json); .ci/run runs it after make test"
	@echo "make bench    start bench Redis :6392 and PostgreSQL :54332, run the benchmark suite (BENCH_ARGS=...), stop them"
	@echo "make bench-peers  Backlot ledger-off/on next to Dramatiq, RQ, Huey, Procrastinate, django-tasks (own venv .data/venv-peers, Redis :6393, PostgreSQL :29336; PEERS_ARGS=...)"
	@echo "make venv     create .venv and install the project (pip install -e '.[project,dev]') when pyproject.toml changed"
	@echo "make lint     ruff (lint and format check) and mypy over the whole tree; make test runs it first"
	@echo "make docs     regenerate docs/api.md from the API's OpenAPI schema (a test fails when it is stale)"
	@echo "make stop     stop any Redis/PostgreSQL/RabbitMQ that these scripts left running under .data/"
	@echo "make clean    stop them and delete .data/, staticfiles/ and caches"

venv:
	@bash scripts/venv.sh

run: venv
	@bash scripts/run.sh

test: venv
	@bash scripts/test.sh

# Workers on two hosts (Linux network namespaces) on one Redis; see docs/scaling.md.
test-scale: venv
	@bash scripts/scale.sh

# Celery's t/integration (fetched from the installed Celery's sdist, cached in .data/) on a real
# worker, tasks as @job and as shared_task; extra pytest arguments: COMPAT_ARGS="-k chord".
test-celery-compat: venv
	@bash scripts/celery-compat.sh $(COMPAT_ARGS)

# CI's half (.ci/run, after make test): @job only, against the committed control baselines: on
# Redis, then Celery's test_tasks.py on RabbitMQ (--broker amqp). Both run; either failing fails.
test-celery-compat-job: venv
	@rc=0; bash scripts/celery-compat.sh --half job --against-baseline $(COMPAT_ARGS) || rc=$$?; \
	amqp_rc=0; bash scripts/celery-compat.sh --broker amqp --half job --against-baseline $(COMPAT_ARGS) || amqp_rc=$$?; \
	if [ $$rc -eq 0 ]; then rc=$$amqp_rc; fi; exit $$rc

# Extra arguments for the suite, e.g. make bench BENCH_ARGS="--cases drain_pg,latency"
bench: venv
	@bash scripts/bench.sh

# Not part of make test or make bench: the peers install into .data/venv-peers, e.g.
# make bench-peers PEERS_ARGS="--sides backlot,dramatiq --scale 0.2"
bench-peers: venv
	@bash scripts/bench-peers.sh

lint: venv
	@bash scripts/lint.sh

docs: venv
	@.venv/bin/python manage.py api_docs

# The test services on their own, e.g. to run pytest by hand against them.
services-up:
	@bash scripts/services.sh redis-up redis://127.0.0.1:6390/0 .data/redis-test
	@bash scripts/services.sh postgres-up .data/pg 54329
	@bash scripts/services.sh rabbitmq-up amqp://guest:guest@127.0.0.1:5682// .data/rabbitmq-test
	@echo "export DATABASE_URL=postgres://backlot@127.0.0.1:54329/backlot REDIS_URL=redis://127.0.0.1:6390/0 BACKLOT_TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:5682//"

services-down stop:
	@bash scripts/services.sh redis-down .data/redis
	@bash scripts/services.sh redis-down .data/redis-test
	@bash scripts/services.sh postgres-down .data/pg
	@bash scripts/services.sh rabbitmq-down .data/rabbitmq-test

clean: stop
	rm -rf .data staticfiles .pytest_cache
	find . -path ./.venv -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
