"""Cancel on a real worker: a waiting job never runs, a running one stops (cooperatively at its
next progress call, or terminated with its child processes), the jobs it fanned out are
cancelled with it, and a revoke from `celery control` lands in the ledger."""

from __future__ import annotations

import os
import uuid
from functools import partial
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command

from config.celery import app as celery_app
from jobs import AlreadyFinished, JobHandle, cancel, enqueue_many
from jobs.broker.queues import queue_keys
from jobs.broker.redis import redis_client
from jobs.core.context import running
from jobs.flow.relay import job_relay
from jobs.models import AuditEntry, DeadLetter, Job, JobState
from tests.conftest import marks, wait_until
from tests.support import tasks


def state_of(job_id: str) -> str:
    return Job.objects.values_list("state", flat=True).get(id=job_id)


def test_cancelled_queued_and_scheduled_jobs_never_run(
    start_worker, clean_redis, transactional_db, unique
):
    # given a queued and a scheduled job on a queue no worker consumes yet
    queued = tasks.prioritized.enqueue(unique, "queued")
    scheduled = tasks.prioritized.using(delay=1).enqueue(unique, "scheduled")
    wait_until(lambda: Job.objects.filter(id=queued.id, published_at__isnull=False).exists())

    # when both are cancelled, the relay sweeps, and workers come and go
    assert cancel(queued.id).cancelled == [queued.id]
    assert cancel(scheduled.id).cancelled == [scheduled.id]
    job_relay()
    first = start_worker("cancel-a", queues="reports", concurrency=1)
    first.stop()
    second = start_worker("cancel-b", queues="reports", concurrency=1)

    # then their messages arrive and are dropped at claim: neither ever ran
    try:
        for handle in (queued, scheduled):

            def delivered(h: JobHandle = handle) -> bool:
                return Job.objects.get(id=h.id).deliveries >= 1

            wait_until(
                delivered,
                timeout=30,
                what="the cancelled job's message to be delivered and dropped",
            )
    finally:
        second.stop()  # `reports` is left to each test's own workers
        job = Job.objects.get(id=handle.id)
        assert job.state == JobState.CANCELLED and job.attempts == 0
    assert marks(unique) == []
    assert not DeadLetter.objects.filter(job_id_value__in=[queued.id, scheduled.id]).exists()


def test_a_running_job_stops_at_its_next_progress_call(worker, client, django_user_model, unique):
    owner = django_user_model.objects.create_user("owner", password="pw")
    stranger = django_user_model.objects.create_user("stranger", password="pw")
    handle = tasks.cooperative.using(owner=owner).enqueue(unique)
    wait_until(lambda: [v for _, v in marks(unique)] == ["started"], what="the job to start")

    client.force_login(stranger)
    assert client.post(f"/api/jobs/{handle.id}/cancel").status_code == 404
    client.force_login(owner)
    response = client.post(f"/api/jobs/{handle.id}/cancel")

    assert response.status_code == 202, response.content
    assert response.json()["requested"] == [handle.id]
    wait_until(lambda: state_of(handle.id) == JobState.CANCELLED, what="the run to stop")
    job = Job.objects.get(id=handle.id)
    assert [v for _, v in marks(unique)] == ["started", "stopped"]
    assert job.attempts == 1 and job.cancel_requested_at is not None
    assert not DeadLetter.objects.filter(job_id_value=handle.id).exists()
    again = client.post(f"/api/jobs/{handle.id}/cancel")
    assert again.status_code == 409 and again.json()["state"] == "cancelled"
    assert AuditEntry.objects.filter(action="cancel-api", user=owner).count() == 1


def test_cancelling_a_job_cancels_the_jobs_it_fanned_out(worker, django_user_model, unique):
    owner = django_user_model.objects.create_user("fanner", password="pw")
    parent = tasks.cooperative.using(owner=owner).enqueue(unique, children=3)
    wait_until(
        lambda: Job.objects.filter(parent_id=uuid.UUID(parent.id)).count() == 3, what="children"
    )
    children = list(Job.objects.filter(parent_id=uuid.UUID(parent.id)))
    # the children belong to the user the parent runs for
    assert {child.owner_id for child in children} == {owner.pk}

    outcome = cancel(parent.id)

    assert sorted(outcome.cancelled) == sorted(str(c.id) for c in children)
    assert outcome.requested == [parent.id]
    wait_until(lambda: state_of(parent.id) == JobState.CANCELLED, what="the parent to stop")
    assert set(
        Job.objects.filter(parent_id=uuid.UUID(parent.id)).values_list("state", flat=True)
    ) == {JobState.CANCELLED}
    with pytest.raises(AlreadyFinished, match="cancelled"):
        cancel(parent.id)


def test_terminate_stops_the_job_and_its_child_processes(worker, unique):
    handle = tasks.terminated.enqueue(unique)
    child_pid = int(
        wait_until(lambda: redis_client().get(f"test:{unique}:child"), what="the child process")
    )

    cancel(handle.id)

    wait_until(lambda: state_of(handle.id) == JobState.CANCELLED, timeout=10, what="cancelled")
    wait_until(lambda: not _alive(child_pid), timeout=5, what="the child process to be gone")
    assert not DeadLetter.objects.filter(job_id_value=handle.id).exists()
    # the run was killed before its child: its code never went on past child.wait()
    assert [value for _, value in marks(unique)] == ["started"]


def test_a_terminated_run_never_outlives_its_child_processes(worker, unique):
    # The job waits on its child (child.wait()): were the child killed before the job's pool
    # process, the job would go on and could record itself succeeded first (a flake once: the
    # worker's cancel then changed no row). Several rounds of two at once, to give a wrong
    # order its chance.
    for round_ in range(4):
        keys = [f"{unique}-{round_}-{i}" for i in range(2)]
        handles = [tasks.terminated.enqueue(key) for key in keys]
        for key in keys:
            wait_until(partial(marks, key), timeout=30, what=f"{key} to start")
        for handle in handles:
            cancel(handle.id)
        for handle in handles:
            wait_until(partial(_cancelled, handle.id), timeout=20, what="cancelled")
        for key in keys:
            assert [value for _, value in marks(key)] == ["started"], key


def _cancelled(job_id: str) -> bool:
    return state_of(job_id) == JobState.CANCELLED


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and os.path.exists(f"/proc/{pid}")


def test_a_revoke_from_celery_control_is_a_ledger_cancellation(worker, unique):
    handle = tasks.prioritized.enqueue(unique, "revoked")  # `reports`: nobody runs it

    celery_app.control.revoke(handle.id)

    # the broadcast reached a loaded worker 9-10 s after it was sent once in a full run
    wait_until(
        lambda: state_of(handle.id) == JobState.CANCELLED, timeout=30, what="the revoke to land"
    )


def test_cancel_command_and_admin_action(transactional_db, clean_redis, client, django_user_model):
    jobs = [tasks.prioritized.enqueue("cmd", str(i)) for i in range(3)]

    call_command("jobs", "cancel", "--queue", "reports", "--dry-run")
    assert {state_of(h.id) for h in jobs} == {JobState.QUEUED}
    call_command("jobs", "cancel", jobs[0].id)
    assert state_of(jobs[0].id) == JobState.CANCELLED

    staff = django_user_model.objects.create_user("op", password="pw", is_staff=True)
    client.force_login(staff)
    post = {"action": "cancel_selected", "_selected_action": [jobs[1].id]}
    assert client.post("/admin/jobs/job/", post).status_code == 403
    staff.user_permissions.add(
        Permission.objects.get(codename="cancel_job"),
        Permission.objects.get(codename="view_job"),
    )
    response = client.post("/admin/jobs/job/", post, follow=True)
    assert response.status_code == 200 and "1 job cancelled" in response.content.decode()
    assert state_of(jobs[1].id) == JobState.CANCELLED and state_of(jobs[2].id) == JobState.QUEUED
    assert AuditEntry.objects.filter(action="cancel", user=staff, count=1).exists()


def test_the_job_page_cancel_button(transactional_db, clean_redis, client, django_user_model):
    owner = django_user_model.objects.create_user("page-owner", password="pw")
    other = django_user_model.objects.create_user("page-other", password="pw")
    handle = tasks.prioritized.using(owner=owner).enqueue("page", "x")  # nobody runs `reports`

    client.force_login(other)
    assert client.post(f"/jobs/{handle.id}/cancel").status_code == 404
    client.force_login(owner)
    page = client.get(f"/jobs/{handle.id}/").content.decode()
    assert 'id="cancel"' in page

    response = client.post(f"/jobs/{handle.id}/cancel", follow=True)

    assert response.status_code == 200 and "Cancelled." in response.content.decode()
    assert state_of(handle.id) == JobState.CANCELLED
    assert 'id="cancel"' not in response.content.decode()  # a finished job has no button
    assert (
        "already finished" in client.post(f"/jobs/{handle.id}/cancel", follow=True).content.decode()
    )
    assert AuditEntry.objects.filter(action="cancel-page", user=owner).count() == 1


def test_a_job_enqueued_by_a_cancelled_job_is_born_cancelled(transactional_db, clean_redis):
    # given a running job that was asked to stop (a chord member whose callback comes next)
    parent = tasks.prioritized.enqueue("born", "parent")
    Job.objects.filter(id=parent.id).update(state=JobState.RUNNING, attempts=1)
    cancel(parent.id)

    # when it enqueues a child, one at a time and in bulk
    with running(parent.id, None):
        child = tasks.prioritized.enqueue("born", "child")
        bulk = enqueue_many(tasks.prioritized, [(("born", "bulk"), {})])

    # then the children are written cancelled and never published
    for job_id in (child.id, *bulk):
        job = Job.objects.get(id=job_id)
        assert job.state == JobState.CANCELLED and str(job.parent_id) == parent.id
        assert job.published_at is None
    assert sum(redis_client().llen(key) for key in queue_keys("reports")) == 1  # the parent's
