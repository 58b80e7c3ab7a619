"""PlatformTask: the one Celery task class behind every @job.

On the caller's side it turns apply_async/delay into a ledger-backed enqueue. On the worker's
side (`__call__`) it takes a rate-limit token, claims the ledger row, runs the job, and on
failure asks the retry policy whether to retry later or give up into the dead letters — all
before Celery acknowledges the message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from . import services, telemetry
from .exceptions import BrokerUnavailable
from .lease import renewer
from .models import Job
from .policies import DEFAULT_POLICY, Permanent, Retryable, RetryPolicy, TimeLimitHit
from .progress import ProgressThrottle
from .ratelimit import RateLimiter

logger = logging.getLogger(__name__)

RateKey = Callable[[tuple, dict], Any] | str


class PlatformTask(Task):
    """Base class installed by @job; the class attributes below are set per job."""

    Request = "jobs.request:PlatformRequest"
    acks_late = True
    reject_on_worker_lost = True
    # Backlot options (see jobs.decorators.job)
    policy: RetryPolicy = DEFAULT_POLICY
    track: bool = True
    queue_name: str = "default"  # not Celery's `queue` attribute, which 6.0 removes
    default_priority: int = 5
    cluster_rate_limit: str | Mapping[str, str] | None = None
    rate_key: RateKey | None = None
    # Called as on_dead(exc, args, kwargs) after the job gave up and its dead letter is written.
    on_dead: Callable[[BaseException, tuple, dict], None] | None = None

    # --- caller's side -----------------------------------------------------------------
    def enqueue(
        self,
        *args: Any,
        idempotency_key: str | None = None,
        priority: int | None = None,
        delay: float | None = None,
        eta: datetime | None = None,
        on_commit: bool = True,
        owner: Any = None,
        **kwargs: Any,
    ) -> services.JobHandle:
        """Accept the job; see jobs.services.job_enqueue."""
        return services.job_enqueue(
            task=self,
            args=args,
            kwargs=kwargs,
            idempotency_key=idempotency_key,
            priority=priority,
            delay=delay,
            eta=eta,
            on_commit=on_commit,
            owner=owner,
        )

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
        # Plain Celery .delay()/.apply_async(): the same ledger-backed path as enqueue().
        passthrough = {k: v for k, v in options.items() if k not in _ENQUEUE_OPTIONS}
        if link is not None:
            passthrough["link"] = link
        if link_error is not None:
            passthrough["link_error"] = link_error
        priority = options.get("priority")
        handle = services.job_enqueue(
            task=self,
            args=args or (),
            kwargs=kwargs or {},
            queue=options.get("queue"),
            # Backlot's scale: 0 (lowest) to 9 (highest); larger values (AMQP's 0-255) clamp.
            priority=None if priority is None else max(0, min(9, int(priority))),
            delay=options.get("countdown"),
            eta=options.get("eta"),
            task_id=task_id,
            publish_options=passthrough,
        )
        return self.AsyncResult(handle.id)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's retry() maps onto the retry policy: a Retryable with the asked delay."""
        raise Retryable(str(exc or "retry requested"), retry_after=countdown) from exc

    # --- worker's side -----------------------------------------------------------------
    def progress(self, done: int, total: int | None = None, message: str = "") -> None:
        """Report progress, visible in the ledger and the status API.

        Throttled to one write per BACKLOT['PROGRESS_INTERVAL'] seconds: a call inside the
        interval is kept and written when the interval ends (so the latest step shows even if
        the job then blocks), and the final step (done >= total) is written at once.
        """
        request = self.request
        if not self.track or not request.id or request.called_directly:
            return
        throttle = getattr(request, "_backlot_progress", None)
        if throttle is None:
            # Kept on Celery's per-request Context (which declares no such attribute).
            throttle = request._backlot_progress = ProgressThrottle(  # type: ignore[attr-defined]
                request.id, settings.BACKLOT["PROGRESS_INTERVAL"]
            )
        throttle.report(done, total, message)

    def lease_seconds(self) -> float:
        return float(settings.BACKLOT["LEASE_SECONDS"])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager or not request.id:
            return self.run(*args, **kwargs)
        try:
            if self.cluster_rate_limit and not self._take_rate_slot(args, kwargs):
                raise Ignore()
            claim = None
            if self.track:
                claim = services.job_claim(
                    job_id=request.id,
                    lease_seconds=self.lease_seconds(),
                    adopt=Job(
                        id=request.id,
                        task_name=self.name,
                        args=list(args),
                        kwargs=dict(kwargs),
                        queue=self._queue_of_request(),
                        priority=self._priority_of_request(),
                        max_attempts=self.policy.max_attempts,
                    ),
                )
                if claim is None:
                    raise Ignore()
        except (DatabaseError, RedisError, KombuError, OSError) as exc:
            # The ledger or Redis is unreachable: hand the message back rather than ack it.
            logger.warning("Job %s could not be claimed (%s); message requeued", request.id, exc)
            raise Reject(str(exc), requeue=True) from exc
        except (Ignore, Reject):
            raise
        except Exception as exc:  # e.g. a broken rate_key: the job cannot start, record why
            services.dead_letter_create(
                task=self,
                job_id=request.id,
                args=args,
                kwargs=kwargs,
                attempt=0,
                exc=exc,
                priority=self._priority_of_request(),
                queue=self._queue_of_request(),
            )
            self._event("dead", 0)
            self.gave_up(exc, args, kwargs)
            raise
        attempt = claim.attempt if claim else (request.retries or 0) + 1
        failures = claim.failures if claim else []
        self._event("started", attempt)
        if claim:
            renewer.hold(job_id=request.id, attempt=attempt, lease_seconds=self.lease_seconds())
        started = time.monotonic()
        try:
            result = self.run(*args, **kwargs)
        except Retry:
            raise
        except Ignore:  # the job decided it has nothing (more) to do
            self._finished(attempt, started, None)
            raise
        except Reject as exc:
            # celery-types omits Reject's requeue/reason, which Reject.__init__ sets.
            if exc.requeue and self.track:  # type: ignore[attr-defined]
                services.job_release(job_id=request.id)
                raise
            self._attempt_failed(
                Permanent(f"rejected: {exc.reason}"),  # type: ignore[attr-defined]
                args=args,
                kwargs=kwargs,
                attempt=attempt,
                failures=failures,
                run_seconds=time.monotonic() - started,
            )
            raise
        except Exception as exc:
            self._attempt_failed(
                exc,
                args=args,
                kwargs=kwargs,
                attempt=attempt,
                failures=failures,
                run_seconds=time.monotonic() - started,
            )
            raise  # gave up: Celery records the failure and acknowledges after the dead letter
        finally:
            if claim:
                renewer.release(request.id)
            throttle = getattr(request, "_backlot_progress", None)
            if throttle is not None:
                throttle.close()
        self._finished(attempt, started, result)
        return result

    def _finished(self, attempt: int, started: float, result: Any) -> None:
        duration = time.monotonic() - started
        if self.track:
            services.job_succeeded(
                job_id=self._job_id(), attempt=attempt, run_seconds=duration, result=result
            )
        self._event("succeeded", attempt, duration)

    def _event(self, event: str, attempt: int, duration: float | None = None) -> None:
        telemetry.job_event(
            event,
            job_id=self._job_id(),
            task=self.name,
            queue=self._queue_of_request(),
            attempt=attempt,
            duration=duration,
        )

    def _attempt_failed(
        self,
        exc: BaseException,
        *,
        args: tuple,
        kwargs: dict,
        attempt: int,
        failures: list[dict[str, Any]],
        run_seconds: float | None = None,
        traceback: str = "",
    ) -> None:
        """Retry later (raising celery's Retry) or write the dead letter and return."""
        reason = (
            TimeLimitHit(str(exc) or "soft time limit")
            if isinstance(exc, SoftTimeLimitExceeded)
            else exc
        )
        job_id = self._job_id()
        if self.policy.should_retry(reason, attempt):
            delay = self.policy.delay_for(attempt)
            if isinstance(reason, Retryable) and reason.retry_after is not None:
                delay = max(0.0, float(reason.retry_after))
            if not self._schedule_retry(
                job_id, args, kwargs, attempt, failures, reason, delay, run_seconds
            ):
                raise Ignore()  # this run lost its claim; the job's current run decides
            self._event("retrying", attempt, run_seconds)
            # celery-types wants an Exception and a numbers.Real; Celery takes any exception
            # and a float delay.
            raise Retry(exc=reason, when=delay)  # type: ignore[arg-type]
        services.dead_letter_create(
            task=self,
            job_id=job_id,
            args=args,
            kwargs=kwargs,
            attempt=attempt,
            exc=reason,
            traceback=traceback,
            failures=failures,
            run_seconds=run_seconds,
            priority=self._priority_of_request(),
            queue=self._queue_of_request(),
            claimed_attempt=attempt if self.track else None,
        )
        self._event("dead", attempt, run_seconds)
        self.gave_up(reason, args, kwargs)

    def _job_id(self) -> str:
        """The running job's id: __call__ runs a request without one directly, so the worker
        paths that record attempts always have it."""
        job_id = self.request.id
        if job_id is None:
            raise RuntimeError(f"{self.name}: no job id outside a worker run")
        return job_id

    def gave_up(self, exc: BaseException, args: tuple, kwargs: dict) -> None:
        """Run the job's on_dead hook; its failure is logged, never raised over the original."""
        if self.on_dead is None:
            return
        try:
            self.on_dead(exc, tuple(args), dict(kwargs))
        except Exception:
            logger.exception("on_dead hook of %s failed", self.name)

    def _schedule_retry(
        self,
        job_id: str,
        args: tuple,
        kwargs: dict,
        attempt: int,
        failures: list[dict[str, Any]],
        exc: BaseException,
        delay: float,
        run_seconds: float | None,
    ) -> bool:
        """Record the failed attempt and publish the next; False if this run lost its claim."""
        due: datetime | None = timezone.now() + timedelta(seconds=delay)
        if self.track:
            due = services.job_retry_later(
                job_id=job_id,
                attempt=attempt,
                failures=failures,
                exc=exc,
                delay=delay,
                run_seconds=run_seconds or 0.0,
            )
            if due is None:
                return False
            if delay > settings.BACKLOT["MAX_BROKER_COUNTDOWN"]:
                return True  # a long wait stays in the ledger; the relay publishes it when due
        if not self._resend(args, kwargs, due, {"retries": attempt}) and not self.track:
            raise BrokerUnavailable(f"Retry of untracked job {job_id} could not be published")
        return True

    def _resend(
        self,
        args: tuple,
        kwargs: dict,
        due: Any,
        options: dict[str, Any],
        mark_published: bool = True,
    ) -> bool:
        """Publish this job's message again (same id) for `due`; the relay covers a failure.

        Canvas links (chain, chord, group, callbacks) ride along, so a retried chord member
        still counts toward its chord.
        """
        carried = {
            key: value
            for key, value in self.request.as_execution_options().items()
            if value is not None and key not in _NOT_CARRIED
        }
        job = Job(
            id=self.request.id,
            args=list(args),
            kwargs=dict(kwargs),
            queue=self._queue_of_request(),
            priority=self._priority_of_request(),
            scheduled_for=due,
        )
        return services.job_publish(
            job=job, task=self, options={**carried, **options}, mark_published=mark_published
        )

    def _priority_of_request(self) -> int:
        delivery = self.request.delivery_info or {}
        broker = delivery.get("priority")
        return 9 - broker if isinstance(broker, int) else self.default_priority

    def _queue_of_request(self) -> str:
        delivery = self.request.delivery_info or {}
        return delivery.get("routing_key") or self.queue_name

    def _take_rate_slot(self, args: tuple, kwargs: dict) -> bool:
        """True when the job may run now; otherwise it is re-sent for its turn (no attempt)."""
        request = self.request
        slot = getattr(request, "backlot_rate_slot", None)
        if slot is not None and slot <= time.time() + 0.05:
            return True
        bucket, rate = self.rate_bucket(args, kwargs)
        if rate is None:
            return True
        decision = RateLimiter().acquire(bucket, rate)
        if decision.allowed:
            return True
        headers = {"backlot_rate_slot": time.time() + decision.wait} if decision.reserved else {}
        # An unreserved wait can be long ("1/h"): never park a message in Redis past the
        # visibility timeout; it comes back, asks again and waits some more.
        wait = min(decision.wait, settings.BACKLOT["MAX_BROKER_COUNTDOWN"])
        due = timezone.now() + timedelta(seconds=wait)
        if not self._resend(
            args,
            kwargs,
            due,
            {"retries": request.retries or 0, "headers": headers},
            mark_published=False,
        ):
            raise Reject("rate-limited job could not be re-sent", requeue=True)
        telemetry.record_rate_limited(self.name)
        logger.debug("Job %s rate-limited on %s; back in %.2fs", request.id, bucket, decision.wait)
        return False

    def rate_bucket(self, args: tuple, kwargs: dict) -> tuple[str, str | None]:
        """The bucket name and rate for this call (per key when rate_key is set)."""
        key = None
        if isinstance(self.rate_key, str):
            key = kwargs.get(self.rate_key)
        elif callable(self.rate_key):
            key = self.rate_key(args, kwargs)
        limit = self.cluster_rate_limit
        rate = limit.get(str(key), limit.get("*")) if isinstance(limit, Mapping) else limit
        return (self.name if key is None else f"{self.name}:{key}"), rate


# Message options a re-sent job does not inherit from the delivery it replaces.
_NOT_CARRIED = frozenset(
    {"task_id", "headers", "retries", "expires", "time_limit", "soft_time_limit"}
)
# Options apply_async takes over into the ledger row; the rest pass through to the message.
_ENQUEUE_OPTIONS = frozenset({"priority", "countdown", "eta", "queue"})
