"""Dead letters and the job ledger in Django admin."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from jobs.models import DeadLetter, DeadLetterStatus, Job
from tests.support import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def dead_letter(**fields) -> DeadLetter:
    now = timezone.now()
    values = dict(
        job_id_value=uuid.uuid4(), task_name="tests.prioritized", args=["k", "replayed"], kwargs={},
        queue="reports", exception_class="jobs.policies.Permanent", exception_message="nope",
        traceback="Traceback (most recent call last):\n  boom", first_failed_at=now, last_failed_at=now,
    )
    values.update(fields)
    return DeadLetter.objects.create(**values)


def test_dead_letter_list_and_detail_render(admin_client):
    row = dead_letter()

    listing = admin_client.get("/admin/jobs/deadletter/")
    detail = admin_client.get(f"/admin/jobs/deadletter/{row.pk}/change/")

    assert listing.status_code == 200 and b"tests.prioritized" in listing.content
    assert detail.status_code == 200
    assert b"<pre>Traceback (most recent call last):" in detail.content


def test_replay_action_enqueues_a_linked_job(admin_client, admin_user, clean_redis):
    row = dead_letter()

    response = admin_client.post(
        "/admin/jobs/deadletter/",
        {"action": "replay_selected", "_selected_action": [row.pk]},
        follow=True,
    )

    assert b"1 dead letter replayed." in response.content
    row.refresh_from_db()
    assert row.status == DeadLetterStatus.REPLAYED and row.resolved_by == admin_user
    job = Job.objects.get(id=row.replayed_job_id)
    assert job.task_name == "tests.prioritized" and job.args == ["k", "replayed"]
    assert job.replay_of_id == row.pk


def test_discard_action_marks_rows(admin_client):
    rows = [dead_letter(), dead_letter()]

    response = admin_client.post(
        "/admin/jobs/deadletter/",
        {"action": "discard_selected", "_selected_action": [r.pk for r in rows]},
        follow=True,
    )

    assert b"2 dead letters discarded." in response.content
    assert set(DeadLetter.objects.values_list("status", flat=True)) == {DeadLetterStatus.DISCARDED}


def test_job_ledger_is_read_only(admin_client, clean_redis):
    handle = tasks.prioritized.enqueue("k", "a")

    assert admin_client.get("/admin/jobs/job/").status_code == 200
    assert admin_client.get(f"/admin/jobs/job/{handle.id}/change/").status_code == 200
    assert admin_client.get("/admin/jobs/job/add/").status_code == 403
