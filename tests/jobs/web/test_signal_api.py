"""POST /api/jobs/{id}/signal (issue 27 item 3): the owner's signal wakes the job parked in
wait_for() on a real worker; a second signal of the name is 409; another user's is 404; a
payload that is not small JSON is 400 and nothing is kept."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from django.contrib.auth.models import Permission

from jobs.models import Job, JobSignal, JobState
from tests.conftest import wait_until
from tests.jobs.worker.test_steps import TIMEOUT, ended, parked, step_worker  # noqa: F401
from tests.support import step_tasks


@pytest.fixture
def owner(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("signal-owner", password="not-used")


@pytest.fixture
def stranger(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("signal-stranger", password="not-used")


def send(client: Any, job_id: str, name: str, payload: Any = None) -> Any:
    return client.post(
        f"/api/jobs/{job_id}/signal",
        data=json.dumps({"name": name, "payload": payload}),
        content_type="application/json",
    )


def test_the_owners_signal_wakes_the_job_and_a_second_is_409(
    step_worker,  # noqa: F811 (the fixture of test_steps.py)
    client,
    owner,
    stranger,
    unique,
):
    # given: the owner's job parked in wait_for("approved") on a real worker
    step_worker()
    handle = step_tasks.waiter.using(owner=owner).enqueue(unique)
    wait_until(functools.partial(parked, handle.id), timeout=TIMEOUT, what="the job to wait")

    # when: another user signals it, then its owner does, twice
    client.force_login(stranger)
    theirs = send(client, handle.id, "approved", {"by": "stranger"})
    client.force_login(owner)
    first = send(client, handle.id, "approved", {"by": 7})
    second = send(client, handle.id, "approved", {"by": 8})

    # then: 404 for the stranger, 202 (woke) for the owner, 409 for the duplicate
    assert theirs.status_code == 404
    assert first.status_code == 202, first.content
    assert first.json() == {"job_id": handle.id, "name": "approved", "woke": True}
    # (refused as a second signal, or because the woken job has already finished)
    assert second.status_code == 409 and "signal 'approved'" in second.json()["detail"]
    # and the job resumes with the first payload
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")
    assert job.state == JobState.SUCCEEDED and job.result == {"by": 7}


def test_a_bad_signal_is_400_and_nothing_is_kept(client, owner, unique):
    handle = step_tasks.waiter.using(owner=owner).enqueue(unique)
    client.force_login(owner)

    empty_name = send(client, handle.id, "", "x")
    too_large = send(client, handle.id, "approved", "x" * 2_000_000)

    assert empty_name.status_code in (400, 422) and "name" in empty_name.content.decode()
    assert too_large.status_code in (400, 413)
    assert not JobSignal.objects.filter(job_id=handle.id).exists()
    assert Job.objects.get(id=handle.id).state == JobState.QUEUED


def test_the_admin_action_asks_for_the_event_then_sends_it_once(admin_client, owner, unique):
    handle = step_tasks.waiter.using(owner=owner).enqueue(unique)
    chosen = {"action": "signal_selected", "_selected_action": [handle.id]}

    # when: the action is chosen, then its page is filled in, twice
    asked = admin_client.post("/admin/jobs/job/", chosen)
    sent = admin_client.post(
        "/admin/jobs/job/", {**chosen, "apply": "1", "name": "approved", "payload": '{"by": 1}'},
        follow=True,
    )  # fmt: skip
    again = admin_client.post(
        "/admin/jobs/job/", {**chosen, "apply": "1", "name": "approved", "payload": "2"},
        follow=True,
    )  # fmt: skip

    # then: the page asks for the name and payload; the first is kept, the second refused
    assert asked.status_code == 200 and 'id="signal-form"' in asked.content.decode()
    assert "Signal approved sent to 1 job" in sent.content.decode()
    assert "already got signal &#x27;approved&#x27;" in again.content.decode()
    kept = JobSignal.objects.get(job_id=handle.id)
    assert kept.name == "approved" and kept.payload == {"by": 1}


def test_the_admin_action_needs_the_cancel_permission(client, django_user_model, unique):
    # a staff user who may read the job list, not cancel jobs
    staff = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_job"))
    handle = step_tasks.waiter.enqueue(unique)
    client.force_login(staff)
    assert client.get("/admin/jobs/job/").status_code == 200

    response = client.post(
        "/admin/jobs/job/", {"action": "signal_selected", "_selected_action": [handle.id]}
    )

    assert response.status_code == 403
    assert not JobSignal.objects.filter(job_id=handle.id).exists()
