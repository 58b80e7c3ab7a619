"""Pause and resume a queue: jobs are still accepted (202), no worker takes them until resumed.

The flag is a Redis set, ``backlot:paused`` (durable with AOF, shared by every process). Each
worker keeps its own consumption in line with it, in its event loop:

- at start (``worker_ready``, before the loop fetches its first message) it stops consuming
  the paused queues it was told to consume, and remembers them;
- every SYNC_SECONDS, and at once when ``pause()`` / ``resume()`` broadcast
  ``backlot_sync_pauses``, it compares the queues it consumes with the flag: a paused one is
  cancelled and remembered, a remembered one that is no longer paused is added back.

Only what a worker itself withheld comes back on resume: a worker started with ``-Q media``
never starts consuming ``reports`` because ``reports`` was resumed. One code path for start,
broadcast and tick means a worker that missed the broadcast (busy, partitioned) converges
within SYNC_SECONDS, with no ``inspect()`` round that waits for replies and misses the busy.

A message a worker had already taken when the pause came (with prefetch 1 and acks_late: at
most one per pool process, usually none waiting besides those running) still runs, once.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from celery import current_app
from celery.signals import worker_ready
from celery.worker.control import control_command
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from jobs.broker.redis import redis_client, redis_text
from jobs.core.conf import backlot_settings

logger = logging.getLogger(__name__)

PAUSED_KEY = "backlot:paused"  # set of paused queue names: the flag itself
PAUSED_DETAIL_KEY = "backlot:paused:detail"  # queue -> {"at": ISO time, "by": who}
SYNC_COMMAND = "backlot_sync_pauses"
# How often a worker re-reads the flag (one SMEMBERS): the bound for a worker that missed the
# broadcast; "workers stop taking a paused queue within 2 s" leaves a second for the rest.
SYNC_SECONDS = 1.0


def _configured(queue: str) -> str:
    queues = backlot_settings().QUEUES
    if queue not in queues:
        raise ValueError(f"Unknown queue {queue!r}; the configured queues are: {', '.join(queues)}")
    return queue


def pause(queue: str, *, by: Any = None) -> bool:
    """Pause `queue`: enqueue still accepts its jobs, workers stop taking them within about
    SYNC_SECONDS. Returns False when it was paused already. ValueError for an unknown queue."""
    _configured(queue)
    detail = json.dumps({"at": timezone.now().isoformat(), "by": _who(by)})
    pipe = redis_client().pipeline(transaction=True)
    pipe.sadd(PAUSED_KEY, queue)
    pipe.hsetnx(PAUSED_DETAIL_KEY, queue, detail)
    added = bool(pipe.execute()[0])
    logger.info("Queue %s paused by %s", queue, _who(by))
    _broadcast()
    return added


def resume(queue: str, *, by: Any = None) -> bool:
    """Resume `queue`: the workers that withheld it consume it again. Returns False when it
    was not paused. ValueError for an unknown queue."""
    _configured(queue)
    pipe = redis_client().pipeline(transaction=True)
    pipe.srem(PAUSED_KEY, queue)
    pipe.hdel(PAUSED_DETAIL_KEY, queue)
    removed = bool(pipe.execute()[0])
    logger.info("Queue %s resumed by %s", queue, _who(by))
    _broadcast()
    return removed


def paused_queues() -> frozenset[str]:
    """The queues paused now."""
    return frozenset(redis_text(name) for name in redis_client().smembers(PAUSED_KEY))


def pause_detail() -> dict[str, dict[str, Any]]:
    """Paused queue -> {"at": ISO time, "by": who paused it (or None)}."""
    raw = redis_client().hgetall(PAUSED_DETAIL_KEY)
    return {redis_text(k): json.loads(redis_text(v)) for k, v in raw.items()}


def _who(by: Any) -> str | None:
    if by is None:
        return None
    return str(getattr(by, "get_username", lambda: by)())


def _broadcast() -> None:
    """Ask every worker to compare its queues with the flag now; one that does not hear it
    catches up at its next tick."""
    try:
        current_app.control.broadcast(SYNC_COMMAND, reply=False)
    except (KombuError, OSError) as exc:
        logger.warning(
            "Could not tell the workers (they catch up within %ss): %s", SYNC_SECONDS, exc
        )


# --- the worker side ------------------------------------------------------------------------
class QueueGate:
    """One worker's consumption against the pause flag; lives on its consumer, runs in its
    event loop (the timer and control commands both run there, so it needs no lock)."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        # Paused queues this worker was consuming and cancelled: the ones resume adds back.
        self.withheld: set[str] = set()
        self.failing = False

    def consumed(self) -> set[str]:
        task_consumer = self.consumer.task_consumer
        return {q.name for q in task_consumer.queues} if task_consumer else set()

    def sync(self) -> None:
        """Cancel paused queues this worker consumes, add back withheld ones resumed since."""
        try:
            paused = paused_queues()
        except (RedisError, OSError) as exc:
            if not self.failing:  # once per outage, not every second
                logger.warning("Cannot read paused queues; keeping the current ones: %s", exc)
            self.failing = True
            return
        self.failing = False
        for queue in sorted(self.consumed() & paused):
            self.consumer.cancel_task_queue(queue)
            self.withheld.add(queue)
            logger.info("Queue %s is paused: not consuming it", queue)
        for queue in sorted(self.withheld - paused):
            self.consumer.add_task_queue(queue)
            self.withheld.discard(queue)
            logger.info("Queue %s resumed: consuming it again", queue)


@worker_ready.connect
def gate_worker_queues(sender: Any = None, **kwargs: Any) -> None:
    """When a worker is ready (its consumer set up, no message fetched yet): withhold the
    paused queues, then re-check every SYNC_SECONDS on its event-loop timer."""
    consumer = sender
    if consumer is None or getattr(consumer, "task_consumer", None) is None:
        return
    gate = QueueGate(consumer)
    consumer.backlot_queue_gate = gate
    gate.sync()
    consumer.timer.call_repeatedly(SYNC_SECONDS, gate.sync)


@control_command(name=SYNC_COMMAND)
def sync_pauses(state: Any) -> dict[str, Any]:
    """Remote control: compare this worker's queues with the pause flag now."""
    gate = getattr(state.consumer, "backlot_queue_gate", None)
    if gate is None:
        return {"ok": "not ready"}
    gate.sync()
    return {"ok": "synced", "withheld": sorted(gate.withheld)}
