"""Django's standard Tasks API on Backlot's workers: django.tasks on Django 6, the backport on 5.2.

With TASKS = {"default": {"BACKEND": "jobs.flow.backends.CeleryBackend"}}, `@task` functions run as
Backlot jobs: `.enqueue()` writes a ledger row in the caller's transaction and publishes it on
commit (jobs.enqueue.submit), one platform job (`jobs.standard_task`) imports the task by
its module path and calls it on a worker, so retries, dead letters and status are the
platform's, and `get_result()` reads the ledger row from any process. See docs/tasks-api.md.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import django
from django.core import checks
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

# The same API under two names: Django 6's built-in django.tasks, or on Django 5.2 the
# django-tasks backport it was merged from (renamed InvalidTaskError → InvalidTask on the way).
# mypy reads the backport's branch: it is typed, and Django 5.2's stubs have no django.tasks.
if TYPE_CHECKING or django.VERSION < (6, 0):
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json
else:
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

from jobs.broker import running
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import UnknownTask
from jobs.core.payload import json_problem, payload_check
from jobs.core.policies import Permanent
from jobs.enqueue import submit as enqueue
from jobs.models import DeadLetter, Job, JobState
from jobs.worker.decorators import job
from jobs.worker.task import PlatformTask

T = TypeVar("T")
P = ParamSpec("P")

# The one platform job that runs every standard task; its ledger rows are the TaskResults.
RUNNER_NAME = "jobs.standard_task"
# The ledger counts runs but does not record which worker made each: one entry per run keeps
# TaskResult.attempts right (a running task's own context names its real worker).
UNRECORDED_WORKER = "backlot"

STATUS_OF_STATE = {
    JobState.QUEUED: TaskResultStatus.READY,
    JobState.SCHEDULED: TaskResultStatus.READY,
    JobState.RETRYING: TaskResultStatus.READY,  # "ready to be executed again"
    JobState.RUNNING: TaskResultStatus.RUNNING,
    JobState.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    JobState.DEAD: TaskResultStatus.FAILED,
    JobState.CANCELLED: TaskResultStatus.FAILED,  # with the cancellation in its errors
}
FINISHED = frozenset({TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED})


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def backlot_priority(priority: int) -> int:
    """Map a Tasks API priority (-100..100, default 0) onto Backlot's 0..9 (default 5).

    0 maps to Backlot's default 5, so standard tasks compete evenly with @job ones; the four
    levels above share 1..100 (25 each) and the five below share -1..-100 (20 each):
    100..76 → 9, 75..51 → 8, 50..26 → 7, 25..1 → 6, 0 → 5, -1..-20 → 4, -21..-40 → 3,
    -41..-60 → 2, -61..-80 → 1, -81..-100 → 0.
    """
    if priority >= 0:
        return 5 + _ceil_div(priority * 4, 100)
    return 5 - _ceil_div(-priority * 5, 100)


class CeleryBackend(BaseTaskBackend):
    """Runs Tasks API tasks as Backlot jobs on the Celery workers (see the module docstring).

    QUEUES defaults to every queue Backlot declares (BACKLOT["QUEUES"]); ``QUEUES: []`` is
    Django's "any queue" (of those Backlot declares: no worker consumes another); naming one
    that Backlot does not declare fails `manage.py check`. A queue refused at enqueue is
    Django's InvalidTask with Django's message ("Queue '...' is not valid for backend."), then
    which queues are.
    """

    supports_defer = True  # run_after: a countdown in Redis, or a scheduled ledger row
    supports_async_task = True  # coroutines run to completion in the worker (async_to_sync)
    supports_get_result = True  # the ledger row, from any process
    supports_priority = True  # mapped onto Redis priority levels, see backlot_priority

    def __init__(self, alias: str, params: dict) -> None:
        super().__init__(alias, params)
        given = params.get("QUEUES")
        # Django's "any queue": empty (BaseTaskBackend checks none); absent: Backlot's queues.
        self.queues = set(backlot_settings().QUEUES if given is None else given)

    def validate_task(self, task: Task) -> None:
        declared = backlot_settings().QUEUES
        accepted = (self.queues or set(declared)) & set(declared)
        if task.queue_name not in accepted:
            raise InvalidTask(
                f"Queue '{task.queue_name}' is not valid for backend. Task {task.module_path}: "
                f"Backlot's workers consume {', '.join(sorted(accepted))} "
                f"(BACKLOT['QUEUES'], TASKS[{self.alias!r}]['QUEUES'])."
            )
        super().validate_task(task)

    def enqueue(
        self,
        task: Task[P, T],
        args: P.args,  # type: ignore[valid-type]
        kwargs: P.kwargs,  # type: ignore[valid-type]
    ) -> TaskResult[T]:
        """Write the ledger row now (in the caller's transaction); publish after commit."""
        self.validate_task(task)
        json_args, json_kwargs = _json_arguments(task, args, kwargs)
        handle = enqueue.enqueue(
            task=standard_task,
            args=[task.module_path, json_args, json_kwargs],
            kwargs={
                "backend": self.alias,
                "priority": task.priority,
                "run_after": task.run_after.isoformat() if task.run_after else None,
            },
            priority=backlot_priority(task.priority),
            eta=task.run_after,
            queue=task.queue_name,
        )
        result: TaskResult[T] = TaskResult(
            task=task,
            id=handle.id,
            status=TaskResultStatus.READY,
            enqueued_at=handle.enqueued_at
            or Job.objects.values_list("enqueued_at", flat=True).get(id=handle.id),
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=json_args,
            kwargs=json_kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        # Like the message, the signal waits for the commit (at once outside a transaction).
        transaction.on_commit(lambda: task_enqueued.send(type(self), task_result=result))
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's state as the ledger holds it; TaskResultDoesNotExist for unknown ids."""
        try:
            key = uuid.UUID(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        row = Job.objects.filter(id=key, task_name=RUNNER_NAME).first()
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        try:
            task = _task_of(row)
        except UnknownTask as exc:
            raise TaskResultDoesNotExist(f"{result_id}: {exc}") from exc
        result = _task_result(row, task)
        if result.status == TaskResultStatus.READY and str(row.pk) in running.unclaimed([row]):
            _started(result)  # its run started without writing its claim (DEFER_CLAIM)
        return result

    def check(self, **kwargs: Any) -> Iterable[checks.CheckMessage]:
        unknown = sorted(self.queues - set(backlot_settings().QUEUES))
        if unknown:
            yield checks.Error(
                f"TASKS[{self.alias!r}]['QUEUES'] names {', '.join(unknown)}, which Backlot "
                "does not declare: no worker would consume them.",
                hint=f"Use names from BACKLOT['QUEUES']: {', '.join(backlot_settings().QUEUES)}.",
                id="jobs.tasks.E001",
            )


def _json_arguments(task: Task, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """The arguments as plain JSON values: TypeError, as Django's backends raise, naming the
    first value that isn't; InvalidPayload for arguments past BACKLOT['MAX_PAYLOAD_BYTES']."""
    try:
        args, kwargs = normalize_json(args), normalize_json(kwargs)
    except (TypeError, ValueError) as exc:
        problem = json_problem(list(args), "args") or json_problem(dict(kwargs), "kwargs")
        raise TypeError(f"{task.module_path}: {problem or exc}") from exc
    payload_check(
        task_name=task.module_path,
        args=list(args),
        kwargs=dict(kwargs),
        max_bytes=backlot_settings().MAX_PAYLOAD_BYTES,
    )
    return list(args), dict(kwargs)


def _import_task(path: str) -> Task:
    try:
        found = import_string(path)
    except ImportError as exc:
        raise UnknownTask(f"Task {path} cannot be imported (renamed or removed?): {exc}") from exc
    if not isinstance(found, Task):
        raise UnknownTask(f"{path} is a {type(found).__name__}, not a @task")
    return found


def _task_of(row: Job) -> Task:
    """The Task as it was enqueued: its function, with the priority, queue and run_after used."""
    path = row.args[0]
    options = row.kwargs
    run_after = options.get("run_after")
    return _import_task(path).using(
        priority=options.get("priority", 0),
        queue_name=row.queue,
        backend=options.get("backend"),
        run_after=datetime.fromisoformat(run_after) if run_after else None,
    )


def _exception_path(name: str) -> str:
    """Ledger names builtins bare ("ValueError"); TaskError wants an importable path."""
    return name if "." in name else f"builtins.{name}"


def _errors(row: Job) -> list[TaskError]:
    """One TaskError per failed run the ledger keeps (the newest 20).

    The ledger keeps the exception class and message of each run; the full traceback is kept
    for the run that gave up (in its dead letter).
    """
    failures = list(row.failures or [])
    final_traceback = None
    if row.state == JobState.DEAD:
        final_traceback = (
            DeadLetter.objects.filter(job_id_value=row.id)
            .order_by("-last_failed_at")
            .values_list("traceback", flat=True)
            .first()
        )
    errors = []
    for index, failure in enumerate(failures):
        text = f"{failure['exception']}: {failure['message']}"
        if final_traceback and index == len(failures) - 1:
            text = final_traceback
        errors.append(
            TaskError(exception_class_path=_exception_path(failure["exception"]), traceback=text)
        )
    if row.state == JobState.CANCELLED:
        errors.append(
            TaskError(
                exception_class_path="jobs.core.exceptions.JobCancelled",
                traceback=f"jobs.core.exceptions.JobCancelled: job {row.id} was cancelled",
            )
        )
    return errors


def _task_result(row: Job, task: Task) -> TaskResult[Any]:
    """A TaskResult read from the job's ledger row."""
    status = STATUS_OF_STATE[JobState(row.state)]
    result: TaskResult[Any] = TaskResult(
        task=task,
        id=str(row.id),
        status=status,
        enqueued_at=row.enqueued_at,
        started_at=row.started_at,
        finished_at=row.finished_at if status in FINISHED else None,
        last_attempted_at=row.last_started_at,
        args=row.args[1],
        kwargs=row.args[2],
        backend=task.backend,
        errors=_errors(row),
        worker_ids=[UNRECORDED_WORKER] * row.attempts,
    )
    # The UPDATE that finished the run stored its return value in the row (JobState.SUCCEEDED).
    object.__setattr__(
        result, "_return_value", row.result if status == TaskResultStatus.SUCCESSFUL else None
    )
    return result


def _started(result: TaskResult[Any]) -> None:
    """A result read from a waiting row whose run has started (DEFER_CLAIM: the row is written
    at its finish): running, attempted now."""
    now = timezone.now()
    object.__setattr__(result, "status", TaskResultStatus.RUNNING)
    object.__setattr__(result, "started_at", result.started_at or now)
    object.__setattr__(result, "last_attempted_at", now)


def _announce_failure(exc: BaseException, args: tuple, kwargs: dict) -> None:
    """on_dead: the job gave up (its dead letter is written); tell task_finished receivers."""
    job_id = standard_task.request.id
    row = Job.objects.filter(id=job_id).first() if job_id else None
    if row is None:
        return
    try:
        task = _task_of(row)
    except (UnknownTask, InvalidTask):
        return  # nothing a receiver could be given; the dead letter says why
    task_finished.send(type(task.get_backend()), task_result=_task_result(row, task))


# exit_is_failure: a task's SystemExit or KeyboardInterrupt is its failure, recorded once
# (jobs.worker.execution), not the end of the pool process and a redelivery.
@job(name=RUNNER_NAME, bind=True, on_dead=_announce_failure, exit_is_failure=True)
def standard_task(
    self: PlatformTask,
    path: str,
    args: list[Any],
    kwargs: dict[str, Any],
    *,
    backend: str = "default",
    priority: int = 0,
    run_after: str | None = None,
) -> Any:
    """Run the Tasks API task at `path`; failures follow the platform's retry policy.

    backend, priority and run_after describe the enqueue, for the TaskResult and TaskContext.
    """
    request = self.request
    row = Job.objects.filter(id=request.id).first() if request.id else None
    if row is None:  # eager mode or a direct call: no ledger row to report from
        raise Permanent(f"Task {path} runs only through the Tasks API backend, as a tracked job")
    try:
        task = _task_of(row)
    except (UnknownTask, InvalidTask) as exc:
        raise Permanent(f"Task {path} cannot run: {exc}") from exc
    result = _task_result(row, task)
    if result.status != TaskResultStatus.RUNNING:  # its claim not written yet (DEFER_CLAIM)
        _started(result)
    worker_ids = [*result.worker_ids[:-1], request.hostname or UNRECORDED_WORKER]
    object.__setattr__(result, "worker_ids", worker_ids)
    sender = type(task.get_backend())
    task_started.send(sender, task_result=result)

    if task.takes_context:
        value = task.call(TaskContext(task_result=result), *args, **kwargs)
    else:
        value = task.call(*args, **kwargs)
    value = _json_return_value(path, value)
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    task_finished.send(sender, task_result=result)
    return value


def _json_return_value(path: str, value: Any) -> Any:
    """The return value as JSON, or TypeError as Django records it (the policy retries no
    TypeError: one run, FAILED with builtins.TypeError)."""
    with contextlib.suppress(TypeError, ValueError):  # json_problem names the offending value
        value = normalize_json(value)
    problem = json_problem(value, "the return value")
    if problem:
        raise TypeError(f"Task {path} returned a value that cannot be stored: {problem}")
    return value
