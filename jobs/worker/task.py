"""PlatformTask: the one Celery task class behind every @job, thin over jobs.enqueue.submit (the
caller's side) and jobs.worker.execution (the worker's side).

``email_send.enqueue(1, "x")`` is type-checked against the job function's signature;
enqueue options go through ``using()``: ``email_send.using(priority=9, owner=user).enqueue(1)``
(the way django-tasks' ``Task.using()`` does it). Plain Celery ``.delay()`` and
``.apply_async()`` take the same ledger-backed path.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, ParamSpec, TypeVar

from celery.utils.time import maybe_iso8601, maybe_make_aware
from django.db import models
from django.utils import timezone

from jobs.core import context
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import JobCancelled
from jobs.core.policies import DEFAULT_POLICY, RetryPolicy
from jobs.core.states import FINISHED_STATES, JobState
from jobs.enqueue import submit as enqueuing
from jobs.enqueue.submit import JobHandle
from jobs.models import Job
from jobs.worker import execution, outcomes, steps
from jobs.worker.celery_task import CeleryTaskAPI
from jobs.worker.progress import ProgressThrottle

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

RateKey = Callable[[tuple, dict], Any] | str
# enqueue() options a caller may pass with using(), or (untyped) to enqueue() itself.
ENQUEUE_OPTIONS = frozenset(
    {"idempotency_key", "priority", "delay", "eta", "on_commit", "owner", "queue"}
)
# A running job reads its cancellation request at most this often (seconds): a progress() loop
# of 100,000 steps costs a handful of reads, and a cancel is seen within half a second.
CANCEL_CHECK_INTERVAL = 0.5
# Options apply_async takes over into the ledger row; the rest pass through to the message.
_APPLY_OPTIONS = frozenset({"priority", "countdown", "eta", "queue", "owner", "idempotency_key"})


def _absolute_expiry(expires: Any) -> str:
    """Celery's expires (seconds from now, a datetime or an ISO 8601 string) as an absolute
    time: the ledger keeps it, so a message the relay sends later expires when asked."""
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        return (timezone.now() + timedelta(seconds=float(expires))).isoformat()
    if isinstance(expires, datetime):
        return maybe_make_aware(expires).isoformat()
    if isinstance(expires, str) and maybe_iso8601(expires) is not None:
        return expires
    raise ValueError(f"expires must be seconds, a datetime or an ISO 8601 time, got {expires!r}")


@dataclass(frozen=True)
class Enqueuer(Generic[P, R]):
    """A job with enqueue options bound: ``.enqueue(*args, **kwargs)`` accepts it."""

    task: PlatformTask[P, R]
    options: Mapping[str, Any] = field(default_factory=dict)

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        call_args, call_kwargs = self.task.serializable_arguments(args, kwargs)
        return enqueuing.enqueue(task=self.task, args=call_args, kwargs=call_kwargs, **self.options)


class PlatformTask(CeleryTaskAPI[P, R]):
    """Base class installed by @job; the class attributes below are set per job."""

    Request = "jobs.worker.request:PlatformRequest"
    acks_late = True
    reject_on_worker_lost = True
    # Backlot options (see jobs.worker.decorators.job)
    policy: RetryPolicy = DEFAULT_POLICY
    track: bool = True
    queue_name: str = "default"  # not Celery's `queue` attribute, which 6.0 removes
    default_priority: int = 5
    # Whether the declaration named queue_name (@job(queue=...), an adopted task's queue=): it
    # then wins over CELERY_TASK_ROUTES, as a Celery task's queue attribute does
    # (jobs.enqueue.routing).
    queue_declared: bool = False
    cluster_rate_limit: str | Mapping[str, str] | None = None
    rate_key: RateKey | None = None
    # At most this many running at once per concurrency_key value, cluster-wide (jobs.broker.slots).
    concurrency_limit: int | Mapping[str, int] | None = None
    concurrency_key: RateKey | None = None
    # Called as on_dead(exc, args, kwargs) after the job gave up and its dead letter is written.
    on_dead: Callable[[BaseException, tuple, dict], None] | None = None
    # "cooperative": a cancel stops the run at its next progress() call (JobCancelled);
    # "terminate": its pool process (and the processes it started) is killed.
    cancel_mode: str = "cooperative"
    # Called as on_cancelled(args, kwargs) once the job is cancelled (in the canceller's process
    # for a job that never ran, in the worker for a stopped run).
    on_cancelled: Callable[[tuple, dict], None] | None = None

    # --- caller's side -----------------------------------------------------------------
    def using(
        self,
        *,
        idempotency_key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        eta: datetime | None = None,
        on_commit: bool = True,
        owner: Any = None,
        queue: str | None = None,
        job_id: uuid.UUID | str | None = None,
        alongside: models.Model | None = None,
    ) -> Enqueuer[P, R]:
        """This job with enqueue options; see jobs.enqueue.submit.enqueue.

        ``job_id`` (a UUID the caller made) lets a view write its own row with the job's id in
        its INSERT instead of an UPDATE after the enqueue. ``alongside`` (a new model instance)
        is inserted with the job, on PostgreSQL in the job's own statement: the view's row and
        its job are atomic in one round trip, no transaction around them. Both only here, not
        among the options enqueue() takes by name: a job function may well have an argument
        called job_id.
        """
        return Enqueuer(
            self,
            {
                "idempotency_key": idempotency_key,
                "priority": priority,
                "delay": delay,
                "eta": eta,
                "on_commit": on_commit,
                "owner": owner,
                "queue": queue,
                "job_id": job_id,
                "alongside": alongside,
            },
        )

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobHandle:
        """Accept the job with these arguments: its ledger row now, its message after commit.

        Enqueue options belong in using(); passed here by name they still apply (untyped).
        """
        options: dict[str, Any] = {key: kwargs.pop(key) for key in ENQUEUE_OPTIONS & kwargs.keys()}
        call_args, call_kwargs = self.serializable_arguments(args, kwargs)
        return enqueuing.enqueue(task=self, args=call_args, kwargs=call_kwargs, **options)

    def delay_on_commit(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Celery's ``delay_on_commit`` (celery.contrib.django.task.DjangoTask): returns None,
        the message is published once the caller's transaction commits, and nothing is sent if
        it rolls back. On top of Celery's: the job's ledger row is written now, in that same
        transaction (it commits or rolls back with the caller's rows), so a bad payload is
        refused here rather than inside the commit."""
        self.apply_async(args, kwargs)

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """Celery's ``apply_async_on_commit``: apply_async's options, delay_on_commit's
        semantics (None; published after commit; the ledger row written in the transaction)."""
        self.apply_async(*args, **kwargs)

    def serializable_arguments(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The arguments as they will be serialized: a ``pydantic=True`` task's models dumped
        the way Celery's apply_async dumps them (so the ledger row, the payload check and the
        message hold the same JSON), any other argument as it is."""
        dump = getattr(self, "_dump_pydantic_arguments", None)
        if dump is None:
            return args, kwargs
        dumped: tuple[Any, Any] = dump(args, kwargs)
        return dumped

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        if options.pop("_backlot_internal", False) or self.app.conf.task_always_eager:
            return super().apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=producer,
                link=link,
                link_error=link_error,
                shadow=shadow,
                **options,
            )
        # Plain Celery .delay()/.apply_async() (canvas members and callbacks too): the same
        # ledger-backed path as enqueue(), Backlot's owner= and idempotency_key= included;
        # per-call time_limit/soft_time_limit ride in the message and stay with the row.
        passthrough = {k: v for k, v in options.items() if k not in _APPLY_OPTIONS}
        if passthrough.get("expires") is not None:
            passthrough["expires"] = _absolute_expiry(passthrough["expires"])
        if link is not None:
            passthrough["link"] = link
        if link_error is not None:
            passthrough["link_error"] = link_error
        hard, soft = options.get("time_limit"), options.get("soft_time_limit")
        if hard is not None and soft is None:
            # As @job does: unset, the soft limit is CELERY_TASK_SOFT_TIME_LIMIT's, and the
            # pool arms the hard one only once the soft one fired, however far later that is.
            passthrough["soft_time_limit"] = soft = hard * 0.9
        if hard is not None and soft > hard:
            raise ValueError(f"soft_time_limit ({soft}) exceeds time_limit ({hard})")
        priority = options.get("priority")
        if options.get("serializer") != "pickle":  # refused by the payload check anyway
            args, kwargs = self.serializable_arguments(args, kwargs)
        sent_from, parent_stopping = self._sent_from_worker()
        with sent_from:
            handle = enqueuing.enqueue(
                task=self,
                args=args or (),
                kwargs=kwargs or {},
                queue=options.get("queue"),
                # Backlot's scale: 0 (lowest) to 9 (highest); larger values (AMQP's 0-255) clamp.
                priority=None if priority is None else max(0, min(9, int(priority))),
                delay=options.get("countdown"),
                eta=options.get("eta"),
                owner=options.get("owner"),
                idempotency_key=options.get("idempotency_key"),
                task_id=task_id,
                publish_options=passthrough,
                parent_stopping=parent_stopping,
            )
        result = self.AsyncResult(handle.id)
        # As Celery's send_task: a call that ignores its result gets None from get() at once.
        result.ignored = bool(options.get("ignore_result", False))
        return result

    def _sent_from_worker(self) -> tuple[AbstractContextManager[None], bool | None]:
        """A chord's callback (sent by the result backend once the last member finished), a
        link callback and a chain's next step are sent after that member's run returned,
        outside jobs.core.context's running job: they are still its children, and belong to its
        owner. Also whether that job is stopping (cancelled), known once it has finished (its
        children are then born cancelled or not, all alike), else None (enqueue reads it)."""
        current = self.app.current_worker_task
        request = getattr(current, "request", None)
        job_id = getattr(request, "id", None)
        if (
            context.running_job() is not None
            or not isinstance(current, PlatformTask)
            or not current.track
            or not job_id
        ):
            return nullcontext(), None
        # Read once per run: a group of 1,000 members sent after it asks for each of them.
        known = getattr(request, "_backlot_parent", None)
        if known is None or known[0] != job_id:
            row = (
                Job.objects.filter(id=job_id)
                .values_list("owner_id", "state", "cancel_requested_at")
                .first()
            )
            owner_id, state, cancel_requested_at = row or (None, None, None)
            stopping = (
                (state == JobState.CANCELLED or cancel_requested_at is not None)
                if state in FINISHED_STATES
                else None  # still running: a cancel may come; enqueue asks each time
            )
            known = (job_id, owner_id, stopping)
            if stopping is not None:
                request._backlot_parent = known  # type: ignore[union-attr]
        return context.running(str(job_id), known[1]), known[2]

    # --- worker's side -----------------------------------------------------------------
    def progress(self, done: int, total: int | None = None, message: str = "") -> None:
        """Report progress, visible in the ledger and the status API.

        Throttled to one write per BACKLOT['PROGRESS_INTERVAL'] seconds: a call inside the
        interval is kept and written when the interval ends (so the latest step shows even if
        the job then blocks), and the final step (done >= total) is written at once.

        Raises JobCancelled once the job was asked to stop (see cancelled()).
        """
        request = self.request
        if not self.track or not request.id or request.called_directly:
            return
        throttle = getattr(request, "_backlot_progress", None)
        if throttle is None:
            # Kept on Celery's per-request Context (which declares no such attribute).
            throttle = request._backlot_progress = ProgressThrottle(  # type: ignore[attr-defined]
                request.id, backlot_settings().PROGRESS_INTERVAL
            )
        now = time.monotonic()
        # A tight loop calls this ~a million times a second: the cancel check (attribute reads
        # on Celery's request, and a ledger read per CANCEL_CHECK_INTERVAL) runs only when the
        # throttle's own clock says the interval passed, not on every call.
        if now >= throttle.next_cancel_check:
            throttle.next_cancel_check = now + CANCEL_CHECK_INTERVAL
            throttle.cancel_seen = self.cancelled()
        if throttle.cancel_seen:
            raise JobCancelled(f"job {request.id} was cancelled")
        throttle.report(done, total, message, now=now)

    def cancelled(self) -> bool:
        """Whether someone asked this run to stop (jobs.cancel, the API, admin, a revoke).

        Reads the ledger at most once per CANCEL_CHECK_INTERVAL, so a loop may ask every step.
        """
        request = self.request
        if not self.track or not request.id or request.called_directly:
            return False
        # Kept on Celery's per-request Context (which declares no such attributes).
        if getattr(request, "_backlot_cancelled", False):
            return True
        now = time.monotonic()
        if now - getattr(request, "_backlot_cancel_checked", 0.0) < CANCEL_CHECK_INTERVAL:
            return False
        request._backlot_cancel_checked = now  # type: ignore[attr-defined]
        hold = getattr(request, "_backlot_hold", None)
        if hold is not None:
            hold.claim_now()  # a deferred claim is written: a cancel then finds the run running
        asked = outcomes.cancel_seen(str(request.id))
        request._backlot_cancelled = asked  # type: ignore[attr-defined]
        return asked

    def step(
        self, name: str, fn: Callable[..., T] | None = None, /, *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` as the job's step `name`: once per job. Its JSON result
        is stored (fenced by the run's claim); a retry, a redelivery after a crash or a dead
        letter's replay gets the stored result back without running it (jobs.worker.steps).

        Without `fn`, a decorator: ``@self.step("query")`` over a function makes each call of
        it the step. Names must be deterministic, asked for in the same order on every run.
        """
        if fn is None:

            def decorate(function: Callable[..., T]) -> Callable[..., T]:
                def as_step(*call_args: Any, **call_kwargs: Any) -> T:
                    result: T = steps.run_step(self, name, function, call_args, call_kwargs)
                    return result

                return as_step

            return decorate
        return steps.run_step(self, name, fn, args, kwargs)

    def sleep(self, duration: timedelta | float, *, name: str | None = None) -> None:
        """A durable sleep: the run ends without holding a worker, the job is scheduled for
        now + `duration` (seconds or a timedelta) and resumes at its next step (the steps
        before it are not run again). Not a failed attempt: max_attempts is not spent."""
        steps.sleep_for(self, duration, name)

    def sleep_until(self, when: datetime, *, name: str | None = None) -> None:
        """A durable sleep until `when` (an aware datetime); see sleep()."""
        steps.sleep_until(self, when, name)

    def wait_for(self, event: str, *, timeout: timedelta | float | None = None) -> Any:
        """Park the job (no worker held) until ``jobs.signal(job_id, event, payload)``, and
        return the payload; a signal sent before the wait is kept and returned at once. Raises
        jobs.StepTimeout once `timeout` (seconds or a timedelta; None: no limit) has passed
        without it. A step: a later run of the job gets the same payload back."""
        return steps.wait_for(self, event, timeout)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        request = self.request
        if request.called_directly or request.is_eager or not request.id:
            return self.run(*args, **kwargs)
        result: R = execution.run(self, args, kwargs)
        return result

    def rate_bucket(self, args: tuple, kwargs: dict) -> tuple[str, str | None]:
        """The bucket name and rate for this call (per key when rate_key is set)."""
        key = _key_of(self.rate_key, args, kwargs)
        limit = self.cluster_rate_limit
        rate = limit.get(str(key), limit.get("*")) if isinstance(limit, Mapping) else limit
        return (self.name if key is None else f"{self.name}:{key}"), rate

    def concurrency_slot(self, args: tuple, kwargs: dict) -> tuple[str, int | None]:
        """The slot set name and how many may run at once for this call (per key when
        concurrency_key is set; a mapping is looked up by the key, then "*")."""
        key = _key_of(self.concurrency_key, args, kwargs)
        limit = self.concurrency_limit
        most = limit.get(str(key), limit.get("*")) if isinstance(limit, Mapping) else limit
        return (self.name if key is None else f"{self.name}:{key}"), most


def _key_of(key: RateKey | None, args: tuple, kwargs: dict) -> Any:
    """A rate_key's or concurrency_key's value for a call: the named kwarg, or the callable's."""
    if isinstance(key, str):
        return kwargs.get(key)
    if callable(key):
        return key(args, kwargs)
    return None
