"""cancel() of a job that succeeded after fanning out (jobs.flow.cancellation): its active
descendants are cancelled, it reads cancelled, a second cancel and a job with nothing left are
AlreadyFinished; Job.shown_state says waiting_children meanwhile. Ledger rows on PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import AlreadyFinished, cancel
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db(transaction=True)


def row(state: str, *, parent: Job | None = None, **fields: Any) -> Job:
    now = timezone.now()
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "task_name": "tests.add",
        "queue": "reports",  # no session worker takes it
        "state": state,
        "parent": parent,
        "enqueued_at": now,
        "finished_at": now if state in (JobState.SUCCEEDED, JobState.CANCELLED) else None,
    }
    values.update(fields)
    return Job.objects.create(**values)


def test_a_parent_waits_on_its_children_and_its_cancel_reaches_them(clean_redis):
    parent = row(JobState.SUCCEEDED)
    done = row(JobState.SUCCEEDED, parent=parent)
    waiting = row(JobState.QUEUED, parent=parent)
    grandchild = row(JobState.SCHEDULED, parent=done)  # under a finished child
    assert parent.shown_state() == "waiting_children"

    outcome = cancel(parent.id)

    assert outcome.state == JobState.CANCELLED
    assert set(outcome.cancelled) == {str(waiting.id), str(grandchild.id)}
    for job in (waiting, grandchild):
        job.refresh_from_db()
        assert job.state == JobState.CANCELLED
    parent.refresh_from_db()
    assert parent.state == JobState.SUCCEEDED and parent.shown_state() == JobState.CANCELLED
    with pytest.raises(AlreadyFinished) as again:
        cancel(parent.id)
    assert again.value.state == JobState.CANCELLED


def test_a_cancel_requested_while_it_ran_does_not_make_a_success_read_cancelled(clean_redis):
    finished = timezone.now()
    parent = row(
        JobState.SUCCEEDED,
        finished_at=finished,
        cancel_requested_at=finished - timedelta(seconds=1),
    )
    assert parent.shown_state() == JobState.SUCCEEDED
    child = row(JobState.QUEUED, parent=parent)
    assert parent.shown_state() == "waiting_children"
    assert cancel(parent.id).cancelled == [str(child.id)]


def test_a_job_whose_work_has_ended_is_already_finished(clean_redis):
    parent = row(JobState.SUCCEEDED)
    row(JobState.SUCCEEDED, parent=parent)
    row(JobState.CANCELLED, parent=parent)
    assert parent.shown_state() == JobState.SUCCEEDED
    with pytest.raises(AlreadyFinished) as ended:
        cancel(parent.id)
    assert ended.value.state == JobState.SUCCEEDED
