"""A database that refuses one status: a real write failure for a job's work (IntegrityError,
which no retry policy retries), for the tests of what a dead job leaves its domain row."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, models


@contextmanager
def status_refused(model: type[models.Model], status: str) -> Iterator[None]:
    """Until the block ends, PostgreSQL refuses to write `status` into `model`'s rows: a CHECK
    constraint added NOT VALID (rows already there are not checked), dropped afterwards."""
    if not status.isidentifier():
        raise ValueError(f"not a status value: {status!r}")
    quote = connection.ops.quote_name
    table = model._meta.db_table
    name = f"test_refuses_{status}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"ALTER TABLE {quote(table)} ADD CONSTRAINT {quote(name)} "
            f"CHECK (status <> '{status}') NOT VALID"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {quote(table)} DROP CONSTRAINT IF EXISTS {quote(name)}")
