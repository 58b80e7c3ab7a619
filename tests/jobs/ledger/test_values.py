"""jobs.ledger.values.insert_values: a new row's values prepared as Model.save() prepares them
(each field's pre_save() then get_db_prep_save()), value for value, whether the value takes
the shortcut (a str, an int, a UUID, an aware datetime, a dict or list) or not (a lazy string,
a bool, a UUID as text, a foreign key), on the test's database."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone
from django.utils.functional import lazy
from django_celery_results.models import TaskResult

from jobs.ledger.rows import new_job
from jobs.ledger.values import insert_values
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db


def comparable(value: Any) -> Any:
    """A prepared value as its driver would send it: psycopg's Jsonb wrapper as its object and
    dumps function, its typed ints (Int2, Int4...) with their type."""
    if hasattr(value, "obj") and hasattr(value, "dumps"):
        return ("jsonb", value.obj, value.dumps)
    return (type(value), value)


def djangos(instance: Any, db: Any) -> list[tuple[str, Any]]:
    """What Model.save(force_insert=True) prepares for `instance`: every concrete column (by
    name), its value through its field's pre_save() and get_db_prep_save(), with None left out
    where the column takes NULL (insert_values leaves those to the column's default)."""
    prepared = []
    for field in instance._meta.concrete_fields:
        value = field.pre_save(instance, True)
        if value is None and field.null:
            continue
        prepared.append((field.column, comparable(field.get_db_prep_save(value, db))))
    return prepared


def ours(instance: Any, db: Any) -> list[tuple[str, Any]]:
    columns, values = insert_values(instance, db)
    return [(column, comparable(v)) for column, v in zip(columns, values, strict=True)]


def test_a_plain_enqueues_row_is_prepared_as_djangos_save_prepares_it() -> None:
    db = connections[DEFAULT_DB_ALIAS]
    now = timezone.now()
    job = new_job(
        id=uuid.uuid4(),
        task_name="tests.add",
        args=[1, "two", {"three": [3.0, None]}],
        kwargs={"naïve": "ü"},
        queue="default",
        priority=5,
        idempotency_key="",
        state=JobState.QUEUED,
        max_attempts=3,
        enqueued_at=now,
        published_at=now,
        publish_options={"time_limit": 1.5},
        trace_context={"traceparent": "00-abc-01"},
    )

    assert ours(job, db) == djangos(job, db)
    assert [name for name, _ in ours(job, db)][:3] == ["id", "task_name", "args"]


def test_values_off_the_shortcut_are_prepared_by_their_field(admin_user) -> None:
    # given: a job whose values are not of the shortcut's exact types: a UUID as text, a lazy
    # string, a bool in an integer column, a foreign key, JSON that is a str, and the columns
    # of a running job
    db = connections[DEFAULT_DB_ALIAS]
    now = timezone.now()
    job = Job(
        id=str(uuid.uuid4()),
        task_name=lazy(lambda: "tests.lazy", str)(),
        args=["a"],
        kwargs={},
        queue="default",
        priority=True,
        owner=admin_user,
        state=JobState.RUNNING,
        attempts=2,
        enqueued_at=now,
        scheduled_for=now + timedelta(seconds=90),
        started_at=now,
        lease_owner=uuid.uuid4(),
        lease_expires_at=now + timedelta(seconds=30),
        run_seconds=0.25,
        progress_total=2**40,
        result="a str as JSON",
        failures=[{"error": "boom"}],
        publish_options={},
        trace_context={},
    )

    # then: value for value what Django's save prepares
    assert ours(job, db) == djangos(job, db)
    prepared = dict(ours(job, db))
    assert prepared["owner_id"][1] == admin_user.pk
    assert "finished_at" not in prepared  # None, nullable: left to the column's NULL


def test_a_field_that_sets_its_own_value_at_insert_keeps_doing_so() -> None:
    # given: a model of another app whose date columns are auto_now / auto_now_add, unset
    db = connections[DEFAULT_DB_ALIAS]
    row = TaskResult(task_id=str(uuid.uuid4()), status="SUCCESS", result="{}")
    assert row.date_done is None

    # when: its values are prepared
    columns, values = insert_values(row, db)
    prepared = dict(zip(columns, values, strict=True))

    # then: pre_save() set both to now, as save() does, and the rest is as Django prepares it
    assert prepared["date_done"] is not None and prepared["date_created"] is not None
    assert row.date_done is not None
    assert [name for name, _ in ours(row, db)] == [name for name, _ in djangos(row, db)]
