"""A job's durable steps as its owner and an operator see them: the status API's `steps`, the
job page's Steps table and the admin's inline (jobs.web.listing.step_documents). The steps
themselves run on a real worker in tests/jobs/worker/test_steps.py; here their rows are
written as a run leaves them: two finished, one failed with an email in its error, a sleep."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs.models import Job, JobState, JobStep, StepState


@pytest.fixture
def owner(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("steps-owner", password="not-used")


@pytest.fixture
def stepped_job(owner: Any) -> Job:
    now = timezone.now()
    job = Job.objects.create(
        task_name="tests.steps", queue="default", state=JobState.RETRYING, owner=owner,
        attempts=2, max_attempts=5, enqueued_at=now - timedelta(minutes=1),
        scheduled_for=now + timedelta(minutes=5),
    )  # fmt: skip
    started = now - timedelta(seconds=30)
    rows = [
        ("fetch", "step", StepState.SUCCEEDED, 1, "", {"rows": 3}, None),
        ("render", "step", StepState.SUCCEEDED, 1, "", "x" * 40, None),
        ("notify", "step", StepState.FAILED, 2, "SMTPError: no ann@example.com", None, None),
        ("cool-down", "sleep", StepState.SLEEPING, 1, "", None, now + timedelta(minutes=5)),
    ]  # fmt: skip
    for position, (name, kind, state, attempts, error, result, wake) in enumerate(rows):
        JobStep.objects.create(
            job=job, name=name, position=position, kind=kind, state=state, attempts=attempts,
            job_attempt=2, started_at=started, error=error, result=result,
            result_bytes=len(repr(result)) if result is not None else 0, wake_at=wake,
            finished_at=started + timedelta(seconds=1.5) if state == StepState.SUCCEEDED else None,
        )  # fmt: skip
    return job


def test_the_status_api_lists_the_steps_in_their_order(client, owner, stepped_job):
    client.force_login(owner)

    shown = client.get(f"/api/jobs/{stepped_job.id}/").json()

    steps = shown["steps"]
    assert [(s["name"], s["kind"], s["state"], s["attempts"]) for s in steps] == [
        ("fetch", "step", "succeeded", 1),
        ("render", "step", "succeeded", 1),
        ("notify", "step", "failed", 2),
        ("cool-down", "sleep", "sleeping", 1),
    ]
    assert steps[0]["duration_seconds"] == 1.5 and steps[0]["result_bytes"] > 0
    assert steps[3]["wake_at"] is not None and steps[3]["duration_seconds"] is None
    # the error is shown without the personal data in it
    assert "ann@example.com" not in steps[2]["error"] and "SMTPError" in steps[2]["error"]
    # a list does not read every job's steps
    listed = client.get("/api/jobs/").json()["items"]
    assert [item["steps"] for item in listed if item["job_id"] == str(stepped_job.id)] == [None]


def test_the_job_page_and_the_admin_show_the_steps(client, admin_client, owner, stepped_job):
    client.force_login(owner)

    page = client.get(f"/jobs/{stepped_job.id}/").content.decode()
    admin_page = admin_client.get(f"/admin/jobs/job/{stepped_job.id}/change/").content.decode()

    table = page[page.index('<table id="steps">') :]
    table = table[: table.index("</table>")]
    names = ("fetch", "render", "notify", "cool-down")
    at = [table.index(f'data-step="{name}"') for name in names]
    assert at == sorted(at)  # in the code's order
    assert "1.500 s" in table and "(sleep until" in table and "ann@example.com" not in table
    for name in ("fetch", "render", "notify", "cool-down"):
        assert name in admin_page
    assert "Job steps" in admin_page
    assert '"rows": 3' not in admin_page  # the stored result is shown by its size only
