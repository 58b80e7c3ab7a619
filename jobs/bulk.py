"""Bulk enqueue: many jobs of one task in a few statements and one pipelined publish.

A campaign fan-out or a dead-letter bulk replay accepts thousands of jobs at once. Going
through `apply_async` per job costs more than the job's own row and message (a task-sent event
and a queue declaration per message, Model instances per row), so this path writes the ledger
rows with COPY on PostgreSQL (one multi-row INSERT per 1,000 elsewhere), builds each task
message once with Celery's own protocol-2 builder, and pushes them through kombu's pipelined
publish batch. Rows are marked published a chunk at a time, only after the broker took the
chunk; what it did not take stays in the outbox for the relay.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from .masking import message_repr
from .models import Job, JobState
from .payload import payload_check
from .signals import slim_message

if TYPE_CHECKING:
    from .base import PlatformTask

logger = logging.getLogger(__name__)

# Rows per INSERT/UPDATE and messages per pipelined flush: keeps one statement's parameters
# well under PostgreSQL's 65,535 and SQLite's 32,766 limits (Job has ~30 columns).
BULK_BATCH = 1000


@dataclass(frozen=True)
class _Row:
    id: uuid.UUID
    args: list[Any]
    kwargs: dict[str, Any]
    replay_of: int | None


def job_enqueue_many(
    *,
    task: PlatformTask,
    calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
    priority: int | None = None,
    owner: Any = None,
    on_commit: bool = True,
    replay_of: Sequence[int] | None = None,
) -> list[str]:
    """Accept many jobs of one task at once; returns their ids, in the order of `calls`.

    For fan-outs (a campaign's recipients); no idempotency keys here: the caller records
    which items it enqueued in the same transaction. Every payload is checked before anything
    is written, so a bad one fails the whole call and nothing is half-accepted.
    """
    from .services import _check_priority, _on_commit_or_now

    priority = _check_priority(task.default_priority if priority is None else priority)
    max_bytes = settings.BACKLOT["MAX_PAYLOAD_BYTES"]
    links: list[int | None] = list(replay_of) if replay_of is not None else [None] * len(calls)
    rows = []
    for (call_args, call_kwargs), link in zip(calls, links, strict=True):
        args, kwargs = list(call_args), dict(call_kwargs)
        payload_check(task_name=task.name, args=args, kwargs=kwargs, max_bytes=max_bytes)
        rows.append(_Row(uuid.uuid4(), args, kwargs, link))
    if task.track:
        _insert_rows(task=task, rows=rows, priority=priority, owner=owner)
    _on_commit_or_now(on_commit, lambda: _publish_rows(task=task, rows=rows, priority=priority))
    return [str(row.id) for row in rows]


def _prototype(task: PlatformTask, priority: int, owner: Any) -> Job:
    """The row every job of this call shares, apart from id, arguments and replay link."""
    return Job(
        task_name=task.name,
        queue=task.queue_name,
        priority=priority,
        owner=owner if getattr(owner, "pk", None) else None,
        state=JobState.QUEUED,
        max_attempts=task.policy.max_attempts,
        enqueued_at=timezone.now(),
    )


def _insert_rows(*, task: PlatformTask, rows: list[_Row], priority: int, owner: Any) -> None:
    prototype = _prototype(task, priority, owner)
    if connection.vendor != "postgresql":
        Job.objects.bulk_create(
            [
                Job(
                    **{
                        f.attname: getattr(prototype, f.attname)
                        for f in Job._meta.concrete_fields
                        if f.attname not in ("id", "args", "kwargs", "replay_of_id")
                    },
                    id=row.id,
                    args=row.args,
                    kwargs=row.kwargs,
                    replay_of_id=row.replay_of,
                )
                for row in rows
            ],
            batch_size=BULK_BATCH,
        )
        return
    # COPY: the constant columns are converted once, the varying ones per row.
    fields = Job._meta.concrete_fields
    varying = ("id", "args", "kwargs", "replay_of_id")
    constant = [
        (f.column, f.get_db_prep_save(getattr(prototype, f.attname), connection))
        for f in fields
        if f.attname not in varying
    ]
    columns = ", ".join(
        connection.ops.quote_name(name)
        for name in ("id", "args", "kwargs", "replay_of_id", *(c for c, _ in constant))
    )
    tail = tuple(value for _, value in constant)
    adapt = connection.ops.adapt_json_value
    table = connection.ops.quote_name(Job._meta.db_table)
    with (
        connection.cursor() as cursor,
        cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy,
    ):
        for row in rows:
            copy.write_row(
                (row.id, adapt(row.args, None), adapt(row.kwargs, None), row.replay_of, *tail)
            )


def _publish_rows(*, task: PlatformTask, rows: list[_Row], priority: int) -> None:
    """Publish the rows' messages a chunk per pipelined flush; mark each chunk published once
    the broker took it. A broker failure leaves the rest unpublished, for the relay."""
    from .services import broker_priority

    amqp = task.app.amqp
    queue = task.queue_name
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
    try:
        with task.app.producer_or_acquire() as producer:
            for start in range(0, len(rows), BULK_BATCH):
                chunk = rows[start : start + BULK_BATCH]
                with producer.batch(max_size=BULK_BATCH):
                    for row in chunk:
                        headers, properties, body, _ = amqp.create_task_message(
                            str(row.id),
                            task.name,
                            row.args,
                            row.kwargs,
                            argsrepr=message_repr(row.args),
                            kwargsrepr=message_repr(row.kwargs),
                            ignore_result=ignore_result,
                        )
                        slim_message(headers, properties)
                        producer.publish(body, headers=headers, **options, **properties)
                        options["declare"] = None  # declared once: binding it per message is costly
                sent += len(chunk)
                if task.track:
                    Job.objects.filter(id__in=[row.id for row in chunk]).update(
                        published_at=timezone.now()
                    )
    except (KombuError, RedisError, OSError) as exc:
        logger.warning(
            "Broker unavailable after %s of %s jobs; the rest stay in the outbox: %s",
            sent,
            len(rows),
            exc,
        )
        if not task.track:
            from .exceptions import BrokerUnavailable

            raise BrokerUnavailable(
                f"Broker unavailable: {len(rows) - sent} untracked {task.name} jobs not sent"
            ) from exc
