#!/usr/bin/env bash
# `make lint` (and the first step of `make test`): ruff lint, ruff format check, mypy, and
# import-linter's layers contract for jobs/ (.importlinter).
# Every tool runs even when an earlier one fails, so one pass shows every finding.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib.sh

TREE=(config jobs web emails reports media_pipeline tests benchmarks manage.py)
rc=0
log "ruff check"
.venv/bin/ruff check "${TREE[@]}" || rc=1
log "ruff format --check"
.venv/bin/ruff format --check "${TREE[@]}" || rc=1
log "mypy"
.venv/bin/mypy "${TREE[@]}" || rc=1
log "lint-imports (jobs/ layers)"
.venv/bin/lint-imports --no-cache || rc=1
exit "$rc"
