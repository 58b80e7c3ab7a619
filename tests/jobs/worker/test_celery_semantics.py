"""Celery code runs unchanged on @job: what a Celery task does (Celery's docs, celery/app/task.py,
celery/backends/base.py), a @job task does too, on a real worker, with the ledger behind it.

The tasks are in tests/support/celery_tasks.py, written as Celery code would be.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from functools import partial
from typing import Any, cast

import pytest
from celery import chain, chord, group, states
from celery.canvas import StampingVisitor  # type: ignore[attr-defined]  # not in celery-types
from celery.exceptions import ChordError, MaxRetriesExceededError, Reject, TaskRevokedError
from celery.result import AsyncResult, GroupResult
from django.utils import timezone

from jobs.broker import running
from jobs.core.exceptions import InvalidPayload
from jobs.models import DeadLetter, Job, JobState
from jobs.worker.decorators import job
from jobs.worker.task import PlatformTask
from tests.conftest import wait_until
from tests.support import celery_tasks as ct

TIMEOUT = 60


def _status_until(result: AsyncResult, status: str, timeout: float = TIMEOUT) -> str:
    return wait_until(
        lambda: result.status == status and status,
        timeout=timeout,
        what=f"{result.id} to read {status}",
    )


# --- a. self.retry() --------------------------------------------------------------------------
def test_retry_past_max_retries_raises_the_original_exception(worker, unique):
    # when: a task that always asks self.retry(exc=ExpectedException(...), max_retries=2)
    result = ct.retry.delay(unique)

    # then: RETRY with the exception while it retries, then FAILURE with the same exception
    _status_until(result, states.RETRY)
    assert isinstance(result.result, ct.ExpectedException)
    with pytest.raises(ct.ExpectedException) as raised:
        result.get(timeout=TIMEOUT)
    assert raised.value.args == ("flaky", 2)
    assert result.status == states.FAILURE and result.failed()
    assert ct.echoed(unique) == ["0", "1", "2"]  # request.retries counts each retry
    job = Job.objects.get(id=result.id)
    assert job.state == JobState.DEAD and job.attempts == 3
    exception = "tests.support.celery_tasks.ExpectedException"
    assert [f["exception"] for f in job.failures] == [exception] * 3
    assert DeadLetter.objects.get(job_id_value=result.id).exception_class == exception


def test_retry_then_success(worker, unique):
    result = ct.retry.delay(unique, succeed_after=1)

    assert result.get(timeout=TIMEOUT) == "retried 1"
    assert result.status == states.SUCCESS
    assert ct.echoed(unique) == ["0", "1"]
    assert not DeadLetter.objects.filter(job_id_value=result.id).exists()


def test_retry_past_max_retries_gives_up_even_on_an_exception_the_policy_retries(worker, unique):
    # ConnectionError is one the default policy retries (5 attempts); max_retries=1 stops it.
    result = ct.retry_transient.delay(unique)

    with pytest.raises(ConnectionError) as raised:
        result.get(timeout=TIMEOUT)
    assert raised.value.args == ("down", 1)
    assert ct.echoed(unique) == ["0", "1"]
    assert Job.objects.get(id=result.id).state == JobState.DEAD


def test_retry_without_exc_past_max_retries_raises_max_retries_exceeded(worker):
    result = ct.retry_no_exc.delay()

    with pytest.raises(MaxRetriesExceededError):
        result.get(timeout=TIMEOUT)
    job = Job.objects.get(id=result.id)
    assert job.attempts == 2 and job.state == JobState.DEAD


def test_retry_keeps_priority_and_headers_and_takes_new_args_and_options(worker):
    result = ct.retry_once_options.apply_async(
        (1,), {"queue": "emails"}, headers={"x-test-header": "kept"}, priority=7
    )

    seen = result.get(timeout=TIMEOUT)
    assert seen["retries"] == 1 and seen["foo"] == 2  # self.retry(args=(foo + 1,))
    assert seen["headers"]["x-test-header"] == "kept"
    assert seen["priority"] == 7  # the retried message's, on Backlot's scale as it was asked
    assert seen["queue"] == "emails"  # self.retry(queue="emails")
    job = Job.objects.get(id=result.id)
    assert job.args == [2] and job.priority == 7


def test_retry_with_new_args_keeps_the_kwargs_they_do_not_replace(worker):
    # Celery's rule (celery#6494), both ways
    kwargs_first = ct.retry_with_args_after_kwargs.apply_async(
        kwargs={"foo": 1, "bar": 2, "label": "kept"}
    )
    args_first = ct.retry_with_kwargs_after_args.apply_async(args=(1, 2))

    assert kwargs_first.get(timeout=TIMEOUT) == {"foo": 2, "bar": 3, "label": "kept", "retries": 1}
    assert args_first.get(timeout=TIMEOUT) == {"foo": 2, "bar": 2, "retries": 1}


def test_retry_at_eta(worker):
    asked = time.time()
    result = ct.retry_eta.delay(1.5)

    ran = result.get(timeout=TIMEOUT)
    assert ran - asked >= 1.5


# --- b. expires ------------------------------------------------------------------------------
def _busy(worker_slots: int = 2, seconds: float = 2.0) -> None:
    """Keep the worker's processes busy (as Celery's test_expired does), so a job waits."""
    for _ in range(worker_slots * 2):
        ct.sleeping.delay(seconds)


@pytest.mark.parametrize("as_time", [False, True], ids=["seconds", "datetime"])
def test_an_expired_job_never_runs_and_reads_revoked(worker, client, admin_user, as_time):
    _busy()
    expires: Any = timezone.now() + timedelta(seconds=1) if as_time else 1
    result = ct.add.apply_async((1, 1), expires=expires)

    with pytest.raises(TaskRevokedError):
        result.get(timeout=TIMEOUT)
    assert result.status == states.REVOKED
    assert result.ready() and not result.failed() and not result.successful()
    job = Job.objects.get(id=result.id)
    assert (job.state, job.error, job.attempts) == (JobState.CANCELLED, "expired", 0)
    assert not DeadLetter.objects.filter(job_id_value=result.id).exists()
    client.force_login(admin_user)
    body = client.get(f"/api/jobs/{result.id}/").json()
    assert body["state"] == "cancelled" and body["error"] == "expired"


def test_expires_is_kept_as_a_time_and_the_relay_sends_it_with_the_job(worker):
    from jobs import ledger
    from jobs.flow.relay import RELAY_GRACE, job_relay

    # apply_async(expires=600) is kept on the row as the time it names, not as "600"
    kept = Job.objects.get(id=ct.add.apply_async((2, 2), expires=600).id).publish_options
    assert abs(datetime.fromisoformat(kept["expires"]) - timezone.now()) < timedelta(seconds=660)
    assert datetime.fromisoformat(kept["expires"]) > timezone.now() + timedelta(seconds=500)

    # given: a job in the outbox (the broker never took its message) that expired meanwhile
    job = Job(
        task_name=ct.add.name,
        args=[2, 2],
        kwargs={},
        queue="default",
        priority=5,
        state=JobState.QUEUED,
        max_attempts=5,
        enqueued_at=timezone.now() - RELAY_GRACE * 2,
        publish_options={"expires": (timezone.now() - timedelta(seconds=1)).isoformat()},
    )
    ledger.insert(job)

    # when: the relay sends it
    assert job_relay() >= 1

    # then: the worker discards it as expired, and the relay does not send it again
    result: AsyncResult[Any] = AsyncResult(str(job.id))
    with pytest.raises(TaskRevokedError):
        result.get(timeout=TIMEOUT)
    job.refresh_from_db()
    assert (job.state, job.error, job.attempts) == (JobState.CANCELLED, "expired", 0)
    assert job_relay() == 0


# --- c. results: ignore_result, Reject --------------------------------------------------------
def test_reject_without_requeue_stores_the_failure(worker):
    result = ct.reject_without_requeue.delay()

    with pytest.raises(Reject):
        result.get(timeout=TIMEOUT)
    assert result.status == states.FAILURE
    assert result.ready() and result.failed() and not result.successful()
    job = Job.objects.get(id=result.id)
    assert job.state == JobState.DEAD and job.attempts == 1
    assert job.error.startswith("celery.exceptions.Reject")


def test_ignore_result_stores_and_returns_nothing(worker):
    result = ct.add.apply_async((1, 2), ignore_result=True)

    assert result.get(timeout=TIMEOUT) is None  # Celery: None at once, without waiting
    job = wait_until(lambda: Job.objects.filter(id=result.id, state=JobState.SUCCEEDED).first())
    assert job.result is None
    assert AsyncResult(result.id).result is None
    kept = ct.add.apply_async((1, 2))
    assert kept.get(timeout=TIMEOUT) == 3


def has_started(job_id: str) -> bool:
    """Its row says running, or its run's record does (DEFER_CLAIM: no row written yet)."""
    return Job.objects.filter(id=job_id, state=JobState.RUNNING).exists() or bool(
        running.live([job_id])
    )


def test_a_running_job_reads_started_only_when_its_task_tracks_it(worker):
    # Celery reports STARTED only for a task with track_started (task_track_started)
    for task, while_running in (
        (ct.sleeping, states.PENDING),
        (ct.sleeping_tracked, states.STARTED),
    ):
        result = task.delay(2)
        wait_until(partial(has_started, result.id), what=f"{task.name} to run")
        assert result.status == while_running
        result.get(timeout=TIMEOUT)
        assert result.status == states.SUCCESS


# --- d. parent_id / root_id, GroupResult --------------------------------------------------------
def test_a_chain_reports_root_and_parent_ids(worker):
    # celery-types types chain() as taking one signature; it takes an iterable of them
    result = chain(ct.ids.si(i) for i in range(5))()  # type: ignore[arg-type]

    node, root = result, result
    while root.parent:
        root = root.parent
    value = 4
    while node:
        root_id, parent_id, i = node.get(timeout=TIMEOUT)
        assert i == value and root_id == root.id
        if node.parent:
            assert parent_id == node.parent.id
        node, value = node.parent, value - 1
    assert value == -1  # five links walked back to the root


def test_a_group_after_a_chain_reports_root_and_parent_ids(worker):
    # celery-types types `signature | group` as a dict; it is a chain
    canvas: Any = ct.ids.si(1) | ct.ids.si(2) | group(ct.ids.si(i) for i in range(2, 8))
    result = canvas()

    expected_root, expected_parent = result.parent.parent.id, result.parent.id
    values = result.get(timeout=TIMEOUT)
    assert [tuple(v) for v in values] == [(expected_root, expected_parent, i) for i in range(2, 8)]


def test_a_chain_result_returned_by_a_job_is_serialized(worker):
    result = ct.build_chain_inside_task.delay().get(timeout=TIMEOUT)

    assert len(result) == 2 and isinstance(result[0][1], list)


def test_group_result_save_and_restore(worker):
    # celery-types types a group's apply_async as returning an AsyncResult
    sent = cast(GroupResult, group(ct.add.s(i, i) for i in range(4)).apply_async())
    sent.save()

    assert sent.id is not None
    restored = GroupResult.restore(sent.id)
    assert restored is not None and restored.results and sent.results
    assert [r.id for r in restored.results] == [r.id for r in sent.results]
    assert restored.get(timeout=TIMEOUT) == [0, 2, 4, 6]
    restored.delete()
    assert GroupResult.restore(sent.id) is None


# --- e. link / link_error ---------------------------------------------------------------------
def test_failure_read_without_propagating_is_the_exception_as_raised(worker):
    result = ct.fail.apply_async(("test",), link_error=ct.return_exception.s())

    assert result.get(timeout=TIMEOUT, propagate=False) == ct.ExpectedException(
        "Task expected to fail", "test"
    )


def test_a_new_style_errback_receives_the_request_and_the_real_exception(worker):
    result = ct.fail.apply_async(("x", 1), link_error=ct.errback_new_style.s())

    with pytest.raises(ct.ExpectedException):
        result.get(timeout=TIMEOUT)
    seen = wait_until(lambda: ct.echoed(result.id), what="the errback")
    assert seen == ["ExpectedException('Task expected to fail', 'x', 1)"]


def test_an_old_style_errback_that_retries_runs_to_its_end(worker):
    errback = ct.retry_once.s()
    result = ct.fail.apply_async(("y",), link_error=errback)

    assert result.get(timeout=TIMEOUT, propagate=False) == ct.ExpectedException(
        "Task expected to fail", "y"
    )
    # the errback got the failed job's id, retried once, then succeeded: its ledger row says so
    ran = wait_until(
        lambda: Job.objects.filter(
            task_name=ct.retry_once.name, args=[result.id], state=JobState.SUCCEEDED
        ).first(),
        timeout=TIMEOUT,
        what="the errback's retry",
    )
    assert ran.attempts == 2 and ran.result == 1


def test_a_link_gets_the_return_value(worker, unique):
    ct.add.apply_async((1, 2), link=ct.redis_echo.s(unique))

    assert wait_until(lambda: ct.echoed(unique), what="the callback") == ["3"]


def test_the_errback_of_a_chord_in_a_chain_runs_when_a_member_fails(worker, unique):
    body = chord([ct.identity.si(42), ct.fail.si()], ct.identity.s())
    body.link_error(ct.redis_echo.si("errback ran", unique))

    canvas: Any = ct.identity.si(1) | body  # a chain (celery-types: a dict)
    result = canvas.apply_async()

    # get() raises the member's exception, or (once the callback was failed first, as the
    # database result backend does) the ChordError naming it, with its arguments
    with pytest.raises((ct.ExpectedException, ChordError)) as raised:
        result.get(timeout=TIMEOUT)
    assert "Task expected to fail" in repr(raised.value)
    assert wait_until(lambda: ct.echoed(unique), what="the chord's errback") == ["errback ran"]


def test_a_failure_early_in_a_chain_fails_what_waits_on_the_chains_end(worker):
    # the tasks chained after a failed job read its failure, as Celery stores it for them
    plain = chain(ct.fail.si("early"), ct.identity.si(2))
    # Celery's #9674: the chord waits on the body of the chord the inner chain's group became
    nested = chain(
        group(
            ct.identity.si(1),
            chain(
                ct.fail.si("inner"), group(ct.identity.si(2), ct.identity.si(3)), ct.identity.si(4)
            ),
        ),
        ct.identity.s(),
    )

    with pytest.raises(ct.ExpectedException):
        plain.apply_async().get(timeout=TIMEOUT)
    with pytest.raises((ct.ExpectedException, ChordError)):
        nested.apply_async().get(timeout=TIMEOUT)


# --- g. Task.replace() ------------------------------------------------------------------------
def test_a_task_replaced_by_a_task_reads_the_replacement(worker):
    result = ct.add_replaced.delay(1, 2)

    assert result.get(timeout=TIMEOUT) == 3
    assert result.status == states.SUCCESS
    job = Job.objects.get(id=result.id)  # one row per id: the replacement took it over
    assert (job.task_name, job.state, job.result) == (ct.add.name, JobState.SUCCEEDED, 3)


def test_replaced_in_a_chain(worker):
    canvas: Any = ct.add.s(4, 4) | ct.add_replaced.s(8) | ct.add.s(16)

    assert canvas().get(timeout=TIMEOUT) == 32  # 4+4, then 8+8 by the replacement, then 16+16


def test_replaced_by_a_chain(worker):
    result = ct.add_replaced_with_chain.delay(42, 1337)

    assert result.get(timeout=TIMEOUT) == 1379
    assert Job.objects.get(id=result.id).task_name == ct.identity.name


def test_replaced_by_a_group(worker):
    # Celery ends a replacing group with its own celery.accumulate, which keeps no ledger row
    result = ct.add_to_all.delay([1, 2, 3], 10)

    assert result.get(timeout=TIMEOUT) == [11, 12, 13]
    assert Job.objects.get(id=result.id).state == JobState.SUCCEEDED


def test_replaced_in_a_group_and_in_a_chord_header(worker):
    grouped = group(ct.add_replaced.si(1, 1), ct.add.si(2, 2), ct.add_replaced.si(3, 3))
    chorded = chord([ct.add_replaced.si(1, 1), ct.add.si(2, 2)], ct.tsum.s())

    assert grouped.apply_async().get(timeout=TIMEOUT) == [2, 4, 6]
    assert chorded.apply_async().get(timeout=TIMEOUT) == 6


def test_the_links_of_a_replaced_task_follow_the_replacement(worker, unique):
    linked = ct.add_replaced.apply_async((1, 2), link=ct.redis_echo.s(unique))
    failing = ct.fail_replaced.apply_async(("z",), link_error=ct.errback_new_style.s())

    assert linked.get(timeout=TIMEOUT) == 3
    assert wait_until(lambda: ct.echoed(unique), what="the link") == ["3"]
    with pytest.raises(ct.ExpectedException):
        failing.get(timeout=TIMEOUT)
    seen = wait_until(lambda: ct.echoed(failing.id), what="the errback")
    assert seen == ["ExpectedException('Task expected to fail', 'z')"]


def test_cancelling_a_replaced_job_stops_its_replacement(worker):
    from jobs import cancel

    result = ct.replace_with_slow.delay(3)
    wait_until(
        lambda: Job.objects.filter(id=result.id, state=JobState.SCHEDULED).exists(),
        timeout=TIMEOUT,
        what="the job to hand itself over",
    )

    cancel(result.id)

    with pytest.raises(TaskRevokedError):
        result.get(timeout=TIMEOUT)
    job = Job.objects.get(id=result.id)
    assert job.state == JobState.CANCELLED and job.task_name == ct.replace_with_slow.name
    assert not Job.objects.filter(id=result.id, task_name=ct.add.name).exists()


# --- h. stamps, revoke by stamped headers ---------------------------------------------------------
class _Monitoring(StampingVisitor):
    def __init__(self, monitoring_id: str) -> None:
        self.monitoring_id = monitoring_id

    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        return {"monitoring_id": self.monitoring_id}


def _stamped(sig: Any, monitoring_id: str) -> Any:
    sig.stamp(visitor=_Monitoring(monitoring_id))
    return sig


def test_revoke_by_stamped_headers_is_a_ledger_cancellation(worker, unique):
    from config.celery import app

    target, other = f"{unique}-target", f"{unique}-other"
    # given: a job carrying the stamp waits (due in 20 s); another stamp's job waits too
    waiting = _stamped(ct.add.si(1, 1), target).apply_async(countdown=20)
    spared = _stamped(ct.add.si(2, 2), other).apply_async(countdown=2)
    assert Job.objects.get(id=waiting.id).publish_options["monitoring_id"] == target

    # when
    # celery-types wants one value per header; Celery takes a list of them too
    app.control.revoke_by_stamped_headers({"monitoring_id": [target]})  # type: ignore[dict-item]

    # then: the waiting job is cancelled in the ledger (not only in the workers' memory)
    wait_until(
        lambda: Job.objects.filter(id=waiting.id, state=JobState.CANCELLED).exists(),
        what="the stamped job to be cancelled",
    )
    with pytest.raises(TaskRevokedError):
        waiting.get(timeout=TIMEOUT)
    # a job sent afterwards with the stamp never runs either, and reads REVOKED
    later = _stamped(ct.add.si(3, 3), target).apply_async()
    with pytest.raises(TaskRevokedError):
        later.get(timeout=TIMEOUT)
    job = Job.objects.get(id=later.id)
    assert (job.state, job.error, job.attempts) == (JobState.CANCELLED, "revoked", 0)
    # the other stamp's job runs; a stamp reaches the task's request
    assert spared.get(timeout=TIMEOUT) == 4
    assert not DeadLetter.objects.filter(job_id_value__in=[waiting.id, later.id]).exists()


def test_headers_and_stamps_reach_the_task(worker, unique):
    sig = _stamped(ct.request_headers.si(), unique).set(headers={"x-custom": "yes"})

    seen = sig.apply_async().get(timeout=TIMEOUT)
    assert seen["headers"]["x-custom"] == "yes"
    assert seen["stamps"] == {"monitoring_id": unique}


def test_the_callers_argsrepr_and_kwargsrepr_ride_in_the_message(worker):
    # Celery's way to keep a secret argument out of logs and Flower: the caller's own repr
    sent = ct.request_reprs.apply_async(
        ("s3cr3t",), {"token": "t0k3n"}, argsrepr="('<hidden>',)", kwargsrepr="{'token': '*'}"
    )
    assert sent.get(timeout=TIMEOUT) == ["('<hidden>',)", "{'token': '*'}"]
    # kept with the job for the relay's re-send
    stored = Job.objects.get(id=sent.id).publish_options
    assert stored["argsrepr"] == "('<hidden>',)" and stored["kwargsrepr"] == "{'token': '*'}"

    # without them, Backlot's short masked copies
    plain = ct.request_reprs.apply_async((1,), {"n": 2})
    assert plain.get(timeout=TIMEOUT) == ["[1]", "{'n': 2}"]


# --- f. priority, queue and time limits on retried, replayed and canvas messages ---------------
def test_a_retried_message_keeps_the_calls_time_limits(worker):
    result = ct.retry_once_options.apply_async((1,), time_limit=20, soft_time_limit=15)

    assert result.get(timeout=TIMEOUT)["time_limit"] == [20, 15]


def test_a_replay_keeps_queue_priority_time_limits_and_headers(worker, unique):
    from jobs import dead_letter_replay

    first = ct.limits_once.apply_async(
        (unique,), queue="emails", priority=8, time_limit=20, headers={"x-tenant": "t1"}
    )
    with pytest.raises(ct.ExpectedException):
        first.get(timeout=TIMEOUT)

    replay = dead_letter_replay(dead_letter=DeadLetter.objects.get(job_id_value=first.id))

    seen: dict[str, Any] = AsyncResult(replay.id).get(timeout=TIMEOUT)
    assert seen["queue"] == "emails" and seen["priority"] == 8
    assert seen["time_limit"][0] == 20 and seen["headers"]["x-tenant"] == "t1"
    assert (Job.objects.get(id=replay.id).queue, Job.objects.get(id=replay.id).priority) == (
        "emails",
        8,
    )


def test_a_task_reads_the_priority_it_was_sent_with(worker):
    # Backlot's scale (0 lowest .. 9 highest) in apply_async and signatures, as for enqueue;
    # request.delivery_info['priority'] is that number, as a Celery task reads its caller's
    sent = ct.return_priority.apply_async(priority=7)
    default = ct.return_priority.delay()

    assert sent.get(timeout=TIMEOUT) == "Priority: 7"
    assert default.get(timeout=TIMEOUT) == "Priority: 5"  # @job's default priority
    assert Job.objects.get(id=sent.id).priority == 7


def test_a_chord_callback_and_a_chain_run_at_the_priority_asked(worker):
    body = chord([ct.add.si(1, 1), ct.add.si(2, 2)], ct.return_priority.s().set(priority=3))
    chained: Any = ct.return_priority.si().set(priority=3) | ct.return_priority.si().set(priority=7)

    assert body.apply_async().get(timeout=TIMEOUT) == "Priority: 3"
    assert chained.apply_async().get(timeout=TIMEOUT) == "Priority: 7"


@pytest.mark.django_db
def test_a_replaced_row_waits_for_its_replacement_and_nothing_else_sends_or_runs_it():
    from jobs import ledger
    from jobs.flow.relay import job_relay

    # given: a running job that handed itself to its replacement (Task.replace())
    job = Job(
        task_name=ct.add_replaced.name,
        args=[1, 2],
        kwargs={},
        queue="default",
        priority=5,
        state=JobState.RUNNING,
        attempts=1,
        max_attempts=5,
        enqueued_at=timezone.now() - timedelta(minutes=5),
        published_at=timezone.now() - timedelta(minutes=5),
    )
    ledger.insert(job)
    assert ledger.replace(job_id=str(job.id), attempt=1)

    # then: the relay does not send it, and a stray copy of its message is dropped
    assert job_relay() == 0
    assert ledger.claim(job_id=str(job.id), lease_seconds=30) is None
    job.refresh_from_db()
    assert (job.state, job.error) == (JobState.SCHEDULED, ledger.REPLACED)

    # when the replacement's task of the same id is enqueued, it takes the row over
    successor = ct.add.apply_async((1, 2), task_id=str(job.id))
    job.refresh_from_db()
    assert successor.id == str(job.id)
    assert (job.task_name, job.state, job.attempts) == (ct.add.name, JobState.QUEUED, 0)


# --- i. pydantic models, a base class of the team's, a frozen signature sent again ---------------
def test_pydantic_models_are_sent_as_celery_dumps_them(worker):
    # a pydantic=True task called with models, as Celery's docs show it
    sent = ct.add_points.delay(ct.Point(x=2, y=3))
    by_name = ct.add_points.apply_async(kwargs={"data": ct.Point(x=4, y=4)})
    enqueued = ct.add_points.enqueue(ct.Point(x=1, y=1))

    # the task gets its model back and its returned model comes back dumped
    assert sent.get(timeout=TIMEOUT) == {"total": 5}
    assert by_name.get(timeout=TIMEOUT) == {"total": 8}
    assert AsyncResult(enqueued.id).get(timeout=TIMEOUT) == {"total": 2}
    # the ledger row holds what the message carried: the model as JSON
    assert Job.objects.get(id=sent.id).args == [{"x": 2, "y": 3}]
    # an argument that is neither JSON nor a model the task takes is still refused, by name
    with pytest.raises(InvalidPayload, match=r"args\[0\]"):
        ct.add_points.delay(cast(Any, object()))


def test_a_celery_base_class_keeps_its_methods_and_hooks_under_job(worker, unique):
    assert isinstance(ct.audited_replace, PlatformTask)
    assert isinstance(ct.audited_replace, ct.AuditedTask)

    result = ct.audited_replace.delay(unique)

    seen = cast(dict[str, Any], result.get(timeout=TIMEOUT))
    assert ct.echoed(unique) == ["compat.audited_replace: replaced"]  # the base's own method
    assert seen["stamps"]["replaced_by"] == "audited"  # its on_replace stamped the replacement
    job = Job.objects.get(id=result.id)
    assert (job.task_name, job.state) == (ct.request_headers.name, JobState.SUCCEEDED)


def test_a_base_that_is_not_a_celery_task_is_refused():
    with pytest.raises(TypeError, match=r"base=\.\.\.\) takes a subclass of celery.Task"):
        job(base=dict)(lambda: None)


def test_a_frozen_signature_sent_again_after_its_revoke_is_revoked_again(worker, unique):
    from config.celery import app

    # given: one signature, frozen with one task id, whose stamp is revoked (as Celery's
    # test_revoked_by_headers_complex_canvas does)
    stamped = _stamped(ct.sleeping.si(4), unique)
    frozen = stamped.freeze()
    app.control.revoke_by_stamped_headers(  # the worker has it once it replies
        {"monitoring_id": [unique]},  # type: ignore[dict-item]
        reply=True,
        timeout=10,
    )

    # when: it is sent in one canvas after another, then: revoked every time
    for canvas in (group([stamped]), chain(stamped), chord([ct.add.si(1, 1)], stamped)):
        with pytest.raises(TaskRevokedError):
            canvas.apply_async().get(timeout=TIMEOUT)
    assert frozen.status == states.REVOKED
    row = Job.objects.get(id=frozen.id)
    assert (row.state, row.attempts) == (JobState.CANCELLED, 0)


def test_the_id_of_a_job_that_ran_is_not_taken_twice(worker):
    first = ct.add.delay(1, 2)
    assert first.get(timeout=TIMEOUT) == 3

    with pytest.raises(ValueError, match=f"task_id {first.id} is already the id of a succeeded"):
        ct.add.apply_async((2, 3), task_id=first.id)
    assert Job.objects.get(id=first.id).result == 3


def test_a_group_a_finished_job_chains_to_is_its_children_and_its_owners(worker, admin_user):
    # the group's members are sent from the worker after the first job's run returned: each
    # reads the job's owner and whether it is stopping once for them all, not once per member
    canvas: Any = ct.identity.si(1) | group(ct.identity.si(i) for i in range(20))
    result = canvas.apply_async(owner=admin_user)  # Backlot's owner= on the chain's first job

    assert result.get(timeout=TIMEOUT) == list(range(20))
    members = Job.objects.filter(id__in=[r.id for r in result.results])
    parent = Job.objects.get(id=result.parent.id)
    assert parent.owner == admin_user
    assert members.count() == 20
    assert set(members.values_list("parent_id", "owner_id", "state")) == {
        (parent.id, admin_user.pk, JobState.SUCCEEDED)
    }


# --- delay_on_commit (Celery 5.4's Django API) ------------------------------------------------
def test_delay_on_commit_returns_none_and_publishes_after_commit(worker, unique):
    from django.db import transaction

    from jobs.broker.queues import queue_depths

    # when: called inside the caller's transaction
    with transaction.atomic():
        # (mypy: it returns None by its type; the test asserts Celery's None)
        returned = ct.redis_echo.delay_on_commit("after commit", unique)  # type: ignore[func-returns-value]
        # then: None, as Celery's; the row is written in this transaction, nothing published yet
        assert returned is None
        row = Job.objects.get(task_name="compat.redis_echo", args=["after commit", unique])
        assert row.state == JobState.QUEUED
        assert queue_depths(["default"]) == {"default": 0}
    # and once it commits the job runs, once
    wait_until(lambda: ct.echoed(unique) == ["after commit"], timeout=TIMEOUT, what="the job")
    # (its success is written by the worker after the run, with others: SUCCESS_BATCH_SECONDS)
    wait_until(
        lambda: Job.objects.get(id=row.id).state == JobState.SUCCEEDED,
        timeout=TIMEOUT,
        what="its success",
    )
    assert ct.echoed(unique) == ["after commit"]


def test_delay_on_commit_in_a_rolled_back_transaction_sends_nothing(worker, unique):
    from django.db import transaction

    from jobs.broker.queues import queue_depths

    class RolledBack(Exception):
        pass

    with pytest.raises(RolledBack), transaction.atomic():
        ct.redis_echo.apply_async_on_commit(("rolled back", unique), queue="emails", priority=7)
        raise RolledBack

    assert not Job.objects.filter(task_name="compat.redis_echo", args__contains=[unique]).exists()
    assert queue_depths(["default", "emails"]) == {"default": 0, "emails": 0}


def test_a_declared_max_retries_is_the_max_attempts_that_runs_and_the_api_shows(
    worker, unique, admin_client
):
    # given: @job(bind=True, max_retries=1) that always asks self.retry() (the policy's is 5)
    assert ct.retry_transient.policy.max_attempts == 2

    result = ct.retry_transient.delay(unique)

    with pytest.raises(ConnectionError):
        result.get(timeout=TIMEOUT)
    job = Job.objects.get(id=result.id)
    assert job.state == JobState.DEAD and job.attempts == job.max_attempts == 2
    shown = admin_client.get(f"/api/jobs/{result.id}/").json()
    assert shown["attempts"] == shown["max_attempts"] == 2
