"""jobs.ledger.succeed_unclaimed_many: the successes of several runs that did not write their
claim (DEFER_CLAIM), in one statement, each fenced as succeed_unclaimed fences one."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from jobs import ledger
from jobs.core.conf import backlot_settings
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db


def waiting(attempts: int = 0) -> Job:
    return Job.objects.create(
        id=uuid.uuid4(),
        task_name="tests.add",
        queue="reports",  # no session worker takes it
        state=JobState.QUEUED,
        attempts=attempts,
        enqueued_at=timezone.now(),
    )


def success(job: Job, attempts: int, result: object) -> ledger.Success:
    ended = timezone.now()
    return ledger.Success(
        str(job.id), attempts, str(uuid.uuid4()), ended - timedelta(seconds=2), ended, 2.0, result
    )


def test_waiting_rows_succeed_together_and_a_changed_row_is_left_as_it_is():
    # given three waiting rows, one of them cancelled since its run read it, and one whose
    # attempts are not those its run read
    rows = [waiting(), waiting(), waiting(attempts=1), waiting()]
    Job.objects.filter(id=rows[1].id).update(state=JobState.CANCELLED)
    successes = [
        success(rows[0], 0, {"sent": 3}),
        success(rows[1], 0, 1),
        success(rows[2], 0, 2),
        success(rows[3], 0, None),
    ]

    # when their successes are written together
    written = ledger.succeed_unclaimed_many(successes)

    # then the two rows as their runs read them succeeded, with each run's own start, end,
    # duration, token and result; the other two are unchanged
    assert written == {str(rows[0].id), str(rows[3].id)}
    for row, done in ((rows[0], successes[0]), (rows[3], successes[3])):
        job = Job.objects.get(id=row.id)
        assert (job.state, job.attempts, job.deliveries) == (JobState.SUCCEEDED, 1, 1)
        assert (job.started_at, job.finished_at) == (done.started, done.finished)
        assert (job.run_seconds, job.result, job.lease_expires_at) == (2.0, done.result, None)
        assert str(job.lease_owner) == done.lease_owner
    assert Job.objects.get(id=rows[1].id).state == JobState.CANCELLED
    assert Job.objects.values_list("state", "attempts").get(id=rows[2].id) == (
        JobState.QUEUED,
        1,
    )


def test_a_result_that_is_not_json_is_not_stored_and_the_success_is():
    row = waiting()
    assert ledger.succeed_unclaimed_many([success(row, 0, object())]) == {str(row.id)}
    job = Job.objects.get(id=row.id)
    assert (job.state, job.result) == (JobState.SUCCEEDED, None)


def test_nothing_to_write_writes_nothing():
    assert ledger.succeed_unclaimed_many([]) == set()


@pytest.mark.parametrize(
    "backlot", [{"SUCCESS_BATCH": 0}, {"SUCCESS_BATCH_SECONDS": 0}, {"SUCCESS_BATCH": -3}]
)
def test_a_success_batch_that_cannot_be_is_an_error_naming_it(settings, backlot):
    settings.BACKLOT = {**settings.BACKLOT, **backlot}
    with pytest.raises(ImproperlyConfigured, match="SUCCESS_BATCH"):
        backlot_settings()
