"""@job: declares a Celery task with Backlot's retry policy, ledger, rate limit and priority."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, overload

from celery import Task, shared_task

from jobs.broker.ratelimit import parse_rate
from jobs.core.policies import DEFAULT_POLICY, RetryPolicy
from jobs.worker.task import PlatformTask, RateKey

P = ParamSpec("P")
R = TypeVar("R")


@overload
def job(fn: Callable[P, R], /) -> PlatformTask[P, R]: ...


@overload
def job(
    *,
    name: str | None = ...,
    queue: str = ...,
    retry: RetryPolicy | None = ...,
    time_limit: float | None = ...,
    soft_time_limit: float | None = ...,
    rate_limit: str | Mapping[str, str] | None = ...,
    rate_key: RateKey | None = ...,
    concurrency: int | Mapping[str, int] | None = ...,
    concurrency_key: RateKey | None = ...,
    priority: int = ...,
    track: bool = ...,
    bind: Literal[False] = ...,
    on_dead: Callable[[BaseException, tuple, dict], None] | None = ...,
    cancel: Literal["cooperative", "terminate"] = ...,
    on_cancelled: Callable[[tuple, dict], None] | None = ...,
    **celery_options: Any,
) -> Callable[[Callable[P, R]], PlatformTask[P, R]]: ...


@overload
def job(
    *,
    name: str | None = ...,
    queue: str = ...,
    retry: RetryPolicy | None = ...,
    time_limit: float | None = ...,
    soft_time_limit: float | None = ...,
    rate_limit: str | Mapping[str, str] | None = ...,
    rate_key: RateKey | None = ...,
    concurrency: int | Mapping[str, int] | None = ...,
    concurrency_key: RateKey | None = ...,
    priority: int = ...,
    track: bool = ...,
    bind: Literal[True],
    on_dead: Callable[[BaseException, tuple, dict], None] | None = ...,
    cancel: Literal["cooperative", "terminate"] = ...,
    on_cancelled: Callable[[tuple, dict], None] | None = ...,
    **celery_options: Any,
) -> Callable[[Callable[Concatenate[Any, P], R]], PlatformTask[P, R]]: ...


def job(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    queue: str | None = None,
    retry: RetryPolicy | None = None,
    time_limit: float | None = None,
    soft_time_limit: float | None = None,
    rate_limit: str | Mapping[str, str] | None = None,
    rate_key: RateKey | None = None,
    concurrency: int | Mapping[str, int] | None = None,
    concurrency_key: RateKey | None = None,
    priority: int = 5,
    track: bool = True,
    bind: bool = False,
    on_dead: Callable[[BaseException, tuple, dict], None] | None = None,
    cancel: Literal["cooperative", "terminate"] = "cooperative",
    on_cancelled: Callable[[tuple, dict], None] | None = None,
    **celery_options: Any,
) -> Any:
    """Declare a job.

        @job(queue="emails", retry=RetryPolicy(max_attempts=5), rate_limit="100/s")
        def email_send(email_id: int) -> None: ...

    rate_limit holds across every worker on every host; with rate_key (a kwarg name or a
    callable of (args, kwargs)) each key gets its own bucket, and rate_limit may map keys to
    rates ({"free": "5/s", "pro": "50/s", "*": "10/s"}). concurrency=N lets at most N run at
    once across every worker on every host, per concurrency_key value (a kwarg name or a
    callable, as rate_key; a mapping per key value as for rates): a job that finds no free slot
    waits in Redis, holding no worker process and spending no attempt, and starts when a slot
    frees. priority is 0 (lowest) to 9 (highest).
    track=False skips the ledger for high-volume trivial work (no status, no idempotency keys,
    and no stored result unless ignore_result=False is passed).
    on_dead(exc, args, kwargs) runs once the job gave up (after its dead letter is written),
    e.g. to mark the domain row failed.
    cancel="terminate" kills the job's pool process when it is cancelled while running (for
    work that never calls progress(), such as one long ffmpeg call); on_cancelled(args, kwargs)
    runs once it is cancelled. In either hook, jobs.current_job_id() is the job's id (the hook
    may run in the relay's or the canceller's process).

    The result is typed PlatformTask[P, R]: `.enqueue(...)`, `.delay(...)` and the function
    call itself are checked against the function's parameters (without `self` when bind=True).
    """
    if cancel not in ("cooperative", "terminate"):
        raise ValueError(f"cancel must be 'cooperative' or 'terminate', got {cancel!r}")
    if not 0 <= priority <= 9:
        raise ValueError(f"priority must be 0-9, got {priority!r}")
    if time_limit is not None and soft_time_limit is None:
        # The soft limit raises inside the job first, so it can clean up before the kill; left
        # unset it would inherit CELERY_TASK_SOFT_TIME_LIMIT, which may exceed this hard limit.
        soft_time_limit = time_limit * 0.9
    if time_limit is not None and soft_time_limit is not None and soft_time_limit > time_limit:
        raise ValueError(f"soft_time_limit ({soft_time_limit}) exceeds time_limit ({time_limit})")
    for rate in rate_limit.values() if isinstance(rate_limit, Mapping) else [rate_limit]:
        if rate is not None:
            parse_rate(rate)
    check_concurrency(concurrency)
    if concurrency is not None and not track:
        raise ValueError("concurrency needs the job ledger: a job with track=False has no lease")

    if not track:
        celery_options.setdefault("ignore_result", True)
    base = platform_base(celery_options.pop("base", None))
    policy = with_max_retries(retry or DEFAULT_POLICY, celery_options.get("max_retries"))

    def decorate(func: Callable[..., Any]) -> PlatformTask:
        # celery-types' overloads want name: str and int time limits; Celery takes None (a
        # generated name) and float seconds. (misc: mypy's "too many unions" on that failure.)
        return shared_task(  # type: ignore[call-overload,misc]
            base=base,
            name=name,
            bind=bind,
            queue_name=queue or "default",
            queue_declared=queue is not None,
            policy=policy,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
            cluster_rate_limit=rate_limit,
            rate_key=staticmethod(rate_key) if callable(rate_key) else rate_key,
            concurrency_limit=concurrency,
            concurrency_key=(
                staticmethod(concurrency_key) if callable(concurrency_key) else concurrency_key
            ),
            default_priority=priority,
            track=track,
            on_dead=staticmethod(on_dead) if on_dead else None,
            cancel_mode=cancel,
            on_cancelled=staticmethod(on_cancelled) if on_cancelled else None,
            **celery_options,
        )(func)

    return decorate(fn) if fn is not None else decorate


def with_max_retries(policy: RetryPolicy, max_retries: Any) -> RetryPolicy:
    """The policy a task runs under when it declares Celery's ``max_retries=N``: N + 1 attempts
    in all, so the ledger's max_attempts (the status API's) is what runs, whether the attempts
    end through self.retry() (which reads max_retries) or the policy. max_retries=None (Celery's
    "no limit") keeps the policy's: Backlot never retries without one."""
    if not isinstance(max_retries, int) or isinstance(max_retries, bool):
        return policy
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
    return dataclasses.replace(policy, max_attempts=max_retries + 1)


@functools.cache
def platform_base(base: type | None) -> type[PlatformTask]:
    """The task class behind a @job: PlatformTask, or for Celery's ``base=`` (a Task subclass
    a team's Celery tasks share) that class mixed in under PlatformTask, so the job keeps the
    base's methods and hooks (on_success, on_replace...) and PlatformTask's ledger-backed
    apply_async, retry() and run come first, calling the base's through super()."""
    if base is None or base is PlatformTask:
        return PlatformTask
    if not (isinstance(base, type) and issubclass(base, Task)):
        raise TypeError(f"@job(base=...) takes a subclass of celery.Task, got {base!r}")
    if issubclass(base, PlatformTask):
        return base
    mixed: type[PlatformTask] = type(
        f"Platform{base.__name__}",
        (PlatformTask, base),
        {"__module__": base.__module__, "__doc__": base.__doc__},
    )
    return mixed


def check_concurrency(concurrency: int | Mapping[str, int] | None) -> None:
    """A concurrency limit is a positive int, or a mapping of key values to positive ints."""
    limits = concurrency.values() if isinstance(concurrency, Mapping) else [concurrency]
    for limit in limits:
        if limit is None and not isinstance(concurrency, Mapping):
            continue
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(
                f"Invalid concurrency {concurrency!r}: expected a positive int, or a mapping of "
                "keys to positive ints (e.g. {'free': 1, 'pro': 5, '*': 2})"
            )
