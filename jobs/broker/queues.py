"""What the broker's queues hold: their Redis lists, depths, the unacknowledged count, the ids
of the jobs whose message the broker holds, and the queues that are idle (RabbitMQ: what it can
tell). Read by the relay's reconcile, the queues API and the metrics; nothing here publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from celery import current_app
from kombu.utils.json import loads
from redis.exceptions import RedisError

from jobs.broker import amqp
from jobs.broker.broker import BROKER_ERRORS
from jobs.broker.redis import redis_client


def _transport_options() -> dict[str, Any]:
    return dict(current_app.conf.broker_transport_options or {})


def queue_keys(queue: str) -> list[str]:
    """Redis list names kombu uses for a queue, one per priority level."""
    options = _transport_options()
    sep = options.get("sep", ":")
    steps = options.get("priority_steps") or list(range(10))
    return [queue if step == 0 else f"{queue}{sep}{step}" for step in steps]


def queue_depths(queues: Sequence[str]) -> dict[str, int]:
    """Messages waiting in the broker per queue (in Redis every priority level, in one
    pipelined round)."""
    if amqp.enabled():
        return amqp.queue_depths(queues)
    keys = {queue: queue_keys(queue) for queue in queues}
    pipe = redis_client().pipeline(transaction=False)
    for queue_key_list in keys.values():
        for key in queue_key_list:
            pipe.llen(key)
    lengths = iter(pipe.execute())
    return {
        queue: sum(next(lengths) for _ in queue_key_list) for queue, queue_key_list in keys.items()
    }


def unacknowledged() -> int:
    """Messages taken by some worker and not acknowledged yet (kombu's `unacked` hash)."""
    return int(redis_client().hlen("unacked"))


# The most messages held_job_ids reads in one call (a queue's lists and the unacked hash): a
# queue holding more is left to the visibility-timeout reconcile. Measured on this 2-core
# machine under load: 5,000 messages of 741 bytes took 110-190 ms to read and parse, so 2,000
# (~40-75 ms), at most once per queue every 10 s (jobs.relay).
MAX_SCANNED = 2000


def held_job_ids(queue: str) -> set[str] | None:
    """Ids of the jobs whose message Redis holds for `queue` (waiting in one of its lists) or
    anywhere in a worker's hands (unacknowledged, prefetched or counting down), read in one
    MULTI; None when that is more than MAX_SCANNED messages or Redis cannot tell.

    With BACKLOT['ATOMIC_FETCH'] off, a message a consumer popped and has not yet recorded in
    `unacked` (kombu's BRPOP and its unacked write are two round trips) is in neither: one read
    at that instant over-reports it missing, and its re-sent copy is dropped at claim (with it
    on, jobs.broker.fetch pops and records a message in one step). RabbitMQ cannot tell."""
    if amqp.enabled():
        return None
    connection: Any
    try:
        # The broker's own Redis (its URL, database, key prefix, Sentinel), which need not be
        # the platform's REDIS_URL: reading another would report every message missing.
        with current_app.pool.acquire(block=True, timeout=5) as connection:
            channel = connection.default_channel
            prefix = channel.global_keyprefix or ""
            client = redis.Redis(connection_pool=channel.client.connection_pool)
            keys = [f"{prefix}{key}" for key in queue_keys(queue)]
            unacked = f"{prefix}{channel.unacked_key}"
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.llen(key)
            pipe.hlen(unacked)
            if sum(pipe.execute()) > MAX_SCANNED:
                return None
            pipe = client.pipeline(transaction=True)
            for key in keys:
                pipe.lrange(key, 0, -1)
            pipe.hvals(unacked)
            *lists, taken = pipe.execute()
    except (*BROKER_ERRORS, TimeoutError):
        return None
    ids = [_message_id(raw) for found in lists for raw in found]
    ids += [_message_id(loads(stored)[0]) for stored in taken]
    return {job_id for job_id in ids if job_id is not None}


def _message_id(message: Any) -> str | None:
    """The task id of a Celery message (protocol 2: in its headers), raw or decoded."""
    try:
        body = loads(message) if isinstance(message, (bytes, str)) else message
        job_id = body["headers"]["id"]
    except (KeyError, TypeError, ValueError):
        return None
    return job_id if isinstance(job_id, str) else None


def idle_queues(queues: Sequence[str]) -> list[str]:
    """The queues that hold no message in Redis, when nothing is unacknowledged either; []
    when Redis cannot tell. On RabbitMQ: the queues with no message ready. A message may then
    still be in a worker's hands (prefetched behind a long job), so a job re-sent because its
    queue looked idle can have a second copy: the later of the two is dropped at claim."""
    if amqp.enabled():
        try:
            return [queue for queue, depth in queue_depths(queues).items() if not depth]
        except BROKER_ERRORS:
            return []
    try:
        if unacknowledged():
            return []
        return [queue for queue, depth in queue_depths(queues).items() if not depth]
    except (RedisError, OSError):
        return []
