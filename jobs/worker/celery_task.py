"""Celery's own task API on @job: ``self.retry()`` onto the retry policy and the ledger, and
``Task.replace()`` handing the job's row to its replacement. PlatformTask (jobs.worker.task) is this
class with the platform's options, its enqueue and its run."""

from __future__ import annotations

import inspect
import logging
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from celery import Task, group
from celery.canvas import _chain
from celery.canvas import chord as _chord  # the class (celery-types stubs no _chord alias)
from celery.exceptions import Ignore
from celery.utils.serialization import raise_with_context
from celery.utils.time import maybe_iso8601, maybe_make_aware
from django.utils import timezone

from jobs import ledger
from jobs.core.exceptions import LeaseLost
from jobs.core.policies import RetryPolicy, RetryRequested

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _signature_with_id(sig: Any, task_id: str) -> Any:
    """The task signature in a canvas (chain, chord, group) frozen with `task_id`, or None."""
    if isinstance(sig, _chain):
        parts = list(sig.tasks)
    elif isinstance(sig, _chord):
        parts = [*sig.tasks, sig.body]
    elif isinstance(sig, group):
        parts = list(sig.tasks)
    else:
        return sig if sig.options.get("task_id") == task_id else None
    for part in reversed(parts):
        found = _signature_with_id(part, task_id)
        if found is not None:
            return found
    return None


class CeleryTaskAPI(Task[P, R]):
    """Celery's retry() and replace() semantics for a task backed by the job ledger."""

    policy: RetryPolicy
    track: bool

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
        """Celery's retry(), onto the retry policy and the ledger.

        As in Celery: retry number ``request.retries + 1`` is refused past `max_retries` (this
        call's, else the task's own ``max_retries=`` when it declares one, else the policy's
        max_attempts - 1), and then `exc` is raised (MaxRetriesExceededError without one), so
        the job gives up with it. Otherwise this attempt is recorded as failed with `exc`, and
        the next runs after `countdown` seconds (or at `eta`; neither: the task's own
        default_retry_delay when it declares one, else the policy's backoff, both capped by
        the policy's max_delay), with `args`/`kwargs` when given and `options` (priority on
        Backlot's 0-9 scale, queue, headers, time limits, expires) on its message. The
        caller's AsyncResult reads RETRY with `exc`, then the final outcome.
        """
        request = self.request
        if request.called_directly or request.is_eager or not request.id:
            # Not a worker run (a direct call, apply(), always-eager): Celery's own semantics.
            # celery-types wants an Exception; Celery takes any exception.
            return super().retry(
                args,
                kwargs,
                exc,  # type: ignore[arg-type]
                throw,
                eta,
                countdown,
                max_retries,
                **options,
            )
        args, kwargs = self._retry_arguments(args, kwargs)
        retries = (request.retries or 0) + 1
        limit = self._retry_limit() if max_retries is None else max_retries
        if retries > limit:
            # Read by jobs.worker.execution: the job gives up with this exception, whatever the
            # policy.
            request.backlot_give_up = True  # type: ignore[attr-defined]
            if exc is not None:
                raise_with_context(exc)  # type: ignore[arg-type]  # any exception, as Celery's
            # celery-types declares MaxRetriesExceededError without Celery's task_args/kwargs.
            raise self.MaxRetriesExceededError(  # type: ignore[call-arg]
                f"Can't retry {self.name}[{request.id}] args:{args or request.args} "
                f"kwargs:{kwargs or request.kwargs}",
                task_args=args or request.args,
                task_kwargs=kwargs or request.kwargs,
            )
        if countdown is None and eta is not None:
            when = eta if isinstance(eta, datetime) else maybe_iso8601(eta)
            if when is None:
                raise ValueError(f"retry(eta=...) is not a datetime or ISO 8601 string: {eta!r}")
            when = maybe_make_aware(when)
            countdown = max(0.0, (when - timezone.now()).total_seconds())
        if countdown is None and "default_retry_delay" in vars(type(self)):
            countdown = self.default_retry_delay
        if not throw:
            logger.warning(
                "%s[%s]: retry(throw=False) is a plain retry() under @job: the retry is "
                "scheduled once this run has ended",
                self.name,
                request.id,
            )
        raise RetryRequested(
            exc, retry_after=countdown, args=args, kwargs=kwargs, options=options
        ) from exc

    def _retry_arguments(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Celery's rule (celery#6494) for retry(args=...) or retry(kwargs=...) alone: the
        call's other arguments are kept where they do not clash with the new ones."""
        request = self.request
        if not (
            (args is not None and kwargs is None and request.kwargs)
            or (kwargs is not None and args is None and request.args)
        ):
            return args, kwargs
        try:
            signature = inspect.signature(self.run)
        except (TypeError, ValueError):
            return args, kwargs
        if args is not None:
            positional = [
                p
                for p in signature.parameters.values()
                if p.kind
                in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            ]
            kept = dict(request.kwargs or {})
            for parameter in positional[: len(args)]:
                if parameter.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
                    kept.pop(parameter.name, None)
            return args, kept
        try:
            bound = signature.bind_partial(*(request.args or ()))
        except TypeError:
            return args, kwargs
        kwargs = dict(kwargs or {})
        for name in list(kwargs):
            if (
                name in bound.arguments
                and signature.parameters[name].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
            ):
                bound.arguments[name] = kwargs.pop(name)
        return bound.args, {**bound.kwargs, **kwargs}

    def _retry_limit(self) -> int:
        """How many retries self.retry() may ask for: the task's declared max_retries (Celery's
        option, as in @job(max_retries=3)), else what the retry policy allows. Backlot never
        retries without a limit: max_retries=None falls back on the policy."""
        declared = vars(type(self)).get("max_retries")
        if isinstance(declared, int):
            return declared
        return self.policy.max_attempts - 1

    def on_replace(self, sig: Any) -> Any:
        """Celery's Task.replace(), with the ledger. Before the replacing signature is sent,
        this job's row is handed to its task of the same id (jobs.ledger.replace; Celery
        freezes the replacement with this id): that task's enqueue takes the row over, so the
        caller's AsyncResult and the status API follow the replacement to its end. When that
        task keeps no ledger row (track=False, a plain Celery task, the accumulator Celery
        puts after a replacing group), the row is finished now and AsyncResult reads the
        outcome from Celery's result store."""
        request = self.request
        # The run's claim (jobs.worker.execution keeps it on the request): its attempt and token.
        hold = getattr(request, "_backlot_hold", None)
        if request.is_eager or request.called_directly or not self.track or hold is None:
            return super().on_replace(sig)
        final = _signature_with_id(sig, str(request.id))
        successor = self.app.tasks.get(final.task) if final is not None else None
        tracked = isinstance(successor, CeleryTaskAPI) and bool(getattr(successor, "track", False))
        write = ledger.replace if tracked else ledger.replaced_by_untracked
        try:
            hold.claim_now()  # a deferred claim is written before the row is handed over
        except LeaseLost:
            logger.warning("Job %s lost its claim; its replacement is not sent", request.id)
            raise Ignore() from None
        if not write(job_id=str(request.id), attempt=hold.attempt, lease_owner=hold.lease_owner):
            logger.warning("Job %s lost its claim; its replacement is not sent", request.id)
            raise Ignore()
        request.backlot_replaced = True  # type: ignore[attr-defined]  # read by jobs.worker.execution
        return super().on_replace(sig)
