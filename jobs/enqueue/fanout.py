"""Accepting many jobs of one task at once (a fan-out): rows by COPY, messages through one
pipelined publish after commit (jobs.broker.broker.publish_many)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from django.utils import timezone

from jobs import ledger
from jobs.broker import broker, running, slots
from jobs.core import context, tracing
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import BrokerUnavailable
from jobs.core.options import arguments_checker, check_priority, check_queue
from jobs.core.payload import payload_check
from jobs.core.states import JobState
from jobs.enqueue.lineage import born_cancelled, join_batch, lineage, on_commit_or_now
from jobs.enqueue.publish import Enqueueable, park_at_gates
from jobs.enqueue.routing import job_queue
from jobs.models import Job


def enqueue_many(
    task: Enqueueable,
    calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
    *,
    priority: int | None = None,
    owner: Any = None,
    on_commit: bool = True,
    queue: str | None = None,
    replay_of: Sequence[int] | None = None,
    detached: bool = False,
) -> list[str]:
    """Accept many jobs of one task at once; returns their ids, in the order of `calls`.

    For fan-outs (a campaign's recipients): ledger rows by COPY, messages through one pipelined
    publish, each chunk marked published once the broker took it. No idempotency keys here:
    the caller records which items it enqueued in the same transaction. Every payload is
    checked before anything is written, so a bad one fails the whole call and nothing is
    half-accepted (arguments are checked against the job's signature the same way).
    """
    # a shared_task's Proxy resolves every attribute it is asked for (~10 calls each, three
    # a call below): resolved once here
    task = getattr(task, "_get_current_object", lambda: task)()
    priority = check_priority(task.default_priority if priority is None else priority)
    max_bytes = backlot_settings().MAX_PAYLOAD_BYTES
    links: list[int | None] = list(replay_of) if replay_of is not None else [None] * len(calls)
    rows = []
    check = arguments_checker(task)  # the signature bound once per shape of arguments
    for (call_args, call_kwargs), link in zip(calls, links, strict=True):
        args, kwargs = list(call_args), dict(call_kwargs)
        check(args, kwargs)
        payload_check(task_name=task.name, args=args, kwargs=kwargs, max_bytes=max_bytes)
        rows.append(ledger.NewRow(uuid.uuid4(), args, kwargs, link))
    # routed by the first call's arguments (a fan-out's calls share one queue)
    first_args, first_kwargs = calls[0] if calls else ((), {})
    queue = job_queue(task, first_args, first_kwargs, queue)
    queue = check_queue(queue) if task.track else queue
    carrier = tracing.job_published(queue=queue, task=task.name, count=len(rows))
    if task.track:
        prototype = Job(
            task_name=task.name,
            queue=queue,
            priority=priority,
            **lineage(owner, detached),
            state=JobState.QUEUED,
            max_attempts=task.policy.max_attempts,
            enqueued_at=timezone.now(),
            trace_context=carrier,
        )
        joining = join_batch(prototype, task)
        if born_cancelled(prototype, prototype.enqueued_at):
            ledger.insert_many(prototype=prototype, rows=rows)
            if joining is not None:
                joining.born_cancelled += len(rows)
            return [str(row.id) for row in rows]
        # copied already marked published, as enqueue() inserts its row: no UPDATE of every
        # row after the publish; those the broker did not take go back to the outbox below
        # (on RabbitMQ each chunk is marked once the broker confirmed it, as enqueue() does)
        if broker.lists_held_messages():
            prototype.published_at = prototype.enqueued_at
        ledger.insert_many(prototype=prototype, rows=rows)
        if joining is not None:
            joining.added += len(rows)
    elif context.joining_batch() is not None:
        raise ValueError(f"{task.name} has track=False: a batch's members need the job ledger")

    # rows inserted unpublished (RabbitMQ) are marked as the broker takes them
    unmarked = task.track and not broker.lists_held_messages()
    mark_sent = functools.partial(ledger.mark_published, attempts=0) if unmarked else None

    def publish() -> None:
        todo = rows
        if slots.limited(task):  # they wait at their gates, which publish them (jobs.broker.slots)
            waiting = [
                Job(id=row.id, args=row.args, kwargs=row.kwargs, queue=queue, priority=priority)
                for row in rows
            ]
            for job in waiting:
                job.trace_context = carrier
            kept = park_at_gates(task, waiting, None)
            if kept and mark_sent is not None:
                mark_sent(sorted(kept))
            todo = [row for row in rows if str(row.id) not in kept]
            if not todo:
                return
        messages = [(str(row.id), row.args, row.kwargs) for row in todo]
        headers: dict[str, Any] = dict(carrier)
        # first messages of rows in no batch, behind no gate, no replay (a dead batch member's
        # joins its batch after the insert): their deliveries may skip the row
        if (
            task.track
            and prototype.batch_id is None
            and replay_of is None
            and not slots.limited(task)
        ):
            headers.update(running.born(prototype.owner_id))
        sent = broker.publish_many(
            task=task,
            jobs=messages,
            queue=queue,
            priority=priority,
            headers=headers,
            on_chunk=mark_sent,
        )
        if sent == len(todo):
            return
        if not task.track:
            raise BrokerUnavailable(
                f"Broker unavailable: {len(todo) - sent} untracked {task.name} jobs not sent"
            )
        if mark_sent is not None:
            return  # the rest were never marked: the relay publishes them
        unsent = [row.id for row in todo[sent:]]  # the relay publishes them
        for start in range(0, len(unsent), ledger.BULK_BATCH):
            ledger.unpublish(*unsent[start : start + ledger.BULK_BATCH])

    on_commit_or_now(on_commit, publish)
    return [str(row.id) for row in rows]
