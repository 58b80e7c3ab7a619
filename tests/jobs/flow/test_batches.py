"""Batches: counters that move with each member's finish, callbacks that fire exactly once.

With a real worker (real Redis, real PostgreSQL): a 1,000-member batch with 3 permanent
failures (on_death once, on_complete once, on_success never; replayed after the fix: on_success
once), the same with kill -9 of the worker mid-batch, nested batches and a member that adds
jobs, an empty batch, a cancelled batch. BACKLOT_TEST_BATCH_SIZE makes the first larger.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest
from celery import signature
from django.contrib.auth.models import Permission
from django.db import connection
from django.utils import timezone

import jobs
from jobs import ledger
from jobs.broker.redis import redis_client
from jobs.enqueue.fanout import enqueue_many
from jobs.flow.batches import batch_cancel, batch_replay_dead
from jobs.flow.relay import job_relay
from jobs.ledger.batch import callback_job_id
from jobs.models import Batch, BatchState, DeadLetter, DeadLetterStatus, Job, JobState
from jobs.testing import run_job
from tests.conftest import marks, wait_until
from tests.support import tasks

SIZE = int(os.environ.get("BACKLOT_TEST_BATCH_SIZE", "1000"))
KILL_SIZE = 300


def callbacks(key: str) -> dict[str, Any]:
    return {
        "on_success": tasks.batch_callback.s(key, "success"),
        "on_complete": tasks.batch_callback.s(key, "complete"),
        "on_death": tasks.batch_callback.s(key, "death"),
    }


def fired(key: str) -> dict[str, list[str]]:
    """The batch ids each callback kind ran with, once per run."""
    return {
        kind: [v for _, v in marks(f"{key}:{kind}")] for kind in ("success", "complete", "death")
    }


def member_states(batch: Batch) -> dict[str, int]:
    """The members' states counted from their own rows (replays in their dead member's place)."""
    counts: dict[str, int] = {}
    for state in (
        Job.objects.filter(batch=batch)
        .exclude(state=JobState.DEAD, dead_letter__status=DeadLetterStatus.REPLAYED)
        .values_list("state", flat=True)
    ):
        counts[state] = counts.get(state, 0) + 1
    return counts


def assert_counters_match_members(batch: Batch) -> None:
    batch.refresh_from_db()
    rows = member_states(batch)
    assert batch.succeeded == rows.get(JobState.SUCCEEDED, 0), (batch.succeeded, rows)
    assert batch.dead == rows.get(JobState.DEAD, 0), (batch.dead, rows)
    assert batch.cancelled == rows.get(JobState.CANCELLED, 0), (batch.cancelled, rows)
    assert batch.total == sum(rows.values())
    assert batch.pending == batch.total - batch.succeeded - batch.dead - batch.cancelled


def open_batch(
    key: str, size: int, failing: set[int], queue: str | None = None, **member: Any
) -> Batch:
    """A batch of `size` members, those in `failing` sent with .apply_async, the rest in bulk."""
    with jobs.batch(description=f"test {key}", **callbacks(key)) as batch:
        enqueue_many(
            tasks.batch_member,
            [((key, i), member) for i in range(size) if i not in failing],
            queue=queue,
        )
        for i in sorted(failing):
            tasks.batch_member.apply_async((key, i), {"fails": True, **member}, queue=queue)
    return batch


def replay_after_the_fix(key: str, batch: Batch, expected: int = 3) -> None:
    """Fix the failing members' cause, then replay the batch's dead members (`expected` of
    them; 0: the fix only)."""
    redis_client().set(f"test:flag:fixed:{key}", 1, ex=300)
    if expected:
        outcome = batch_replay_dead(batch=batch)
        assert outcome.done == expected, outcome


# --- the 1,000-member batch -----------------------------------------------------------------
def test_a_batch_with_three_permanent_failures_fires_each_callback_once(worker, unique):
    failing = {SIZE // 4, SIZE // 2, SIZE - 1}

    # given a batch with 3 members that fail permanently
    batch = open_batch(unique, SIZE, failing)
    # (as the block's transaction committed them; a worker may have finished some since)
    assert (batch.total, batch.pending, batch.state) == (SIZE, SIZE, BatchState.RUNNING)

    # when every member has ended
    wait_until(lambda: fired(unique)["complete"], timeout=240, interval=0.2, what="on_complete")

    # then on_death fired once, on_complete once, on_success never
    time.sleep(1)  # a duplicate would run right behind the first
    runs = fired(unique)
    assert runs["death"] == [str(batch.id)] and runs["complete"] == [str(batch.id)]
    assert runs["success"] == []
    assert not Job.objects.filter(id=callback_job_id(batch.id, "on_success")).exists()
    batch.refresh_from_db()
    assert (batch.state, batch.succeeded, batch.dead, batch.pending) == (
        BatchState.COMPLETE,
        SIZE - 3,
        3,
        0,
    )
    assert_counters_match_members(batch)

    # when the 3 are replayed from the dead letters once their cause is fixed
    replay_after_the_fix(unique, batch)
    wait_until(lambda: fired(unique)["success"], timeout=60, interval=0.2, what="on_success")

    # then on_success fired once, and nothing else again
    time.sleep(1)
    runs = fired(unique)
    assert runs == {
        "success": [str(batch.id)],
        "complete": [str(batch.id)],
        "death": [str(batch.id)],
    }
    batch.refresh_from_db()
    assert (batch.state, batch.succeeded, batch.dead, batch.total) == (
        BatchState.SUCCEEDED,
        SIZE,
        0,
        SIZE,
    )
    assert_counters_match_members(batch)


# --- kill -9 mid-batch ----------------------------------------------------------------------
KILL_ENV = {
    # a killed worker's claims lapse in 3 s and its unacknowledged messages come back in 10 s
    "BACKLOT_LEASE_SECONDS": "3",
    "CELERY_VISIBILITY_TIMEOUT": "10",
    "BACKLOT_MAX_BROKER_COUNTDOWN": "5",
    "BACKLOT_RATE_LIMIT_MAX_RESERVE": "1",
}


class Relays:
    """Two relays sweeping at once, as two beat hosts would (each its own connection)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(2)]
        for thread in self.threads:
            thread.start()

    def loop(self) -> None:
        try:
            while not self.stop.is_set():
                job_relay()
                self.stop.wait(0.5)
        finally:
            connection.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def test_kill_9_of_the_worker_mid_batch_still_fires_every_callback_once(
    start_worker, clean_redis, transactional_db, unique
):
    # the failures come last, so that the kill lands among members, not callbacks
    failing = {KILL_SIZE - 3, KILL_SIZE - 2, KILL_SIZE - 1}
    # the members go to `reports`, which only this test's workers consume: the kill hits them
    first = start_worker("batch-kill-a", queues="reports", concurrency=2, **KILL_ENV)
    batch = open_batch(unique, KILL_SIZE, failing, queue="reports", seconds=0.03)
    relays = Relays()
    try:
        # when a third of the members have ended and two run, the whole worker is killed
        wait_until(
            lambda: Batch.objects.get(id=batch.id).pending <= KILL_SIZE * 2 // 3,
            timeout=120,
            interval=0.05,
            what="a third of the batch",
        )
        wait_until(
            lambda: Job.objects.filter(batch=batch, state=JobState.RUNNING).exists(),
            timeout=10,
            interval=0.005,
            what="a running member",
        )
        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait(timeout=10)
        stranded = list(
            Job.objects.filter(batch=batch, state=JobState.RUNNING).values_list("id", flat=True)
        )
        second = start_worker("batch-kill-b", queues="reports,default", concurrency=2, **KILL_ENV)

        # then the batch completes: on_death and on_complete once each, on_success never
        wait_until(lambda: fired(unique)["complete"], timeout=150, interval=0.2, what="on_complete")
        time.sleep(1.5)
        runs = fired(unique)
        assert runs == {"success": [], "complete": [str(batch.id)], "death": [str(batch.id)]}
        assert stranded, "the kill hit no running member; the test proved nothing"
        assert Job.objects.filter(id__in=stranded, attempts__gte=2).count() == len(stranded)
        batch.refresh_from_db()
        assert (batch.state, batch.succeeded, batch.dead) == (
            BatchState.COMPLETE,
            KILL_SIZE - 3,
            3,
        )
        assert_counters_match_members(batch)

        # and after the fix and the replay, on_success once
        replay_after_the_fix(unique, batch)
        wait_until(lambda: fired(unique)["success"], timeout=60, interval=0.2, what="on_success")
        time.sleep(1.5)
        assert fired(unique) == {
            "success": [str(batch.id)],
            "complete": [str(batch.id)],
            "death": [str(batch.id)],
        }
        # one job per callback, however many relays swept and finishes were redelivered
        for kind in ("on_success", "on_complete", "on_death"):
            assert Job.objects.get(id=callback_job_id(batch.id, kind)).state == JobState.SUCCEEDED
        assert_counters_match_members(batch)
    finally:
        relays.close()
    second.stop()  # the other tests' worker is enough for them


# --- nesting, adding, empty, cancel ---------------------------------------------------------
def test_nested_batches_and_a_member_that_adds_jobs(worker, unique):
    # given a batch whose members add 4 members to it and open a child batch of 3
    with jobs.batch(description="parent", **callbacks(unique)) as parent:
        tasks.batch_adder.enqueue(unique, 4)
        tasks.batch_nester.enqueue(unique, 3)
        tasks.batch_member.enqueue(unique, 1)

    # when everything has run
    wait_until(lambda: fired(unique)["success"], timeout=60, interval=0.1, what="parent success")

    # then the parent counted the added members, and completed only after its child
    parent.refresh_from_db()
    child = Batch.objects.get(parent=parent)
    # (the child's callback job was written with the parent's: either may run first)
    child_done = wait_until(lambda: marks(f"{unique}:child_complete"), what="child on_complete")
    assert [v for _, v in child_done] == [str(child.id)]
    assert (parent.total, parent.succeeded, parent.state) == (3 + 4, 7, BatchState.SUCCEEDED)
    assert (child.total, child.succeeded, child.state) == (3, 3, BatchState.SUCCEEDED)
    finished = [j.finished_at for j in Job.objects.filter(batch=child) if j.finished_at]
    assert len(finished) == 3
    assert child.completed_at is not None and parent.completed_at is not None
    assert child.completed_at >= max(finished)
    assert parent.completed_at >= child.completed_at
    assert fired(unique)["complete"] == [str(parent.id)]
    assert_counters_match_members(parent)


def test_an_empty_batch_completes_and_succeeds_at_once(worker, unique):
    with jobs.batch(description="nothing to do", **callbacks(unique)) as batch:
        pass

    batch.refresh_from_db()
    assert (batch.state, batch.total) == (BatchState.SUCCEEDED, 0)
    wait_until(
        lambda: fired(unique)["success"] and fired(unique)["complete"],
        timeout=30,
        what="both callbacks",
    )
    assert fired(unique) == {"success": [str(batch.id)], "complete": [str(batch.id)], "death": []}


def test_cancel_a_batch(worker, unique):
    # given a batch of 40 slow members, some of them running
    with jobs.batch(description="to cancel", **callbacks(unique)) as batch:
        for i in range(40):
            tasks.batch_member.enqueue(unique, i, seconds=0.5)
    wait_until(
        lambda: Job.objects.filter(batch=batch, state=JobState.RUNNING).exists(),
        what="a running member",
    )

    # when it is cancelled
    done, ended = batch_cancel(batch=batch)

    # then the members that had not ended are cancelled, and the batch completes once
    wait_until(lambda: fired(unique)["complete"], timeout=30, what="on_complete")
    batch.refresh_from_db()
    assert batch.state == BatchState.COMPLETE and batch.cancel_requested_at is not None
    assert batch.cancelled >= 20 and batch.succeeded + batch.cancelled == 40, batch.__dict__
    assert done >= 20 and done + ended == 40
    time.sleep(1)
    assert fired(unique) == {"success": [], "complete": [str(batch.id)], "death": []}
    assert_counters_match_members(batch)


# --- without a worker: atomicity, a redelivered finish, bad input --------------------------
@pytest.mark.django_db
def test_all_members_are_accepted_or_none(unique):
    with pytest.raises(RuntimeError), jobs.batch(description="half"):
        tasks.batch_member.enqueue(unique, 1)
        enqueue_many(tasks.batch_member, [((unique, 2), {}), ((unique, 3), {})])
        raise RuntimeError("the caller fails half way")

    assert not Batch.objects.filter(description="half").exists()
    assert not Job.objects.filter(task_name="tests.batch_member", args__0=unique).exists()


@pytest.mark.django_db
def test_a_redelivered_finish_moves_the_counters_once(unique):
    with jobs.batch(**callbacks(unique)) as batch:
        first = tasks.batch_member.enqueue(unique, 1)
        second = tasks.batch_member.enqueue(unique, 2)

    run_job(first)
    job = Job.objects.get(id=first.id)
    # the same finish again (a redelivered message, a second worker's late write)
    assert run_job(first).state == JobState.SUCCEEDED
    assert not ledger.succeed(job_id=first.id, attempt=job.attempts, run_seconds=0.1)
    batch.refresh_from_db()
    assert (batch.pending, batch.succeeded) == (1, 1)

    run_job(second)
    run_job(second)
    batch.refresh_from_db()
    assert (batch.pending, batch.succeeded, batch.state) == (0, 2, BatchState.SUCCEEDED)
    callback_jobs = Job.objects.filter(task_name="tests.batch_callback", args__0=str(batch.id))
    assert sorted(j.id for j in callback_jobs) == sorted(
        callback_job_id(batch.id, kind) for kind in ("on_success", "on_complete")
    )
    assert all(j.args == [str(batch.id), unique, j.args[2]] for j in callback_jobs)


@pytest.mark.django_db
def test_nested_blocks_make_a_child_batch(unique):
    with jobs.batch(description="outer") as outer:
        tasks.batch_member.enqueue(unique, 1)
        with jobs.batch(description="inner") as inner:
            tasks.batch_member.enqueue(unique, 2)
            tasks.batch_member.enqueue(unique, 3)

    outer.refresh_from_db()
    inner.refresh_from_db()
    assert inner.parent_id == outer.id
    assert (outer.total, inner.total, outer.children_pending) == (1, 2, 1)


@pytest.mark.django_db
def test_bad_input_is_refused_with_a_clear_error(unique):
    with (
        pytest.raises(TypeError, match="on_success must be a job signature"),
        jobs.batch(on_success="not a job"),
    ):
        pass
    with (
        pytest.raises(jobs.UnknownTask),
        jobs.batch(on_complete=signature("no.such", args=(unique,))),
    ):
        pass
    with pytest.raises(ValueError, match="track=False"), jobs.batch():
        tasks.record_untracked.enqueue(unique)
    with pytest.raises(ValueError, match="not a batch id"), jobs.batch("nope"):
        pass
    with jobs.batch() as empty:
        pass
    with pytest.raises(jobs.BatchEnded, match="has ended"), jobs.batch(empty.id):
        pass
    with (
        pytest.raises(ValueError, match="callbacks were set when it was opened"),
        jobs.batch(empty, on_success=tasks.batch_callback.s(unique, "x")),
    ):
        pass
    assert not Batch.objects.exclude(id=empty.id).exists()


# --- the API, the admin, the job page -------------------------------------------------------
@pytest.fixture
def owner(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("batch-owner", password="pw-owner-123")


@pytest.fixture
def owned_batch(owner: Any, unique: str) -> Batch:
    with jobs.acting_as(owner), jobs.batch(description="owned", **callbacks(unique)) as batch:
        enqueue_many(tasks.batch_member, [((unique, i), {}) for i in range(4)])
        tasks.batch_member.enqueue(unique, 4, fails=True)
    return batch


@pytest.mark.django_db
def test_the_api_shows_a_batch_to_its_owner_and_staff_with_members_in_pages(
    client, admin_user, django_user_model, owner, owned_batch, unique
):
    url = f"/api/batches/{owned_batch.id}/"
    assert client.get(url).status_code == 401
    client.force_login(owner)

    # the first page: counters, state, two members in the order they joined
    body = client.get(url, {"limit": 2}).json()
    assert body["batch_id"] == str(owned_batch.id) and body["state"] == "running"
    assert body["counters"] == {
        "total": 5,
        "pending": 5,
        "succeeded": 0,
        "dead": 0,
        "cancelled": 0,
        "children_pending": 0,
    }
    assert body["percent"] == 0.0 and body["description"] == "owned"
    seen = [item["job_id"] for item in body["members"]["items"]]
    while body["members"]["next_cursor"]:
        body = client.get(url, {"limit": 2, "cursor": body["members"]["next_cursor"]}).json()
        seen += [item["job_id"] for item in body["members"]["items"]]
    joined = Job.objects.filter(batch=owned_batch).order_by("enqueued_at", "id")
    assert seen == [str(j.id) for j in joined] and len(seen) == 5

    # a member that ended shows in the counters
    last = joined.last()
    assert last is not None
    run_job(str(last.id))  # the failing one: dead
    body = client.get(url, {"state": "dead"}).json()
    assert body["counters"]["dead"] == 1 and body["first_death_at"]
    assert [i["job_id"] for i in body["members"]["items"]] == [str(last.id)]

    # bad input is a 400 naming it; other users' and unknown batches are 404; staff read any
    assert "limit" in client.get(url, {"limit": 0}).json()["detail"]
    assert client.get(url, {"cursor": "forged"}).status_code == 400
    assert client.get(url, {"state": "nope"}).status_code == 400
    assert client.get("/api/batches/not-a-uuid/").status_code == 404
    stranger = django_user_model.objects.create_user("stranger", password="pw-stranger-123")
    client.force_login(stranger)
    assert client.get(url).status_code == 404
    client.force_login(admin_user)
    assert client.get(url).status_code == 200


@pytest.mark.django_db
def test_a_member_shows_its_batch_on_its_job_page(client, owner, owned_batch):
    member = Job.objects.filter(batch=owned_batch).first()
    assert member is not None
    client.force_login(owner)
    page = client.get(f"/jobs/{member.id}/").content.decode()
    assert 'id="batch"' in page and "owned" in page and "0 of 5 ended" in page
    assert f"/api/batches/{owned_batch.id}/" in page


@pytest.mark.django_db
def test_admin_lists_batches_shows_members_and_replays_and_cancels(
    admin_client, owned_batch, unique
):
    failing = Job.objects.get(batch=owned_batch, kwargs__fails=True)
    run_job(str(failing.id))  # dead
    assert admin_client.get("/admin/jobs/batch/").status_code == 200
    detail = admin_client.get(f"/admin/jobs/batch/{owned_batch.id}/change/").content.decode()
    assert 'id="batch-members"' in detail and str(failing.id) in detail

    # replay its dead members: the replay takes the dead member's place, pending again
    response = admin_client.post(
        "/admin/jobs/batch/",
        {"action": "replay_dead_members", "_selected_action": [str(owned_batch.id)]},
    )
    assert response.status_code == 302
    owned_batch.refresh_from_db()
    assert (owned_batch.dead, owned_batch.pending, owned_batch.total) == (0, 5, 5)

    # cancel its members that have not ended: the batch completes
    admin_client.post(
        "/admin/jobs/batch/",
        {"action": "cancel_pending_members", "_selected_action": [str(owned_batch.id)]},
    )
    owned_batch.refresh_from_db()
    assert (owned_batch.cancelled, owned_batch.pending, owned_batch.state) == (
        5,
        0,
        BatchState.COMPLETE,
    )
    assert owned_batch.cancel_requested_at is not None
    assert_counters_match_members(owned_batch)
    assert Job.objects.filter(id=callback_job_id(owned_batch.id, "on_complete")).exists()


@pytest.mark.django_db
def test_admin_actions_need_their_permissions(client, django_user_model, owned_batch):
    viewer = django_user_model.objects.create_user(
        "viewer", password="pw-viewer-123", is_staff=True
    )
    viewer.user_permissions.add(Permission.objects.get(codename="view_batch"))
    client.force_login(viewer)
    assert client.get("/admin/jobs/batch/").status_code == 200
    for action in ("replay_dead_members", "cancel_pending_members"):
        response = client.post(
            "/admin/jobs/batch/", {"action": action, "_selected_action": [str(owned_batch.id)]}
        )
        assert response.status_code == 403
    owned_batch.refresh_from_db()
    assert owned_batch.cancelled == 0


# --- the platform's fan-outs on batches -----------------------------------------------------
def test_bulk_replay_from_the_admin_is_followed_by_its_batch(worker, admin_client, unique):
    # given 20 dead letters, and a dead member of another batch among them
    now = timezone.now()
    for i in range(20):
        DeadLetter.objects.create(
            job_id_value=str(uuid.uuid4()),
            task_name="tests.batch_member",
            args=[unique, i],
            kwargs={},
            queue="default",
            exception_class="ConnectionError",
            exception_message="down",
            first_failed_at=now,
            last_failed_at=now,
        )
    with jobs.batch(description="other", **callbacks(unique)) as other:
        dead_member = tasks.batch_member.enqueue(unique, 99, fails=True)
    wait_until(lambda: fired(unique)["complete"], what="the other batch to complete")
    replay_after_the_fix(unique, other, expected=0)  # (the fix only: the admin replays it)

    # when an operator replays all of them from the admin
    response = admin_client.post(
        "/admin/jobs/deadletter/replay-matching/", {"task_name__exact": "tests.batch_member"}
    )
    job_id = response["Location"].split("/")[-2]

    # then the replays are the members of the replay job's batch, whose counters are the
    # progress; the dead member's replay went back to its own batch, which now succeeds
    replay = Job.objects.get(id=job_id)
    assert replay.batch is not None
    progress = replay.batch
    wait_until(
        lambda: Batch.objects.get(id=progress.id).state == BatchState.SUCCEEDED,
        timeout=60,
        what="the replay batch",
    )
    progress.refresh_from_db()
    assert (progress.total, progress.succeeded) == (1 + 20, 21)
    assert progress.description == "Replay of 21 dead letters"
    wait_until(lambda: fired(unique)["success"], timeout=30, what="the other batch's success")
    other.refresh_from_db()
    assert (other.state, other.total, other.succeeded, other.dead) == (
        BatchState.SUCCEEDED,
        1,
        1,
        0,
    )
    assert Job.objects.filter(replay_of__job_id=dead_member.id, batch=other).count() == 1
    page = admin_client.get(f"/jobs/{job_id}/").content.decode()
    assert 'id="batch"' in page and "21 of 21 ended" in page


@pytest.mark.django_db
def test_one_signature_as_on_complete_and_on_success_runs_once_when_both_are_due(unique):
    settle = tasks.batch_callback.s(unique, "settle")

    # all succeed: both are due at once, one job
    with jobs.batch(on_complete=settle, on_success=settle) as clean:
        member = tasks.batch_member.enqueue(unique, 1)
    run_job(member)
    settled = Job.objects.filter(task_name="tests.batch_callback", args__0=str(clean.id))
    assert [j.id for j in settled] == [callback_job_id(clean.id, "on_complete")]

    # one dead, replayed later and succeeding: on_complete first, on_success after
    with jobs.batch(on_complete=settle, on_success=settle) as later:
        failing = tasks.batch_member.enqueue(unique, 2, fails=True)
    run_job(failing)
    redis_client().set(f"test:flag:fixed:{unique}", 1, ex=60)
    replay = jobs.dead_letter_replay(dead_letter=DeadLetter.objects.get(job_id_value=failing.id))
    run_job(replay)
    settled = Job.objects.filter(task_name="tests.batch_callback", args__0=str(later.id))
    assert sorted(j.id for j in settled) == sorted(
        [callback_job_id(later.id, "on_complete"), callback_job_id(later.id, "on_success")]
    )
    later.refresh_from_db()
    assert (later.state, later.total, later.succeeded, later.dead) == (
        BatchState.SUCCEEDED,
        1,
        1,
        0,
    )
