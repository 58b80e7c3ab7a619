"""Retry policies and the error classes that steer them."""

from __future__ import annotations

import http.client
import importlib
import random
import smtplib
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.db import InterfaceError, OperationalError


class Retryable(Exception):
    """A transient failure: retry per the policy, optionally after `retry_after` seconds."""

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RetryRequested(Retryable):
    """Celery's ``self.retry()`` inside a job: this attempt failed with `exc` (None when the
    task gave none) and asks for another run, after `retry_after` seconds (None: the policy's
    delay), with `args`/`kwargs` replacing the call's when given and `options` (priority,
    queue, headers, time limits) for the next message. PlatformTask.retry has already checked
    Celery's max_retries, so the policy's attempt count does not stop it."""

    def __init__(
        self,
        exc: BaseException | None,
        *,
        retry_after: float | None = None,
        args: Sequence[object] | None = None,
        kwargs: dict[str, object] | None = None,
        options: dict[str, object] | None = None,
    ) -> None:
        super().__init__(
            str(exc) if exc is not None else "retry requested", retry_after=retry_after
        )
        self.exc = exc
        self.args_override = None if args is None else list(args)
        self.kwargs_override = None if kwargs is None else dict(kwargs)
        self.options = dict(options or {})

    @property
    def reason(self) -> BaseException:
        """What the ledger records for the failed attempt: the task's exception, else this."""
        return self.exc if self.exc is not None else self


class Permanent(Exception):
    """A failure that no retry can fix: the job goes to the dead letters at once."""


class TimeLimitHit(Exception):
    """The job ran past its hard time limit and its process was killed."""


def exponential_backoff(
    attempt: int,
    *,
    base: float,
    factor: float,
    cap: float,
    jitter: bool,
    rng: random.Random | None = None,
) -> float:
    """Delay before retry number `attempt` (1-based): base * factor**(attempt-1), capped.

    With jitter ("full jitter"), the delay is uniform in [0, that value], which spreads a
    thundering herd of retries over the whole window.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    ceiling = min(cap, base * factor ** (attempt - 1))
    if not jitter:
        return ceiling
    return (rng or random).uniform(0, ceiling)


def _installed(module: str, *names: str) -> tuple[type[BaseException], ...]:
    """The named exception classes of an optional client library, or () when it is absent."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        return ()
    return tuple(getattr(found, name) for name in names)


# Exceptions retried when a policy names none: the transient network errors of the standard
# library and of requests, httpx and urllib3 where installed (none of them is a dependency), and
# a database connection that dropped (a failover, a restart). Each is a connection refused, reset
# or lost mid-answer, a timeout, or a failed DNS look-up. TLS errors ride along where a library
# files them under connection errors (requests' SSLError is a ConnectionError).
STDLIB_TRANSIENT: tuple[type[BaseException], ...] = (
    ConnectionError,  # refused, reset, aborted, broken pipe; http.client.RemoteDisconnected
    TimeoutError,  # socket.timeout is an alias since 3.10
    socket.gaierror,  # DNS: name or service not known, temporary failure in name resolution
    smtplib.SMTPServerDisconnected,
    http.client.IncompleteRead,  # the connection closed before the whole body arrived
)
REQUESTS_TRANSIENT = _installed(
    "requests.exceptions", "ConnectionError", "Timeout", "ChunkedEncodingError"
)
HTTPX_TRANSIENT = _installed("httpx", "TimeoutException", "NetworkError", "RemoteProtocolError")
# MaxRetryError is what urllib3's own default retries end in on a refused connection.
URLLIB3_TRANSIENT = _installed(
    "urllib3.exceptions", "TimeoutError", "ProtocolError", "MaxRetryError"
)

DEFAULT_RETRY_ON: tuple[type[BaseException], ...] = (
    Retryable,
    *STDLIB_TRANSIENT,
    *REQUESTS_TRANSIENT,
    *HTTPX_TRANSIENT,
    *URLLIB3_TRANSIENT,
    TimeLimitHit,
    OperationalError,
    InterfaceError,
)


@dataclass(frozen=True)
class RetryDecision:
    """What the policy decided for a failed run: retry after `delay` seconds, or give up."""

    retry: bool
    delay: float


@dataclass(frozen=True)
class RetryPolicy:
    """How a job retries.

    max_attempts counts every run, the first included. Delays come from `delays` when given
    (the last entry repeats), else from exponential backoff. `jitter` left as None means full
    jitter for backoff (uniform in [0, d]) and none for explicit delays; jitter=True on explicit
    delays draws each uniformly in [d/2, d], so a retry never waits longer than its listed delay
    and never less than half of it. `max_delay` caps backoff and any delay a failure asks for
    (`Retryable(retry_after=...)`, `self.retry(countdown=...)`, an HTTP Retry-After), but not
    the explicit delays, which are taken as written. `retry_on` are the transient exceptions;
    anything else (and anything in `give_up_on`, and Permanent) gives up at once.
    """

    max_attempts: int = 5
    base_delay: float = 1.0
    factor: float = 2.0
    max_delay: float = 600.0
    jitter: bool | None = None
    delays: Sequence[float] | None = None
    retry_on: tuple[type[BaseException], ...] = DEFAULT_RETRY_ON
    give_up_on: tuple[type[BaseException], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.delays is not None:
            if not self.delays or any(d < 0 for d in self.delays):
                raise ValueError("delays must be a non-empty list of non-negative seconds")
            object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))
        if self.base_delay < 0 or self.max_delay < 0 or self.factor < 1:
            raise ValueError("base_delay and max_delay must be >= 0 and factor >= 1")

    @classmethod
    def explicit(cls, *delays: float, **options: object) -> RetryPolicy:
        """A policy retrying after each given delay in turn: explicit(1, 5, 30, 300, 1800).

        explicit(1, 5, 30, jitter=True) draws each delay uniformly in [d/2, d].
        """
        options.setdefault("max_attempts", len(delays) + 1)
        return cls(delays=delays, **options)  # type: ignore[arg-type]

    def should_retry(self, exc: BaseException, attempt: int) -> bool:
        """Whether a failure of run number `attempt` (1-based) earns another run."""
        if attempt >= self.max_attempts:
            return False
        if isinstance(exc, (Permanent, *self.give_up_on)):
            return False
        # Retryable (and Celery's self.retry()) always means "try again" while attempts remain.
        return isinstance(exc, (Retryable, *self.retry_on))

    def delay_for(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed run number `attempt` (1-based)."""
        if self.delays is not None:
            listed = self.delays[min(attempt, len(self.delays)) - 1]
            return (rng or random).uniform(listed / 2, listed) if self.jitter else listed
        return exponential_backoff(
            attempt,
            base=self.base_delay,
            factor=self.factor,
            cap=self.max_delay,
            jitter=self.jitter is not False,
            rng=rng,
        )

    def decide(
        self, exc: BaseException, attempt: int, rng: random.Random | None = None
    ) -> RetryDecision:
        """Retry after how long, or give up: the whole decision for a failed run, pure.

        A delay the failure asks for (Retryable.retry_after) replaces the policy's own and is
        capped at max_delay: a server's Retry-After of a day cannot park a job for a day.
        """
        # self.retry() was checked against Celery's max_retries (PlatformTask.retry) already.
        if not isinstance(exc, RetryRequested) and not self.should_retry(exc, attempt):
            return RetryDecision(retry=False, delay=0.0)
        delay = self.delay_for(attempt, rng=rng)
        if isinstance(exc, Retryable) and exc.retry_after is not None:
            delay = min(self.max_delay, max(0.0, float(exc.retry_after)))
        return RetryDecision(retry=True, delay=delay)

    def longest_delay(self) -> float:
        """The largest delay this policy can ask for (checked against the broker's limits)."""
        if self.delays is not None:
            return max(self.delays)
        return min(self.max_delay, self.base_delay * self.factor ** max(0, self.max_attempts - 2))


DEFAULT_POLICY = RetryPolicy()
