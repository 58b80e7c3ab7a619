"""A job's life on a real worker: success, retries with backoff, give-up, replay, effects."""

from __future__ import annotations

from itertools import pairwise

import pytest

from jobs import dead_letter_replay
from jobs.core.exceptions import ReplayError, UnknownTask
from jobs.models import DeadLetter, DeadLetterStatus, Effect, Job, JobState
from tests.conftest import marks, set_flag, wait_until
from tests.support import tasks


def finished(job_id: str, timeout: float = 30) -> Job:
    return wait_until(
        lambda: Job.objects.filter(
            id=job_id, state__in=[JobState.SUCCEEDED, JobState.DEAD]
        ).first(),
        timeout=timeout,
        what=f"job {job_id} to finish",
    )


def test_success_records_result_and_timings(worker, client, admin_user):
    # given / when
    handle = tasks.add.using(owner=admin_user).enqueue(2, 40)
    job = finished(handle.id)

    # then
    assert job.state == JobState.SUCCEEDED
    assert job.attempts == 1
    assert job.started_at is not None and job.finished_at is not None
    assert job.started_at >= job.enqueued_at and job.finished_at >= job.started_at
    client.force_login(admin_user)
    body = wait_until(lambda: (r := client.get(handle.status_url).json()).get("result") and r)
    assert body["state"] == "succeeded" and body["result"] == 42


def test_exponential_backoff_delays_follow_the_policy(worker, unique):
    handle = tasks.flaky.enqueue(unique, 3)  # fails 3 times, base 1 s, factor 2, no jitter
    job = finished(handle.id, timeout=40)

    assert job.state == JobState.SUCCEEDED and job.attempts == 4
    starts = [stamp for stamp, _ in marks(unique)]
    gaps = [b - a for a, b in pairwise(starts)]
    for gap, expected in zip(gaps, [1.0, 2.0, 4.0], strict=True):
        assert expected - 0.05 <= gap <= expected + 0.8, (gaps, expected)
    assert [f["exception"] for f in job.failures] == ["ConnectionError"] * 3


def test_explicit_delay_list_is_followed(worker, unique):
    handle = tasks.explicit.enqueue(unique, 3)  # delays 0.5, 2.0, 1.0
    job = finished(handle.id, timeout=30)

    starts = [stamp for stamp, _ in marks(unique)]
    gaps = [b - a for a, b in pairwise(starts)]
    assert job.attempts == 4
    for gap, expected in zip(gaps, [0.5, 2.0, 1.0], strict=True):
        assert expected - 0.05 <= gap <= expected + 0.8, (gaps, expected)


def test_permanent_error_runs_once_then_dead_letter_with_everything(worker, unique, admin_user):
    handle = tasks.refused.using(priority=7, owner=admin_user).enqueue(unique, to="x@example.com")
    job = finished(handle.id)

    assert job.state == JobState.DEAD and job.attempts == 1
    assert len(marks(unique)) == 1
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert dead.job_id == job.id
    assert dead.task_name == "tests.refused"
    assert dead.args == [unique] and dead.kwargs == {"to": "x@example.com"}
    assert dead.queue == "default" and dead.priority == 7 and dead.owner == admin_user
    assert dead.attempts == 1 and dead.status == DeadLetterStatus.DEAD
    assert dead.exception_class == "jobs.core.policies.Permanent"
    assert "550 recipient refused" in dead.exception_message
    assert "Traceback" in dead.traceback and "raise Permanent" in dead.traceback
    assert dead.first_failed_at <= dead.last_failed_at


def test_replay_runs_the_job_again_and_links_it(worker, unique):
    handle = tasks.refused.enqueue(unique, to="y@example.com")
    finished(handle.id)
    dead = DeadLetter.objects.get(job_id_value=handle.id)

    replay = dead_letter_replay(dead_letter=dead)

    replayed = finished(replay.id)
    assert replayed.replay_of_id == dead.pk and replayed.args == [unique]
    dead.refresh_from_db()
    assert dead.status == DeadLetterStatus.REPLAYED and str(dead.replayed_job_id) == replay.id
    assert len(marks(unique)) == 2  # the replay ran the job
    with pytest.raises(ReplayError):
        dead_letter_replay(dead_letter=dead)


def test_replaying_a_removed_task_is_a_clear_error_and_keeps_the_row(worker, unique):
    handle = tasks.refused.enqueue(unique, to="z@example.com")
    finished(handle.id)
    DeadLetter.objects.filter(job_id_value=handle.id).update(task_name="tests.gone")
    dead = DeadLetter.objects.get(job_id_value=handle.id)

    with pytest.raises(UnknownTask, match=r"tests\.gone"):
        dead_letter_replay(dead_letter=dead)

    dead.refresh_from_db()
    assert dead.status == DeadLetterStatus.DEAD and dead.replayed_job is None


def test_effect_happens_once_when_the_job_runs_again(worker, unique):
    handle = tasks.effect_then_fail.enqueue(unique)  # applies the effect, then fails once
    job = finished(handle.id)

    assert job.state == JobState.SUCCEEDED and job.attempts == 2
    assert len(marks(f"{unique}:runs")) == 2
    assert len(marks(f"{unique}:applied")) == 1
    assert Effect.objects.filter(key=f"test-effect:{unique}", job_id=job.id).count() == 1


def test_progress_is_visible_while_the_job_runs(worker, unique, client, admin_user):
    handle = tasks.progress.using(owner=admin_user).enqueue(unique, 10)
    client.force_login(admin_user)

    mid = wait_until(
        lambda: (body := client.get(handle.status_url).json())["progress"]["done"] == 5 and body,
        what="progress 5/10",
    )
    assert mid["state"] == "running"
    assert mid["progress"] == {"done": 5, "total": 10, "percent": 50.0, "message": "step 5"}
    set_flag(unique)
    job = finished(handle.id)
    assert (job.progress_done, job.progress_total) == (10, 10)


def test_soft_time_limit_counts_as_failed_attempt_and_ends_dead(worker, unique):
    handle = tasks.time_limited.enqueue(unique)  # 1 s soft limit, 2 attempts
    job = finished(handle.id, timeout=30)

    assert job.state == JobState.DEAD and job.attempts == 2
    assert len(marks(unique)) == 2
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert dead.exception_class == "jobs.core.policies.TimeLimitHit"


def test_untracked_job_runs_without_a_ledger_row(worker, unique):
    handle = tasks.record_untracked.enqueue(unique)

    wait_until(lambda: marks(unique), what="untracked job to run")
    assert not Job.objects.filter(id=handle.id).exists()


def test_hard_time_limit_kill_counts_as_failed_attempt(worker, unique):
    handle = tasks.hard_limited.enqueue(unique)  # killed after 1 s, 2 attempts allowed
    job = finished(handle.id, timeout=40)

    assert job.state == JobState.DEAD and job.attempts == 2
    assert len(marks(unique)) == 2
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert dead.exception_class == "jobs.core.policies.TimeLimitHit"
    assert "hard time limit" in dead.exception_message


def test_job_whose_process_dies_runs_again(worker, unique):
    handle = tasks.crashes.enqueue(unique, 1)  # kills its pool process once
    job = finished(handle.id, timeout=40)

    assert job.state == JobState.SUCCEEDED and job.crashes == 1
    assert len(marks(unique)) == 2


def test_job_that_keeps_killing_its_worker_becomes_a_dead_letter(worker, unique):
    handle = tasks.crashes.enqueue(unique, 100)
    job = finished(handle.id, timeout=60)

    assert job.state == JobState.DEAD and job.crashes == 3
    assert len(marks(unique)) == 3  # not redelivered forever
    dead = DeadLetter.objects.get(job_id_value=handle.id)
    assert "died 3 times" in dead.exception_message
