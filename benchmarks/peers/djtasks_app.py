"""django-tasks' jobs (peers venv only); workers: `django-admin db_worker`."""

from __future__ import annotations

from django_tasks import task

from benchmarks.peers import _stamp


@task()
def noop(i: int) -> None:
    """Nothing: what the drain measures is the queue."""


@task()
def stamp(key: str) -> None:
    _stamp.stamp(key)
