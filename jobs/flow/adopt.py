"""Adopt mode: a project's plain Celery tasks become platform tasks without a decorator changed.

With ``BACKLOT["ADOPT_CELERY_TASKS"] = True``, ``jobs.worker.celery.configure(app)`` makes
``AdoptedTask`` the app's task class (Celery's ``app.task_cls``, the base of every
``@shared_task`` / ``@app.task`` declared without ``base=``). A task built on it is a
PlatformTask: a ledger row at ``.delay()`` / ``.apply_async()`` / ``delay_on_commit()`` /
canvas / beat, a claim, status, dead letter and replay. Celery's own options map onto it:

- ``max_retries=N`` (Celery's default 3; ``None``, Celery's "no limit", keeps 3: Backlot never
  retries without one): N + 1 attempts, the ledger's and the API's max_attempts;
- ``self.retry(countdown=..., exc=...)`` and ``autoretry_for`` / ``retry_backoff`` /
  ``retry_backoff_max`` / ``retry_jitter`` (Celery's own wrapper computes the countdown and
  calls self.retry()): a retry after that countdown, recorded in the ledger; the policy's
  max_delay is raised to ``retry_backoff_max`` where that is longer; ``default_retry_delay``
  when the task declares it;
- any other exception fails the job at once, as in Celery (it is a dead letter, replayable);
- ``queue=``: the job's queue (BACKLOT['QUEUES'] must name it: ``manage.py check`` jobs.E003);
  without one, ``CELERY_TASK_ROUTES`` routes it (jobs.enqueue.routing), else the default queue;
- priorities are read on Celery's Redis scale, the one the project's code was written for (0
  is consumed first, 9 last; kombu's Redis transport): the job's Backlot priority (9 first) is
  ``9 - level``, for ``apply_async(priority=)`` / ``.set(priority=)`` / a beat entry's options,
  ``self.retry(priority=)``, the task's ``priority=`` and, when the task declares none,
  ``CELERY_TASK_DEFAULT_PRIORITY``; with none at all, kombu's default level 0, so Backlot's 9:
  the project's tasks keep the order they had among themselves.

Not adopted, left plain Celery tasks: ``@shared_task(backlot=False)`` (the per-task opt-out),
Celery's own ``celery.*`` tasks (chord_unlock, backend_cleanup, ...), and tasks with a
``base=`` of their own. Backlot's internal tasks are @job tasks already. A message sent before
adoption (in Redis without a ledger row) is adopted by its claim, once (jobs.ledger.claim).
"""

from __future__ import annotations

from typing import Any

from celery import Task
from celery.contrib.django.task import DjangoTask

from jobs.broker import amqp
from jobs.core.conf import backlot_settings
from jobs.core.policies import RetryPolicy
from jobs.worker.task import PlatformTask

# Celery's default max_retries (celery.app.task.Task.max_retries).
CELERY_MAX_RETRIES = 3
# kombu's Redis transport: levels 0 (consumed first) to 9; a message without one is level 0.
REDIS_LEVELS = 9
REDIS_DEFAULT_LEVEL = 0
CELERY_NAMESPACE = "celery."


def adopted_policy(max_retries: Any, retry_backoff_max: Any) -> RetryPolicy:
    """The retry policy of an adopted task: Celery's max_retries (default 3) + 1 attempts, no
    exception retried unless the task asks (self.retry, autoretry_for), as in Celery."""
    retries = max_retries if isinstance(max_retries, int) and max_retries >= 0 else None
    longest = float(retry_backoff_max) if isinstance(retry_backoff_max, (int, float)) else 0.0
    return RetryPolicy(
        max_attempts=(CELERY_MAX_RETRIES if retries is None else retries) + 1,
        retry_on=(),
        max_delay=max(RetryPolicy.max_delay, longest),
    )


def backlot_priority(level: Any) -> int:
    """A Celery-on-Redis priority level (0 first; above 9 is 9, below 0 is 0, as kombu clamps)
    as Backlot's priority (9 first). On RabbitMQ Celery's levels already run higher first, as
    Backlot's do: the level is kept (clamped to 0-9)."""
    clamped = max(0, min(REDIS_LEVELS, int(level)))
    return clamped if amqp.enabled() else REDIS_LEVELS - clamped


class AdoptedTask(PlatformTask):
    """The app's task class in adopt mode; each task's options are read when Celery builds
    its class (``type(name, (AdoptedTask,), options)``)."""

    # @shared_task(backlot=False): this task stays a plain Celery task.
    backlot: bool = True
    # Whether this task is a platform one (set per task class, below).
    adopted: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = str(vars(cls).get("name") or "")
        module = str(vars(cls).get("__module__") or "")
        cls.adopted = (
            bool(cls.backlot)
            and not name.startswith(CELERY_NAMESPACE)
            # Backlot's own plain tasks (jobs.relay, jobs.retention, ...): they are the relay
            # and housekeeping of the ledger, not jobs on it.
            and not (module == "jobs" or module.startswith("jobs."))
        )
        if not cls.adopted:
            cls.track = False
            cls.Request = Task.Request
            # Celery's own (None for reject_on_worker_lost: the app's configuration decides)
            cls.acks_late = Task.acks_late
            cls.reject_on_worker_lost = Task.reject_on_worker_lost  # type: ignore[assignment]
            return
        # (set again: an abstract base of the app's may have been built not adopted)
        cls.track = True
        cls.Request = PlatformTask.Request
        cls.acks_late = cls.reject_on_worker_lost = True
        declared = vars(cls)
        cls.policy = adopted_policy(
            declared.get("max_retries", CELERY_MAX_RETRIES), declared.get("retry_backoff_max")
        )
        # self.retry() past this fails the job with its exception (jobs.worker.celery_task).
        cls.max_retries = cls.policy.max_attempts - 1
        queue = declared.get("queue")
        if isinstance(queue, str) and queue:
            cls.queue_name, cls.queue_declared = queue, True
        else:
            cls.queue_declared = False  # CELERY_TASK_ROUTES may route it (jobs.enqueue.routing)
            queues = backlot_settings().QUEUES
            cls.queue_name = "default" if "default" in queues else queues[0]
        level = declared.get("priority")
        if level is None:  # Celery's default priority option, else kombu's default level
            app = declared.get("app")
            level = getattr(getattr(app, "conf", None), "task_default_priority", None)
        cls.default_priority = backlot_priority(REDIS_DEFAULT_LEVEL if level is None else level)

    # A task that is not adopted is Celery's (DjangoTask's) on every path.
    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        if not self.adopted:
            return Task.apply_async(self, *args, **kwargs)
        # the caller's, on Celery's Redis scale (the broker's own publish sends Redis' level)
        if kwargs.get("priority") is not None and not kwargs.get("_backlot_internal"):
            kwargs["priority"] = backlot_priority(kwargs["priority"])
        return super().apply_async(*args, **kwargs)

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        if not self.adopted:
            DjangoTask.delay_on_commit(self, *args, **kwargs)  # type: ignore[arg-type]
        else:
            super().delay_on_commit(*args, **kwargs)

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        if not self.adopted:
            DjangoTask.apply_async_on_commit(self, *args, **kwargs)  # type: ignore[arg-type]
        else:
            super().apply_async_on_commit(*args, **kwargs)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        if not self.adopted:
            return Task.retry(self, *args, **kwargs)
        if kwargs.get("priority") is not None:  # (without one, the retry keeps the job's)
            kwargs["priority"] = backlot_priority(kwargs["priority"])
        return super().retry(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.adopted:
            return Task.__call__(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)
