"""Jobs of the SQLite suite; its workers import this module (-I) besides tests.support.tasks."""

from __future__ import annotations

import os

from django.contrib.auth.models import Group

from jobs.core.policies import RetryPolicy
from jobs.worker.decorators import job
from tests.support.tasks import mark, wait_for_flag


@job(name="tests.sqlite.note")
def note(key: str, label: str) -> str:
    """Records which pool process ran it."""
    mark(key, f"{label}:{os.getpid()}")
    return label


@job(name="tests.sqlite.write_when_told", retry=RetryPolicy(max_attempts=1))
def write_when_told(key: str, name: str) -> str:
    """Waits for the test's flag, then writes a domain row: a write that meets the test's lock
    on the database. One attempt only: a busy database counted as a failure would kill it."""
    mark(key, f"started:{name}")
    wait_for_flag(key, timeout=60)
    Group.objects.get_or_create(name=name)
    mark(key, f"wrote:{name}")
    return name
