"""RabbitMQ as the broker (BACKLOT['BROKER_URL'] = "amqp://..."): what the broker layer does
differently there.

On Redis, Backlot keeps its own records beside kombu's lists (jobs.broker.fetch,
reservations, restore, the bells) because a Redis list forgets a message the moment a consumer
pops it. RabbitMQ keeps an unacknowledged message itself and gives it back when the consumer's
connection closes (a dead worker) or it outlives ``consumer_timeout`` (a stuck one), so none of
those records are used on AMQP: the ledger's claim and lease work as on Redis on top of the
broker's own acknowledgements.

- Queues are quorum queues by default: durable, replicated with Raft, so a broker node can die
  without losing a confirmed publish. ``x-delivery-limit`` bounds redeliveries; a message past
  it goes to Backlot's ``backlot.undeliverable`` queue, which the relay turns into a dead
  letter (jobs.flow.relay), never a silent broker drop. BACKLOT['AMQP_QUEUE_TYPE'] = "classic"
  declares one-node classic queues with ``x-max-priority`` instead.
- Every publish is confirmed (kombu's ``confirm_publish``): a publish the broker did not
  confirm raises, the row stays in the ledger's outbox and the relay sends it. Rows are marked
  published after the confirm, not at insert (``lists_held_messages``): RabbitMQ cannot show
  which messages it holds, so the relay's missing-message check of Redis has no AMQP twin.
- Delays and retries wait in the ledger and are published when due; nothing is held
  broker-side with TTLs or as a worker's countdown (``takes_countdown``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from celery import current_app
from kombu import Exchange, Queue

from jobs.core.conf import backlot_settings

logger = logging.getLogger(__name__)

# Where a quorum queue sends a message delivered AMQP_DELIVERY_LIMIT times (its dead-letter
# exchange is the default one, this queue its routing key); the relay empties it.
UNDELIVERABLE = "backlot.undeliverable"
# Backlot's 0-9 priorities on a classic queue (x-max-priority): RabbitMQ delivers higher first.
MAX_PRIORITY = 9


def enabled() -> bool:
    """The broker is RabbitMQ (BACKLOT['BROKER_URL'] is an amqp:// URL)."""
    return bool(backlot_settings().BROKER_URL)


def queue_arguments() -> dict[str, Any]:
    """The arguments Backlot declares each of its queues with on RabbitMQ."""
    conf = backlot_settings()
    if conf.AMQP_QUEUE_TYPE == "classic":
        return {"x-max-priority": MAX_PRIORITY}
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": conf.AMQP_DELIVERY_LIMIT,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": UNDELIVERABLE,
    }


def declared_queue(name: str) -> Queue:
    """One of Backlot's queues as RabbitMQ gets it: durable, on a direct exchange of its name."""
    return Queue(
        name,
        Exchange(name, type="direct", durable=True),
        routing_key=name,
        durable=True,
        queue_arguments=queue_arguments(),
    )


def undeliverable_queue() -> Queue:
    """The queue quorum queues dead-letter a message to past their delivery limit."""
    arguments = {"x-queue-type": "quorum"} if backlot_settings().AMQP_QUEUE_TYPE == "quorum" else {}
    return Queue(
        UNDELIVERABLE,
        Exchange(""),
        routing_key=UNDELIVERABLE,
        durable=True,
        queue_arguments=arguments,
    )


def declare_undeliverable() -> None:
    """Declare backlot.undeliverable before any message can be given up on: a quorum queue
    that dead-letters to a queue not declared yet drops the message."""
    with current_app.connection_for_write() as connection:
        undeliverable_queue()(connection.default_channel).declare()


def transport_options() -> dict[str, Any]:
    """kombu's py-amqp options: publisher confirms on every publish."""
    return {"confirm_publish": True}


def broker_priority(priority: int) -> int:
    """Backlot's 0 (lowest) to 9 (highest) is RabbitMQ's own order: higher first. (Quorum queues
    before RabbitMQ 3.12 ignore it; from 3.12 they deliver 5-9 before 0-4.)"""
    return priority


def queue_depths(queues: Sequence[str]) -> dict[str, int]:
    """Messages ready in each queue (a passive declare each, on one connection); a queue not
    declared yet holds none. Unacknowledged messages are not counted (RabbitMQ does not say)."""
    depths: dict[str, int] = {}
    connection: Any
    with current_app.connection_for_read() as connection:
        channel: Any = connection.channel()
        try:
            for name in queues:
                try:
                    _, count, _ = channel.queue_declare(queue=name, passive=True)
                except connection.channel_errors:  # 404: not declared yet (the channel closed)
                    count = 0
                    channel = connection.channel()
                depths[name] = int(count)
        finally:
            channel.close()
    return depths


def drain_undeliverable(
    record: Callable[[list[tuple[str, str]]], object], *, most: int = 500
) -> int:
    """Hand `record` (job id, reason) of up to `most` messages RabbitMQ dead-lettered, then
    acknowledge them: a `record` that raises leaves them in the queue for the next sweep.
    The reason is RabbitMQ's: "delivery_limit" (delivered AMQP_DELIVERY_LIMIT + 1 times),
    "expired" (Celery's `expires`, sent as the message's TTL), "rejected". Returns how many
    were taken."""
    with current_app.connection_for_read() as connection:
        queue = undeliverable_queue()(connection.default_channel)
        queue.declare()
        taken = []
        for _ in range(most):
            message = queue.get(no_ack=False, accept=["json", "application/json"])
            if message is None:
                break
            taken.append(message)
        if not taken:
            return 0
        found = [
            (str(headers["id"]), death_reason(headers))
            for message in taken
            if (headers := message.headers or {}).get("id")
        ]
        try:
            record(found)
        except Exception:
            for message in taken:
                message.requeue()
            raise
        for message in taken:
            message.ack()
    return len(taken)


def death_reason(headers: dict[str, Any]) -> str:
    """Why RabbitMQ dead-lettered a message (its x-first-death-reason, or the first x-death)."""
    reason = headers.get("x-first-death-reason")
    if not reason:
        deaths = headers.get("x-death") or [{}]
        reason = deaths[0].get("reason") if isinstance(deaths[0], dict) else None
    return str(reason or "delivery_limit")
