"""The broker side of the platform: the only module that knows kombu and Redis' queue layout.

Publish one job (Backlot's own protocol-2 message in one Redis round trip, jobs.broker.protocol,
or Celery's apply_async where canvas options or a host's publish hooks need it), publish many
(Celery's protocol-2 builder and kombu's pipelined batch), slim Backlot's messages and map
priorities (what the queues hold is read in jobs.broker.queues). Nothing here writes the
ledger: callers mark what the broker took.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from amqp.exceptions import AMQPError, MessageNacked
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from jobs.broker import amqp, protocol
from jobs.core.conf import backlot_settings
from jobs.core.masking import message_repr

logger = logging.getLogger(__name__)

# Messages per pipelined flush (and rows per statement in the ledger's bulk writes).
BULK_BATCH = 1000
# What a failed publish raises: the broker is down, frozen or refused the connection, or
# RabbitMQ nacked the publish or closed the channel (py-amqp's errors are not KombuErrors;
# a quorum queue nacks while it elects a new leader).
BROKER_ERRORS = (KombuError, RedisError, OSError, AMQPError, MessageNacked)

# Headers Celery writes even when empty; the worker reads each with a default (Context's class
# attributes), so an absent header means the same as its empty value.
_EMPTY_HEADERS = {
    "shadow": None,
    "eta": None,
    "expires": None,
    "group": None,
    "group_index": None,
    "parent_id": None,
    "stamped_headers": None,
    "replaced_task_nesting": 0,
    "retries": 0,
    "ignore_result": False,  # the task's own setting applies (PlatformRequest decides)
    "kwargsrepr": "{}",
    "lang": "py",  # read only to convert protocol-1 messages
}


class Publishable(Protocol):
    """What the broker needs of a task: its name, app, queue and apply_async."""

    name: str
    queue_name: str
    ignore_result: bool

    @property
    def app(self) -> Any: ...

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any: ...


def broker_priority(priority: int) -> int:
    """Backlot priorities run 0 (lowest) to 9 (highest); Redis consumes level 0 first,
    RabbitMQ the highest first."""
    return amqp.broker_priority(priority) if amqp.enabled() else 9 - priority


def lists_held_messages() -> bool:
    """The broker can show which messages it holds (Redis: its lists and the unacked hash), so
    the relay finds a message lost between a row's commit and its publish, and rows go in
    already marked published. RabbitMQ cannot: its rows are marked once the publish is
    confirmed, and one not marked stays in the outbox (jobs.broker.amqp)."""
    return not amqp.enabled()


def takes_countdown(delay: float) -> bool:
    """A job due in `delay` seconds is handed to the broker now, with its countdown (Redis,
    up to BACKLOT['MAX_BROKER_COUNTDOWN']); else it waits in the ledger and the relay publishes
    it when due. On RabbitMQ only a job due now is: nothing waits broker-side there."""
    if amqp.enabled():
        return delay <= 0
    return delay <= backlot_settings().MAX_BROKER_COUNTDOWN


def backlot_priority(broker: int) -> int:
    """The inverse of broker_priority."""
    return amqp.broker_priority(broker) if amqp.enabled() else 9 - broker


def publish(
    *,
    task: Publishable,
    job_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    queue: str,
    priority: int,
    eta: datetime | None,
    options: Mapping[str, Any] | None = None,
    trace_context: Mapping[str, str] | None = None,
    answered: bool = True,
) -> bool:
    """Hand one job's message to the broker; False when the broker is unavailable.

    Bounded timeouts make a dead or frozen Redis fail fast; the caller leaves the job in the
    ledger's outbox for the relay. `trace_context` (jobs.core.tracing) rides in the headers.
    Not `answered` (a ledger-on enqueue's message, its row marked published: the relay's
    reconcile re-sends it if Redis refuses or loses it), Redis's reply is not waited for on
    the short path (jobs.broker.unanswered): False only when the send fails.
    """
    options = dict(options or {})
    if trace_context:
        options["headers"] = {**trace_context, **(options.get("headers") or {})}
    # The caller's own argsrepr/kwargsrepr (apply_async's, to keep a secret out of logs and
    # Flower) win over Backlot's masked copies.
    options.setdefault("argsrepr", message_repr(args))
    options.setdefault("kwargsrepr", message_repr(kwargs))
    app = task.app
    try:
        short = protocol.route(app, queue) if protocol.takes(task, options, eta) else None
        if short is not None:
            parent = app.current_worker_task
            protocol.push(
                short,
                queue,
                protocol.build(
                    task=task,
                    job_id=job_id,
                    args=args,
                    kwargs=kwargs,
                    queue=queue,
                    priority=broker_priority(priority),
                    delivery_mode=short.delivery_mode,
                    options=options,
                    parent=parent,
                ),
                answered=answered,
            )
            if parent is not None:
                parent.add_trail(app.AsyncResult(job_id))  # as send_task does
            return True
        task.apply_async(
            list(args),
            dict(kwargs),
            task_id=job_id,
            queue=queue,
            priority=broker_priority(priority),
            eta=eta,
            _backlot_internal=True,
            **options,
        )
    except BROKER_ERRORS as exc:
        logger.warning("Broker unavailable, job %s stays in the outbox: %r", job_id, exc)
        return False
    return True


def publish_many(
    *,
    task: Publishable,
    jobs: Sequence[tuple[str, Sequence[Any], Mapping[str, Any]]],
    priority: int,
    queue: str | None = None,
    on_chunk: Callable[[list[str]], object] | None = None,
    headers: Mapping[str, Any] | None = None,
) -> int:
    """Publish (id, args, kwargs) messages a chunk per pipelined flush; `on_chunk(ids)` runs
    once the broker took a chunk. Returns how many were sent; a broker failure stops there.
    Every message carries `headers` (the trace context, jobs.core.tracing; `born`,
    jobs.broker.running)."""
    amqp = task.app.amqp
    queue = queue or task.queue_name
    options = {
        "exchange": "",
        "routing_key": queue,
        "serializer": "json",
        "delivery_mode": 2,
        "priority": broker_priority(priority),
        "declare": [amqp.queues[queue]],
        "retry": False,
    }
    ignore_result = bool(task.ignore_result)
    sent = 0
    short = _short_many_route(task, queue, headers)
    try:
        if short is not None:
            return _publish_many_short(
                short,
                task=task,
                jobs=jobs,
                queue=queue,
                priority=broker_priority(priority),
                on_chunk=on_chunk,
                headers=headers,
            )
        with task.app.producer_or_acquire() as producer:
            for start in range(0, len(jobs), BULK_BATCH):
                chunk = jobs[start : start + BULK_BATCH]
                with producer.batch(max_size=BULK_BATCH):
                    for job_id, args, kwargs in chunk:
                        message_headers, properties, body, _ = amqp.create_task_message(
                            job_id,
                            task.name,
                            args,
                            kwargs,
                            argsrepr=message_repr(args),
                            kwargsrepr=message_repr(kwargs),
                            ignore_result=ignore_result,
                        )
                        slim_message(message_headers, properties)
                        if headers:
                            message_headers.update(headers)
                        producer.publish(body, headers=message_headers, **options, **properties)
                        options["declare"] = None  # declared once: binding it per message is costly
                sent += len(chunk)
                if on_chunk is not None:
                    on_chunk([job_id for job_id, _, _ in chunk])
    except BROKER_ERRORS as exc:
        logger.warning(
            "Broker unavailable after %s of %s jobs; the rest stay in the outbox: %r",
            sent,
            len(jobs),
            exc,
        )
    return sent


def _short_many_route(
    task: Publishable, queue: str, headers: Mapping[str, Any] | None
) -> protocol.Route | None:
    """The short path's route for a fan-out on `queue`, where it applies (jobs.broker.protocol:
    the same conditions as one job's publish, with the options a fan-out's messages carry)."""
    options = {"argsrepr": "", "kwargsrepr": "", **({"headers": {}} if headers else {})}
    if not protocol.takes(task, options, None):
        return None
    return protocol.route(task.app, queue)


def _publish_many_short(
    route: protocol.Route,
    *,
    task: Publishable,
    jobs: Sequence[tuple[str, Sequence[Any], Mapping[str, Any]]],
    queue: str,
    priority: int,
    on_chunk: Callable[[list[str]], object] | None,
    headers: Mapping[str, Any] | None,
) -> int:
    """publish_many on the short path: each chunk's messages built by Backlot and pushed with
    their bell in one LPUSH, one round trip per chunk; a broker failure stops there, as the
    kombu path does."""
    sent = 0
    extra = {"headers": dict(headers)} if headers else {}
    # a shared_task's Proxy resolves every attribute it is asked for: resolved once here
    task = getattr(task, "_get_current_object", lambda: task)()
    # as kombu's batch sent them: the worker applies the task's own limits
    options = {"time_limit": None, "soft_time_limit": None, **extra}
    # the messages' text from one template (protocol.fill): the same bytes as build()'s
    template = protocol.template(
        task=task,
        queue=queue,
        priority=priority,
        delivery_mode=route.delivery_mode,
        options={"argsrepr": "", "kwargsrepr": "", **options},
    )
    try:
        for start in range(0, len(jobs), BULK_BATCH):
            chunk = jobs[start : start + BULK_BATCH]
            if template is not None:
                texts = protocol.fill(template, chunk, message_repr)
            else:
                texts = [
                    protocol.message_text(
                        protocol.build(
                            task=task,
                            job_id=job_id,
                            args=args,
                            kwargs=kwargs,
                            queue=queue,
                            priority=priority,
                            delivery_mode=route.delivery_mode,
                            options={
                                "argsrepr": message_repr(args),
                                "kwargsrepr": message_repr(kwargs),
                                **options,
                            },
                        )
                    )
                    for job_id, args, kwargs in chunk
                ]
            protocol.push_texts(route, queue, priority, texts)
            sent += len(chunk)
            if on_chunk is not None:
                on_chunk([job_id for job_id, _, _ in chunk])
    except BROKER_ERRORS as exc:
        logger.warning(
            "Broker unavailable after %s of %s jobs; the rest stay in the outbox: %r",
            sent,
            len(jobs),
            exc,
        )
    return sent


def slim_message(headers: dict[str, Any], properties: dict[str, Any]) -> None:
    """Drop what a Backlot message carries for nothing: headers at their default value, the
    root id and correlation id when they repeat the job id, the reply queue (no rpc://
    results), and the second copy of argsrepr/kwargsrepr that apply_async leaves in the
    properties (the headers have them). Redis holds every queued message."""
    for key, empty in _EMPTY_HEADERS.items():
        if key in headers and headers[key] == empty:
            del headers[key]
    if headers.get("stamps") == {} and "stamped_headers" not in headers:
        del headers["stamps"]
    # A job that is its own root: the worker reads a missing root_id as the job's own id.
    if headers.get("root_id") is not None and headers.get("root_id") == headers.get("id"):
        del headers["root_id"]
    for key in ("argsrepr", "kwargsrepr", "reply_to"):
        properties.pop(key, None)
    if properties.get("correlation_id") == headers.get("id"):
        del properties["correlation_id"]  # only rpc:// result replies use it
