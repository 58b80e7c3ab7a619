"""The standard Tasks API on Backlot (either Django's): enqueue, run on a real worker, read back."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import dead_letter_replay
from jobs.broker.queues import held_job_ids
from jobs.core.exceptions import InvalidPayload
from jobs.core.policies import DEFAULT_POLICY
from jobs.flow.backends import RUNNER_NAME, CeleryBackend, backlot_priority
from jobs.models import DeadLetter, DeadLetterStatus, Job, JobState
from tests.conftest import ROOT, marks, set_flag, wait_until
from tests.support import std_tasks, tasks
from tests.support.tasks_api import (
    InvalidTask,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    default_task_backend,
    task,
    task_backends,
    task_enqueued,
)


def in_broker(job_id: Any) -> bool:
    """Whether Redis holds the job's message (in its queue's lists or a worker's hands)."""
    held = held_job_ids(Job.objects.get(id=job_id).queue)
    assert held is not None, "Redis could not tell"
    return str(job_id) in held


def settled(result: TaskResult, timeout: float = 30) -> TaskResult:
    """Refresh `result` until it is SUCCESSFUL or FAILED."""

    def finished() -> bool:
        result.refresh()
        return result.is_finished

    wait_until(finished, timeout=timeout, what=f"task {result.id} to finish")
    return result


def orphan() -> None:
    """A module-level function for declaring tasks inside tests."""


# --- the backend's contract, no worker needed ---------------------------------------------


def test_backlot_is_the_default_backend_and_declares_what_it_supports():
    assert isinstance(task_backends["default"], CeleryBackend)
    assert default_task_backend.supports_defer
    assert default_task_backend.supports_async_task
    assert default_task_backend.supports_get_result
    assert default_task_backend.supports_priority
    assert default_task_backend.queues == set(settings.BACKLOT_QUEUES)


@pytest.mark.parametrize(
    ("standard", "backlot"),
    [
        (100, 9),
        (76, 9),
        (75, 8),
        (51, 8),
        (50, 7),
        (26, 7),
        (25, 6),
        (1, 6),
        (0, 5),
        (-1, 4),
        (-20, 4),
        (-21, 3),
        (-40, 3),
        (-41, 2),
        (-60, 2),
        (-61, 1),
        (-80, 1),
        (-81, 0),
        (-100, 0),
    ],
)
def test_priority_maps_onto_backlots_levels(standard, backlot):
    assert backlot_priority(standard) == backlot


def test_priority_mapping_keeps_order_and_uses_every_level():
    mapped = [backlot_priority(p) for p in range(-100, 101)]
    assert mapped == sorted(mapped)
    assert set(mapped) == set(range(10))


def test_a_queue_backlot_does_not_declare_fails_the_system_check():
    backend = CeleryBackend("extra", {"QUEUES": ["default", "bulk"]})

    [problem] = backend.check()

    assert problem.id == "jobs.tasks.E001"
    assert "bulk" in problem.msg and "no worker would consume" in problem.msg


def test_declaring_a_task_on_an_unknown_queue_is_refused():
    with pytest.raises(
        InvalidTask, match=r"^Queue 'bulk' is not valid for backend\. Task .*orphan"
    ):
        task(queue_name="bulk")(orphan)


def test_unknown_queue_is_a_clear_error_and_writes_nothing(db):
    with pytest.raises(
        InvalidTask,
        match=r"^Queue 'bulk' is not valid for backend\. .*Backlot's workers consume "
        r"default, emails, media, reports",
    ):
        std_tasks.add.using(queue_name="bulk").enqueue(1, 2)

    assert not Job.objects.exists()


def test_arguments_that_are_not_json_are_a_type_error_naming_them(db):
    # Django's backends raise TypeError (normalize_json); the message names the value
    with pytest.raises(TypeError, match=r"std_tasks.add: args\[0\] is a datetime.datetime"):
        std_tasks.add.enqueue(datetime.now(), 1)  # type: ignore[arg-type]

    assert not Job.objects.exists()


def test_oversized_arguments_are_still_refused_as_invalid_payload(db):
    with pytest.raises(InvalidPayload):
        std_tasks.record.enqueue("x" * (settings.BACKLOT.get("MAX_PAYLOAD_BYTES", 65536) + 1))

    assert not Job.objects.exists()


def test_queues_empty_is_djangos_any_queue_of_those_backlot_declares(db):
    backend = CeleryBackend("any", {"QUEUES": []})

    backend.validate_task(std_tasks.on_reports)  # any declared queue: no error
    with pytest.raises(InvalidTask, match=r"^Queue 'bulk' is not valid for backend\."):
        backend.validate_task(std_tasks.add.using(queue_name="bulk"))
    assert list(backend.check()) == []


def test_enqueue_writes_its_row_and_reads_nothing_back(db):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    # when
    with CaptureQueriesContext(connection) as queries:
        result = std_tasks.add.enqueue(2, 40)

    # then: one statement, the row's INSERT; the result's enqueued_at is the row's
    statements = [q["sql"].lstrip().split(" ", 1)[0].upper() for q in queries.captured_queries]
    assert statements == ["INSERT"]
    assert result.enqueued_at == Job.objects.get(id=result.id).enqueued_at


def test_get_result_of_an_unknown_id_does_not_exist(db):
    job = tasks.add.enqueue(1, 2)  # a Backlot @job, not a standard task

    for unknown in ["not-a-uuid", "00000000-0000-4000-8000-000000000000", job.id]:
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(unknown)


def test_get_result_through_another_task_is_a_mismatch(db):
    result = std_tasks.add.enqueue(1, 2)

    assert std_tasks.add.get_result(result.id).id == result.id
    with pytest.raises(TaskResultMismatch):
        std_tasks.record.get_result(result.id)


# --- on a real worker ----------------------------------------------------------------------


def test_enqueue_returns_a_result_that_becomes_successful_with_the_value(worker):
    # when
    result = std_tasks.add.enqueue(2, 40)

    # then it is accepted into the ledger as a Backlot job
    assert result.status == TaskResultStatus.READY and result.backend == "default"
    assert result.args == [2, 40] and result.kwargs == {}
    job = Job.objects.get(id=result.id)
    assert job.task_name == RUNNER_NAME and job.queue == "default" and job.priority == 5
    assert job.args == ["tests.support.std_tasks.add", [2, 40], {}]
    assert result.enqueued_at == job.enqueued_at

    # and it runs on the worker
    settled(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42
    assert result.attempts == 1 and result.errors == []
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    assert default_task_backend.get_result(result.id).return_value == 42
    assert async_to_sync(std_tasks.add.aget_result)(result.id).return_value == 42


def test_status_is_running_while_the_task_runs(worker, unique):
    result = std_tasks.wait_then_answer.enqueue(unique)

    def running() -> bool:
        result.refresh()
        return result.status == TaskResultStatus.RUNNING

    wait_until(running, what="the task to run")
    assert result.started_at is not None and result.finished_at is None
    with pytest.raises(ValueError, match="not finished"):
        _ = result.return_value

    set_flag(unique)
    settled(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"answer": 42, "key": unique}


def test_transient_failure_retries_per_policy_then_fails_into_a_dead_letter(worker, unique):
    result = std_tasks.upstream_down.enqueue(unique)  # ConnectionError on every run

    settled(result, timeout=60)  # the default policy: 5 runs, backoff 1, 2, 4, 8 s with jitter

    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == DEFAULT_POLICY.max_attempts == len(marks(unique))
    assert [error.exception_class for error in result.errors] == [ConnectionError] * 5
    final = result.errors[-1].traceback
    assert "Traceback (most recent call last)" in final
    assert f"upstream unreachable ({unique})" in final and "std_tasks.py" in final
    assert result.finished_at is not None
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value

    dead = DeadLetter.objects.get(job_id_value=result.id)
    assert dead.status == DeadLetterStatus.DEAD and dead.attempts == 5
    assert dead.task_name == RUNNER_NAME
    assert dead.args[:2] == ["tests.support.std_tasks.upstream_down", [unique]]
    assert dead.exception_class == "ConnectionError"


def test_permanent_error_fails_after_one_run(worker, unique):
    result = std_tasks.rejects_input.enqueue(unique, 7)

    settled(result)

    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    [error] = result.errors
    assert error.exception_class is ValueError
    assert "value 7 is out of range" in error.traceback
    assert DeadLetter.objects.filter(job_id_value=result.id).exists()


def test_replaying_the_dead_letter_of_a_task_runs_it_again(worker, unique):
    failed = settled(std_tasks.needs_flag.enqueue(unique))
    assert failed.status == TaskResultStatus.FAILED
    set_flag(unique)

    replay = dead_letter_replay(dead_letter=DeadLetter.objects.get(job_id_value=failed.id))

    replayed = settled(default_task_backend.get_result(replay.id))
    assert replayed.status == TaskResultStatus.SUCCESSFUL
    assert replayed.return_value == "replayed"
    assert replayed.task.func is std_tasks.needs_flag.func and replayed.args == [unique]


def test_a_return_value_that_is_not_json_fails_clearly(worker):
    result = settled(std_tasks.returns_a_set.enqueue())

    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors  # one run, as Django's backends record it
    assert error.exception_class is TypeError
    assert "the return value is a builtins.set, which is not JSON-serializable" in error.traceback


def test_context_describes_the_running_task(worker, unique):
    result = settled(std_tasks.describe_context.using(priority=30).enqueue(unique))

    assert result.return_value == {
        "key": unique,
        "attempt": 1,
        "id": result.id,
        "status": "RUNNING",
        "priority": 30,
        "queue": "default",
    }
    assert Job.objects.get(id=result.id).priority == 7


def test_async_task_runs_to_completion(worker):
    result = settled(std_tasks.double_async.enqueue(21))

    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 42


def test_run_after_holds_the_task_until_it_is_due(worker, unique):
    run_after = timezone.now() + timedelta(seconds=3)

    result = std_tasks.record.using(run_after=run_after).enqueue(unique, "late")

    job = Job.objects.get(id=result.id)
    assert job.state == JobState.SCHEDULED and job.scheduled_for == run_after

    def waiting_until_due() -> bool:
        # Checked until just before the time (a read takes a few ms): still waiting.
        if timezone.now() >= run_after - timedelta(milliseconds=100):
            return True
        result.refresh()
        assert result.status == TaskResultStatus.READY and result.started_at is None
        assert not marks(unique)
        return False

    wait_until(waiting_until_due, timeout=10, what="run_after to pass")
    settled(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.started_at is not None and result.started_at >= run_after
    assert marks(unique)[0][0] >= run_after.timestamp()
    assert default_task_backend.get_result(result.id).task.run_after == run_after


def test_queue_name_and_priority_are_honoured(start_worker, clean_redis, transactional_db, unique):
    # given a backlog on `reports`, which no worker consumes yet
    low = [std_tasks.on_reports.using(priority=-50).enqueue(unique, f"low{n}") for n in range(8)]
    high = [std_tasks.on_reports.using(priority=90).enqueue(unique, f"high{n}") for n in range(4)]
    rows = Job.objects.filter(id__in=[r.id for r in low + high])
    assert set(rows.values_list("queue", flat=True)) == {"reports"}
    assert set(rows.values_list("priority", flat=True)) == {2, 9}

    # when one single-process worker starts on it
    # (no soft-shutdown drain: it would hold the idle worker's stop for 20 s)
    worker = start_worker(
        "tasks-priority", queues="reports", concurrency=1, CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT="0"
    )
    try:
        wait_until(lambda: len(marks(unique)) == 12, what="backlog to drain")
    finally:
        worker.stop()

    # then every high-priority task ran before any low one, each on its queue
    order = [label for _, label in marks(unique)]
    assert all(label.startswith("high") for label in order[:4]), order
    for result in low + high:
        settled(result)
        assert result.status == TaskResultStatus.SUCCESSFUL
        assert result.task.queue_name == "reports"


def test_get_result_works_from_another_process(worker, worker_env):
    result = settled(std_tasks.add.enqueue(20, 22))
    failed = settled(std_tasks.rejects_input.enqueue("other-process", 3))
    code = f"""
import json
from tests.support import std_tasks, tasks
from tests.support.tasks_api import default_task_backend
ok = std_tasks.add.get_result({result.id!r})
bad = default_task_backend.get_result({failed.id!r})
print(json.dumps({{
    "status": ok.status, "value": ok.return_value, "args": ok.args, "path": ok.task.module_path,
    "failed": bad.status, "error": bad.errors[0].exception_class_path,
}}))
"""

    out = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        check=False,
        cwd=ROOT,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "status": "SUCCESSFUL",
        "value": 42,
        "args": [20, 22],
        "path": "tests.support.std_tasks.add",
        "failed": "FAILED",
        "error": "builtins.ValueError",
    }


def test_enqueue_in_a_transaction_that_rolls_back_writes_and_sends_nothing(worker, unique):
    with pytest.raises(RuntimeError), transaction.atomic():
        doomed = std_tasks.record.enqueue(unique, "rolled back")
        # in the ledger, in this transaction only, and not yet sent to the broker
        assert not in_broker(doomed.id)
        raise RuntimeError("the request failed")

    assert not Job.objects.filter(id=doomed.id).exists()
    with pytest.raises(TaskResultDoesNotExist):
        doomed.refresh()
    # A task enqueued after it runs: the worker got past where the first would have been.
    after = settled(std_tasks.record.enqueue(unique, "after"))
    assert after.status == TaskResultStatus.SUCCESSFUL
    assert [label for _, label in marks(unique)] == ["after"]
    assert not Job.objects.filter(id=doomed.id).exists()


def test_enqueue_in_a_transaction_is_sent_when_it_commits(worker, unique):
    seen: list[str] = []

    def on_enqueued(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
        seen.append(task_result.id)

    task_enqueued.connect(on_enqueued)
    try:
        with transaction.atomic():
            result = std_tasks.record.enqueue(unique, "committed")
            assert not in_broker(result.id)  # not sent before the commit
            assert seen == []
        assert seen == [result.id]
        assert settled(result).status == TaskResultStatus.SUCCESSFUL
    finally:
        task_enqueued.disconnect(on_enqueued)

    settled(result)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "committed"


def test_a_cancelled_standard_task_is_failed_with_the_cancellation_in_its_errors(db):
    from jobs import cancel

    result = std_tasks.add.enqueue(1, 2)  # in a test transaction: never published, never runs

    cancel(result.id)

    fetched = std_tasks.add.get_result(result.id)
    assert fetched.status == TaskResultStatus.FAILED
    assert fetched.errors[-1].exception_class_path == "jobs.core.exceptions.JobCancelled"
    assert "was cancelled" in fetched.errors[-1].traceback


@pytest.mark.parametrize(
    ("name", "exception"), [("exits", SystemExit), ("interrupted", KeyboardInterrupt)]
)
def test_systemexit_and_keyboardinterrupt_fail_the_task_once(worker, unique, name, exception):
    pools = sorted(worker.pool_pids())

    result = settled(getattr(std_tasks, name).enqueue(unique))

    # then: FAILED after one run, with that class and its traceback, as Django records it
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class is exception
    assert exception.__name__ in error.traceback and "Traceback" in error.traceback
    assert [value for _, value in marks(unique)] == ["run"]
    assert Job.objects.get(id=result.id).attempts == 1
    # and the pool process lived on (no WorkerLostError, no replacement)
    assert sorted(worker.pool_pids()) == pools


def test_refresh_from_async_code_raises_djangos_error_and_arefresh_works(worker):
    from asgiref.sync import async_to_sync as run_async
    from django.core.exceptions import SynchronousOnlyOperation

    result = settled(std_tasks.add.enqueue(2, 3))

    async def read() -> Any:
        with pytest.raises(SynchronousOnlyOperation):
            result.refresh()  # Django's documented error for sync ORM use in async code
        await result.arefresh()
        fetched = await default_task_backend.aget_result(result.id)
        return result.status, fetched.return_value

    assert run_async(read)() == (TaskResultStatus.SUCCESSFUL, 5)
