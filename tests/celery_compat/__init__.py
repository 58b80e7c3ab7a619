"""Celery's own integration suite run against Backlot (`make test-celery-compat`).

Nothing here is collected by the project's pytest run (no conftest.py, no test_*.py):
scripts/celery-compat.sh fetches Celery's t/integration at run time and runs it with
tests/celery_compat/harness.py as its conftest; see docs/celery-compat.md.
"""
