"""OpenTelemetry traces of jobs (the `otel` extra), after the semantic conventions for messaging
spans: enqueue opens a producer span "publish <queue>" whose W3C context (traceparent,
tracestate) is kept in the job's ledger row and sent in its message headers; each delivery runs
in a consumer span "process <queue>", a child of it. So the request that enqueued a job, the
job's attempts (a retry re-sends the same context), a relay-published copy (sent from the row)
and a replay (a child of the original's context) are one trace.

Pure: imports nothing of jobs. Without opentelemetry installed, or with no SDK TracerProvider
set (the host configures it: config/tracing.py in the reference project), every function here
is a no-op costing one check, and nothing is added to rows or messages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from celery.exceptions import Ignore, Reject, Retry

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError:  # the otel extra is not installed
    trace = None  # type: ignore[assignment]

R = TypeVar("R")

TRACER_NAME = "backlot.jobs"
# messaging.system: the messages are Celery protocol-2 messages; Redis is kombu's transport
# under them (semconv lets a system outside its list name itself).
SYSTEM = "celery"


@functools.lru_cache(maxsize=1)
def _tracer_of(provider: Any) -> Any:
    return provider.get_tracer(TRACER_NAME)


def _tracer() -> Any:
    """The SDK's tracer, or None when nothing would record spans."""
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return _tracer_of(provider)


def enabled() -> bool:
    """Whether spans are recorded in this process."""
    return _tracer() is not None


def job_published(
    *,
    queue: str,
    task: str,
    job_id: str | None = None,
    count: int | None = None,
    parent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The producer span of accepting a job (or `count` jobs at once) for `queue`; returns its
    context as message headers (traceparent, tracestate), {} when not tracing.

    The span marks the moment the job got its context (its row and message carry it from
    there): it is a child of the current span, or of `parent` (a replay's original job) with
    a link to the current one.
    """
    tracer = _tracer()
    if tracer is None:
        return {}
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": queue,
        "backlot.task": task,
    }
    if job_id is not None:
        attributes["messaging.message.id"] = job_id
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    context, links = None, None
    if parent:
        context = propagate.extract(dict(parent))
        current = trace.get_current_span().get_span_context()
        links = [Link(current)] if current.is_valid else None
    span = tracer.start_span(
        f"publish {queue}",
        context=context,
        kind=SpanKind.PRODUCER,
        attributes=attributes,
        links=links,
    )
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    span.end()
    return carrier


def message_context(request: Any) -> dict[str, str]:
    """The trace context a delivery carries in its headers (Celery exposes custom headers as
    request attributes); {} when it has none."""
    if trace is None:
        return {}
    carrier = {}
    for field in propagate.get_global_textmap().fields:
        value = getattr(request, field, None)
        if isinstance(value, str):
            carrier[field] = value
    return carrier


def traced_run(run: Callable[[Any, tuple, dict], R]) -> Callable[[Any, tuple, dict], R]:
    """Run a delivery of `task` in its consumer span "process <queue>", a child of the context
    in its message. The outcome follows from how the run ends: Celery's Retry (retrying: the
    failure is an exception event), Ignore (dropped, cancelled), Reject (requeued), any other
    exception (the job gave up: status ERROR). Exceptions are recorded by class only, as in
    the log lines: their message may quote a job's arguments."""

    @functools.wraps(run)
    def traced(task: Any, args: tuple, kwargs: dict) -> R:
        tracer = _tracer()
        if tracer is None:
            return run(task, args, kwargs)
        request = task.request
        queue = (request.delivery_info or {}).get("routing_key") or task.queue_name
        attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": queue,
            "messaging.message.id": str(request.id),
            "backlot.task": task.name,
        }
        with tracer.start_as_current_span(
            f"process {queue}",
            context=propagate.extract(message_context(request)),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                result = run(task, args, kwargs)
            except BaseException as exc:
                _record_end(span, exc)
                raise
            span.set_attribute("backlot.outcome", "succeeded")
            return result

    return traced


def _record_end(span: Any, exc: BaseException) -> None:
    if isinstance(exc, Retry):
        span.set_attribute("backlot.outcome", "retrying")
        if isinstance(exc.exc, BaseException):
            _exception_event(span, exc.exc)
    elif isinstance(exc, Reject):
        span.set_attribute("backlot.outcome", "requeued")
    elif isinstance(exc, Ignore):
        span.set_attribute("backlot.outcome", "ignored")
    else:
        span.set_attribute("backlot.outcome", "dead")
        _exception_event(span, exc)
        span.set_status(Status(StatusCode.ERROR, _class_name(exc)))


def _exception_event(span: Any, exc: BaseException) -> None:
    span.add_event("exception", {"exception.type": _class_name(exc)})


def _class_name(exc: BaseException) -> str:
    kind = type(exc)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def set_attempt(attempt: int) -> None:
    """Name the attempt on the current consumer span (known once the run claimed the job)."""
    if trace is not None:
        trace.get_current_span().set_attribute("backlot.attempt", attempt)


def current_trace_id() -> str | None:
    """The current trace's id (32 hex digits), for log lines; None outside a recorded span."""
    if trace is None:
        return None
    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None
