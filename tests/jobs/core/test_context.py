"""Context on every path: owner, queue, priority, idempotency key and per-call time limits
survive .delay()/.apply_async(), acting_as, jobs enqueued by a running job (canvas members,
callbacks, plain children), the Tasks API, and single and bulk replay; a group or chord sent
inside a transaction is published after commit. Real worker, real Redis and PostgreSQL."""

from __future__ import annotations

from typing import Any, cast

import pytest
from celery import chord, group
from celery.result import GroupResult
from django.db import transaction
from django.urls import path
from ninja import NinjaAPI

from jobs import acting_as, dead_letter_replay, dead_letter_replay_many
from jobs.broker.queues import queue_depths
from jobs.models import DeadLetter, DeadLetterStatus, Job, JobState
from tests.conftest import marks, wait_until
from tests.support import std_tasks, tasks
from web.auth import TokenAuth
from web.models import ApiToken

# A JSON API whose view enqueues with plain .delay() and no owner: the project's middleware and
# the bearer-token authentication decide whose job it is (mounted by the test that uses it).
token_api = NinjaAPI(auth=[TokenAuth()], urls_namespace="context-test")


@token_api.post("/add/")
def add_view(request: Any) -> dict[str, str]:
    return {"job_id": tasks.add.delay(2, 3).id}


urlpatterns = [path("api/", token_api.urls)]


def finished(job_id: str, timeout: float = 30) -> Job:
    job = wait_until(
        lambda: Job.objects.filter(
            id=job_id, state__in=[JobState.SUCCEEDED, JobState.DEAD]
        ).first(),
        timeout=timeout,
        what=f"job {job_id} to finish",
    )
    assert job is not None
    return job


def dead_letter_of(job_id: str, timeout: float = 30) -> DeadLetter:
    row = wait_until(
        lambda: DeadLetter.objects.filter(job_id_value=job_id).first(),
        timeout=timeout,
        what=f"the dead letter of job {job_id}",
    )
    assert row is not None
    return row


def sent_by(job_id: str) -> dict[str, Any]:
    """The ids a tests.fan_out job returned."""
    result = finished(job_id).result
    assert isinstance(result, dict), result
    return result


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("ines", password="not-used-here")


@pytest.fixture
def other_user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("tomas", password="not-used-here")


# --- .delay() / .apply_async() ---------------------------------------------------------------


def test_apply_async_keeps_owner_idempotency_key_queue_and_priority(worker, user, unique):
    # when
    first = tasks.add.apply_async(
        (2, 40), owner=user, idempotency_key=f"order-{unique}", queue="emails", priority=8
    )
    again = tasks.add.apply_async((2, 40), owner=user, idempotency_key=f"order-{unique}")

    # then: one job, the user's, on the asked queue and priority, run once
    assert again.id == first.id
    job = finished(first.id)
    assert job.state == JobState.SUCCEEDED and job.result == 42
    assert (job.owner, job.idempotency_key) == (user, f"order-{unique}")
    assert (job.queue, job.priority) == ("emails", 8)
    assert Job.objects.filter(idempotency_key=f"order-{unique}").count() == 1


def test_delay_inside_acting_as_belongs_to_the_user(worker, user):
    with acting_as(user):
        mine = tasks.add.delay(1, 2)
    nobodys = tasks.add.delay(3, 4)

    assert finished(mine.id).owner == user
    assert finished(nobodys.id).owner is None


@pytest.mark.urls("tests.jobs.core.test_context")
def test_a_request_authenticated_by_bearer_token_owns_what_its_view_enqueues(worker, client, user):
    # given: TokenAuth sets request.user only once the view is reached, after the middleware
    _, key = ApiToken.issue(user=user, name="ci")

    # when
    response = client.post("/api/add/", HTTP_AUTHORIZATION=f"Bearer {key}")

    # then
    assert response.status_code == 200, response.content
    job = finished(response.json()["job_id"])
    assert job.owner == user and job.result == 5


def test_standard_tasks_api_enqueued_for_a_user_belongs_to_them(worker, user, unique):
    with acting_as(user):
        result = std_tasks.record.enqueue(unique, "for ines")

    job = finished(result.id)
    assert job.state == JobState.SUCCEEDED and job.owner == user
    assert [value for _, value in marks(unique)] == ["for ines"]


# --- what a running job enqueues ---------------------------------------------------------------


def test_canvas_members_callback_and_children_belong_to_the_owner_of_the_job_that_sent_them(
    worker, user
):
    # given: a job of the user's that sends a chord, a group and a plain child job
    chorded = tasks.fan_out.using(owner=user).enqueue("chord")
    grouped = tasks.fan_out.using(owner=user).enqueue("group")

    # then: everything runs, with the right results
    sent = sent_by(chorded.id)
    assert [finished(member).result for member in sent["members"]] == [3, 7]
    callback = finished(sent["body"])
    assert callback.result == 10 and finished(sent["child"]).result == 11
    by_group = sent_by(grouped.id)
    assert [finished(member).result for member in by_group["members"]] == [3, 7]

    # and every job is the user's, a child of the job that enqueued it
    for parent, ids in ((chorded.id, sent), (grouped.id, by_group)):
        for job_id in [*ids["members"], ids["child"]]:
            job = Job.objects.get(id=job_id)
            assert (job.owner, str(job.parent_id)) == (user, parent), job_id
    # the callback is sent by the header member that finished last, once its run returned
    assert callback.owner == user
    assert str(callback.parent_id) in sent["members"]


def test_group_and_chord_sent_inside_a_transaction_publish_after_commit(worker):
    with transaction.atomic():
        grouped = group(tasks.add.si(1, 2), tasks.add.si(3, 4)).apply_async()
        chorded = chord([tasks.add.si(5, 6), tasks.add.si(7, 8)], tasks.total.s()).apply_async()
        # nothing is in Redis before the commit
        assert sum(queue_depths(["default"]).values()) == 0

    assert grouped.get(timeout=30) == [3, 7]
    assert chorded.get(timeout=30) == 26


def test_group_and_chord_rolled_back_send_nothing(worker):
    class RolledBack(Exception):
        pass

    with pytest.raises(RolledBack), transaction.atomic():
        # celery-types types a group's apply_async as returning an AsyncResult
        grouped = cast(GroupResult, group(tasks.add.si(1, 2), tasks.add.si(3, 4)).apply_async())
        chorded = chord([tasks.add.si(5, 6)], tasks.total.s()).apply_async()
        header = cast(GroupResult, chorded.parent)
        ids = [r.id for r in [*(grouped.results or []), *(header.results or []), chorded]]
        raise RolledBack

    # a job enqueued after it runs; by then nothing of the rolled-back canvas was sent or run
    assert finished(tasks.add.enqueue(1, 1).id).result == 2
    assert sum(queue_depths(["default"]).values()) == 0
    assert not Job.objects.filter(id__in=ids).exists()


# --- per-call time limits ----------------------------------------------------------------------


def test_a_per_call_time_limit_holds_for_the_retry(worker, unique):
    # when: the first run fails at once; the retry would sleep 30 s, past its 2 s limit
    sent = tasks.fails_then_hangs.apply_async((unique, 30), time_limit=2)

    # then: the retry is stopped by the per-call limit (the task has none of its own): its soft
    # limit, 90% of the hard one as @job sets it, raises in the job at 1.8 s
    job = finished(sent.id, timeout=25)
    assert job.state == JobState.DEAD and job.attempts == 2
    assert len(marks(unique)) == 2
    dead = DeadLetter.objects.get(job_id_value=sent.id)
    assert dead.exception_class == "jobs.core.policies.TimeLimitHit"
    assert job.run_seconds is not None and job.run_seconds < 5, job.run_seconds
    # the ledger row keeps both limits, so the relay's re-send of the job keeps them too
    assert job.publish_options == {"time_limit": 2, "soft_time_limit": 1.8}


def test_a_soft_limit_above_the_per_call_hard_limit_is_refused(db):
    with pytest.raises(ValueError, match="exceeds time_limit"):
        tasks.add.apply_async((1, 2), time_limit=2, soft_time_limit=3)


# --- replays ------------------------------------------------------------------------------------


def test_single_replay_keeps_the_queue_the_job_was_enqueued_on(worker, user, unique):
    # given: a dead letter of a job sent to "emails", not its task's default queue
    handle = tasks.refused.using(queue="emails", owner=user, priority=7).enqueue(unique, "x@y.z")
    dead = dead_letter_of(handle.id)
    assert (dead.queue, dead.owner) == ("emails", user)

    # when
    replay = dead_letter_replay(dead_letter=dead)

    # then: the new job was queued, and delivered, on "emails", for the same owner and priority
    again = dead_letter_of(replay.id)
    job = Job.objects.get(id=replay.id)
    assert (job.queue, job.owner, job.priority) == ("emails", user, 7)
    assert again.queue == "emails"  # read from the delivery's routing key on the worker
    assert len(marks(unique)) == 2


def test_bulk_replay_keeps_queue_and_owner(worker, user, other_user, unique):
    # given: dead letters of two owners on two queues, none of them the task's default queue
    sent = [
        tasks.refused.using(queue="emails", owner=user).enqueue(f"{unique}-a", "a@y.z"),
        tasks.refused.using(queue="media", owner=other_user).enqueue(f"{unique}-b", "b@y.z"),
        tasks.refused.using(queue="emails", owner=other_user).enqueue(f"{unique}-c", "c@y.z"),
    ]
    dead = [dead_letter_of(handle.id) for handle in sent]

    # when
    outcome = dead_letter_replay_many(
        queryset=DeadLetter.objects.filter(pk__in=[d.pk for d in dead])
    )

    # then: each replay has its dead letter's queue and owner, and ran there
    assert outcome.done == 3 and not outcome.errors
    for row in dead:
        row.refresh_from_db()
        assert row.status == DeadLetterStatus.REPLAYED
        job = Job.objects.get(replay_of=row)
        assert (job.queue, job.owner_id) == (row.queue, row.owner_id)
        assert dead_letter_of(str(job.id)).queue == row.queue
    assert [(d.queue, d.owner) for d in dead] == [
        ("emails", user),
        ("media", other_user),
        ("emails", other_user),
    ]
